"""Turning a request into prompt token ids: chat templates and exact multi-turn prefixes.

Re-rendering a chat's history as text and tokenizing it again does not always
give back the ids the model sampled (BPE merges across a turn boundary; some
templates render past turns differently from the generation prompt; docs/acceptance.md,
exact multi-turn token ids). So a request may carry the exact ids of the chat so far
(``prefix_token_ids``); when the template's text for the whole chat starts with
the text of those ids, the prompt is those ids plus the tokenized remainder,
and turn N+1 shares turn N's KV exactly. Otherwise the full render is used.
"""

from __future__ import annotations

import functools
from typing import Any

from engine.errors import InvalidRequestError
from engine.outputs import GenerateRequest
from engine.text_checks import text_error

ROLES = ("system", "user", "assistant")


def _as_id_list(x: Any) -> list[int]:
    """apply_chat_template(tokenize=True) returns a list, or a BatchEncoding in newer
    transformers; normalise to a flat list of ints."""
    if hasattr(x, "keys") and "input_ids" in x:
        x = x["input_ids"]
    if hasattr(x, "tolist"):
        x = x.tolist()
    if x and isinstance(x[0], list):
        x = x[0]
    return [int(t) for t in x]


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """Check a chat: a non-empty list of {"role", "content"} with known roles and string
    content that is valid Unicode (``engine.text_checks``).

    Raises:
        InvalidRequestError: naming the first bad message.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string")
        bad_text = text_error(content, f"messages[{i}].content")
        if bad_text is not None:
            raise InvalidRequestError(bad_text)
        out.append({"role": role, "content": content})
    return out


class PromptBuilder:
    """Builds prompt ids with the model's tokenizer and chat template.

    Args:
        tokenizer: a transformers tokenizer with a chat template (for ``messages``).
        vocab_size: the model's vocabulary size (token ids must be below it).
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def render_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """``apply_chat_template(messages, tokenize=True, add_generation_prompt=True)``.

        Raises:
            InvalidRequestError: the model has no chat template, or rendering failed.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; send prompt_token_ids instead")
        try:
            return _as_id_list(
                self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            )
        except Exception as e:  # template errors (e.g. role alternation rules)
            raise InvalidRequestError(f"chat template failed: {e}") from None

    def build(self, req: GenerateRequest) -> tuple[list[int], bool]:
        """Prompt ids for a request and whether ``prefix_token_ids`` were reused as is.

        Raises:
            InvalidRequestError: neither or both of messages / prompt_token_ids, bad ids,
                bad messages, an empty prompt, or ``continued_tokens`` that are not a
                part of ``prompt_token_ids`` after its first token.
        """
        if (req.messages is None) == (req.prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of messages or prompt_token_ids")
        if req.continued_tokens and req.prompt_token_ids is None:
            raise InvalidRequestError("continued_tokens needs prompt_token_ids (the prompt ending with the reply)")
        if req.prompt_token_ids is not None:
            ids = self._check_ids(req.prompt_token_ids, "prompt_token_ids")
            if not ids:
                raise InvalidRequestError("prompt_token_ids is empty")
            if not 0 <= req.continued_tokens < len(ids):
                raise InvalidRequestError(f"continued_tokens must be in [0, {len(ids) - 1}] for a prompt of "
                                          f"{len(ids)} tokens, got {req.continued_tokens}")
            return ids, False
        messages = validate_messages(req.messages)
        prefix = self._check_ids(req.prefix_token_ids or [], "prefix_token_ids")
        if prefix:
            rest = self._suffix_after_prefix(messages, prefix)
            if rest is not None:
                tail = self.tokenizer.encode(rest, add_special_tokens=False) if rest else []
                return prefix + [int(t) for t in tail], True
        return self.render_ids(messages), False

    def shared_length(self, prompt_ids: list[int], shared_messages: list[dict[str, str]] | None) -> int:
        """How many leading tokens of ``prompt_ids`` hold only the declared-shared leading
        messages and the chat template's own text (tokens; the caller rounds down to pages).

        The template is rendered with ``shared_messages`` followed by an empty message of
        the next role (so a template that adds its default system prompt to a chat without
        one does so here too), and the answer is the common prefix of those ids with
        ``prompt_ids``. Whatever the caller declares, the count never covers a token that
        is not in that render: text that is neither declared nor the template's is never
        shared. 0 when the model has no chat template or it rejects the messages.

        Raises:
            InvalidRequestError: ``shared_messages`` is not a list of valid messages.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            return 0
        msgs = validate_messages(shared_messages) if shared_messages else []
        next_role = "assistant" if msgs and msgs[-1]["role"] == "user" else "user"
        ref = self._shared_render(tuple((m["role"], m["content"]) for m in msgs), next_role)
        n = 0
        for a, b in zip(ref, prompt_ids):
            if a != b:
                break
            n += 1
        return n

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one builder per engine, kept for its life
    def _shared_render(self, messages: tuple[tuple[str, str], ...], next_role: str) -> tuple[int, ...]:
        chat = [{"role": r, "content": c} for r, c in messages] + [{"role": next_role, "content": ""}]
        try:
            return tuple(_as_id_list(self.tokenizer.apply_chat_template(chat, tokenize=True,
                                                                        add_generation_prompt=False)))
        except Exception:  # a template that rejects this shape: nothing is shared
            return ()

    def _render_text(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _suffix_after_prefix(self, messages: list[dict[str, str]], prefix: list[int]) -> str | None:
        """The text that follows the prefix ids in the rendered prompt, or None when the
        prefix cannot be reused.

        Two cases: (a) the rendered prompt starts with the prefix's text: the rest
        follows; (b) the template renders past assistant turns differently from how
        the model saw them (exact multi-turn token ids (docs/acceptance.md), e.g. thinking blocks dropped from history):
        the prefix ids are replayed as they were, followed by what the template
        renders after the last assistant message's content (its end-of-turn text)
        and the new turn(s).
        """
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        try:
            full = self._render_text(messages, True)
            head = self.tokenizer.decode(prefix, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except Exception:  # a template that rejects the chat is reported by render_ids
            return None
        if not isinstance(full, str) or not head:
            return None
        if full.startswith(head):
            return full[len(head):]
        k = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1) + 1
        content = messages[k - 1]["content"] if k else ""
        if not content:
            return None
        try:
            hist = self._render_text(messages[:k], False)
        except Exception:
            return None
        i, j = hist.rfind(content), head.rfind(content)
        if not full.startswith(hist) or i < 0 or j < 0:
            return None
        tail, seen = hist[i + len(content):], head[j + len(content):]
        if not tail.startswith(seen):
            return None
        return tail[len(seen):] + full[len(hist):]

    def lint_template(self) -> list[str]:
        """Warnings about a chat template whose history rendering differs from what the
        model saw at generation time (then multi-turn reuse relies on exact ids)."""
        if not getattr(self.tokenizer, "chat_template", None):
            return ["the model has no chat template: only prompt_token_ids requests work"]
        chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        try:
            gen = self._render_text(chat, True) + "A"
            hist = self._render_text(chat + [{"role": "assistant", "content": "A"}], False)
        except Exception as e:
            return [f"the chat template failed on a simple chat: {e}"]
        if not hist.startswith(gen):
            return ["the chat template renders past assistant turns differently from the generation "
                    "prompt; multi-turn prefix reuse relies on the exact token ids the gateway stores"]
        return []

    def encode_text(self, text: str) -> list[int]:
        """Plain (non-chat) prompt: the tokenizer's own special-token policy applies."""
        return [int(t) for t in self.tokenizer.encode(text)]

    def _check_ids(self, ids: Any, name: str) -> list[int]:
        if not isinstance(ids, list) or any(
            not isinstance(t, int) or isinstance(t, bool) or not (0 <= t < self.vocab_size) for t in ids
        ):
            raise InvalidRequestError(f"{name} must be a list of token ids in [0, {self.vocab_size})")
        return list(ids)
