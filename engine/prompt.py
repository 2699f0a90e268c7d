"""Turning a request into prompt token ids: chat templates and exact multi-turn prefixes.

Re-rendering a chat's history as text and tokenizing it again does not always
give back the ids the model sampled (BPE merges across a turn boundary; some
templates render past turns differently from the generation prompt; docs/acceptance.md,
exact multi-turn token ids). So a request may carry the exact ids of the chat so far
(``prefix_token_ids``); when the template's text for the whole chat starts with
the text of those ids, the prompt is those ids plus the tokenized remainder,
and turn N+1 shares turn N's KV exactly. Otherwise the full render is used.

Tools reach the prompt in the model's own format (``engine.tools.formats``): through
the chat template's ``tools`` argument when the template renders tools, else as the
engine's generic instructions in a system message; past calls (an assistant message's
``tool_calls``) and their results (``tool`` messages) likewise. A request may also
continue its final assistant message instead of answering it
(``continue_final_message``), or be a raw text prompt without any template.
Standard library only (the gateway builds routing ids with it).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.outputs import GenerateRequest
from engine.text_checks import text_error
from engine.tools.formats import ToolFormat, template_messages, tool_format_for

ROLES = ("system", "user", "assistant", "tool")
MAX_TOOL_CALLS_PER_MESSAGE = 128

# the reasoning markers a chat template may declare (``PromptBuilder.thinking``)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


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


def _text(value: Any, field: str) -> str:
    """A string field that must be valid Unicode text."""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field} must be a string")
    bad_text = text_error(value, field)
    if bad_text is not None:
        raise InvalidRequestError(bad_text)
    return value


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a chat: a non-empty list of {"role", "content"} with known roles and string
    content that is valid Unicode (``engine.text_checks``).

    An assistant message may carry ``tool_calls`` (OpenAI's shape: ``[{"id", "type":
    "function", "function": {"name", "arguments": JSON text}}]``), and then its content
    may be null or absent; a ``tool`` message carries the result of the call named by its
    ``tool_call_id`` (and optionally the function's ``name``).

    Returns:
        Each message as ``{"role", "content": str}`` (null content as ""), plus
        ``tool_calls`` as ``[{"id", "name", "arguments"}]`` and ``tool_call_id``/``name``
        where given.

    Raises:
        InvalidRequestError: naming the first bad message or field.
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
        calls = m.get("tool_calls")
        if content is None and role == "assistant" and calls:
            content = ""
        msg: dict[str, Any] = {"role": role, "content": _text(content, f"messages[{i}].content")}
        if calls is not None:
            if role != "assistant":
                raise InvalidRequestError(f"messages[{i}]: only assistant messages carry tool_calls")
            msg["tool_calls"] = _tool_calls(calls, f"messages[{i}].tool_calls")
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    msg[key] = _text(m[key], f"messages[{i}].{key}")
        out.append(msg)
    return out


def _tool_calls(calls: Any, field: str) -> list[dict[str, str]]:
    """An assistant message's ``tool_calls`` as ``[{"id", "name", "arguments"}]``."""
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS_PER_MESSAGE:
        raise InvalidRequestError(f"{field} must be a list of at most {MAX_TOOL_CALLS_PER_MESSAGE} calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function":
            raise InvalidRequestError(f'{field}[{j}] must be {{"id", "type": "function", "function": '
                                      '{"name", "arguments"}}')
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):  # some clients send the object itself
            args = json.dumps(args, ensure_ascii=False)
        out.append({"id": _text(c.get("id", ""), f"{field}[{j}].id"),
                    "name": _text(fn.get("name"), f"{field}[{j}].function.name"),
                    "arguments": _text(args, f"{field}[{j}].function.arguments")})
    return out


@dataclass(frozen=True)
class RenderOptions:
    """How a chat is rendered beyond its messages.

    Attributes:
        tools: the tools for the template's ``tools`` argument (OpenAI's shape), or None.
        continue_final: continue the final assistant message (no end of turn after it,
            no generation prompt) instead of starting a new reply.
    """

    tools: list[dict[str, Any]] | None = None
    continue_final: bool = False


class PromptBuilder:
    """Builds prompt ids with the model's tokenizer and chat template.

    Args:
        tokenizer: a transformers tokenizer with a chat template (for ``messages``).
        vocab_size: the model's vocabulary size (token ids must be below it).
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.tool_format: ToolFormat = tool_format_for(getattr(tokenizer, "chat_template", None))

    def render_ids(self, messages: list[dict[str, Any]], options: RenderOptions = RenderOptions()) -> list[int]:
        """``apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`` (or
        continuing the final message, with ``options``).

        Raises:
            InvalidRequestError: the model has no chat template, or rendering failed.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; send prompt_token_ids instead")
        try:
            return _as_id_list(self.tokenizer.apply_chat_template(messages, tokenize=True, **self._kwargs(
                options, True)))
        except Exception as e:  # template errors (e.g. role alternation rules)
            raise InvalidRequestError(f"chat template failed: {e}") from None

    @staticmethod
    def _kwargs(options: RenderOptions, generation_prompt: bool) -> dict[str, Any]:
        kw: dict[str, Any] = {"add_generation_prompt": generation_prompt and not options.continue_final}
        if options.continue_final:
            kw["continue_final_message"] = True
        if options.tools:
            kw["tools"] = options.tools
        return kw

    def chat(self, req: GenerateRequest) -> tuple[list[dict[str, Any]], RenderOptions]:
        """The messages and options the template renders for a chat request: tools in the
        model's format (``engine.tools.formats.template_messages``).

        Raises:
            InvalidRequestError: bad messages, or ``continue_final_message`` without a
                final assistant message.
        """
        messages = validate_messages(req.messages)
        if req.continue_final_message and messages[-1]["role"] != "assistant":
            raise InvalidRequestError("continue_final_message needs the last message to be the assistant's")
        rendered, tools = template_messages(messages, self.tool_format, req.tools)
        return rendered, RenderOptions(tools=tools, continue_final=req.continue_final_message)

    def build(self, req: GenerateRequest) -> tuple[list[int], bool]:
        """Prompt ids for a request and whether ``prefix_token_ids`` were reused as is.

        Raises:
            InvalidRequestError: not exactly one of messages / prompt_token_ids / prompt,
                bad ids, bad messages, an empty prompt, or ``continued_tokens`` that are not
                a part of ``prompt_token_ids`` after its first token.
        """
        given = [x is not None for x in (req.messages, req.prompt_token_ids, req.prompt)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of messages, prompt_token_ids or prompt")
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
        if req.prompt is not None:
            ids = self.encode_text(_text(req.prompt, "prompt"))
            if not ids:
                raise InvalidRequestError("the prompt is empty")
            return ids, False
        messages, options = self.chat(req)
        prefix = self._check_ids(req.prefix_token_ids or [], "prefix_token_ids")
        if prefix:
            rest = self._suffix_after_prefix(messages, prefix, options)
            if rest is not None:
                tail = self.tokenizer.encode(rest, add_special_tokens=False) if rest else []
                return prefix + [int(t) for t in tail], True
        return self.render_ids(messages, options), False

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

    def _render_text(self, messages: list[dict[str, Any]], generation_prompt: bool,
                     options: RenderOptions = RenderOptions()) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **self._kwargs(options, generation_prompt))

    def _suffix_after_prefix(self, messages: list[dict[str, Any]], prefix: list[int],
                             options: RenderOptions = RenderOptions()) -> str | None:
        """The text that follows the prefix ids in the rendered prompt, or None when the
        prefix cannot be reused.

        Two cases: (a) the rendered prompt starts with the prefix's text: the rest
        follows; (b) the template renders past assistant turns differently from how
        the model saw them (exact multi-turn token ids (docs/acceptance.md#exact-multi-turn-token-ids), e.g. thinking
        blocks dropped from history):
        the prefix ids are replayed as they were, followed by what the template
        renders after the last assistant message's content (its end-of-turn text)
        and the new turn(s).
        """
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        try:
            full = self._render_text(messages, True, options)
            head = self.tokenizer.decode(prefix, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except Exception:  # a template that rejects the chat is reported by render_ids
            return None
        if not isinstance(full, str) or not head:
            return None
        if full.startswith(head):
            return full[len(head):]
        if options.continue_final:
            return None  # the history's end-of-turn text is not part of this render
        k = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1) + 1
        content = messages[k - 1]["content"] if k else ""
        if not content:
            return None
        try:
            hist = self._render_text(messages[:k], False, options)
        except Exception:
            return None
        i, j = hist.rfind(content), head.rfind(content)
        if not full.startswith(hist) or i < 0 or j < 0:
            return None
        tail, seen = hist[i + len(content):], head[j + len(content):]
        if not tail.startswith(seen):
            return None
        return tail[len(seen):] + full[len(hist):]

    def thinking(self) -> tuple[list[str], bool]:
        """The reasoning markers the chat template declares and whether its generation
        prompt opens them.

        Returns:
            ``(["<think>", "</think>"], in_prompt)`` when the template names both markers
            (the form Qwen3, DeepSeek-R1 and their kin write reasoning in), else ``([],
            False)``. ``in_prompt``: the generation prompt ends with the opening marker
            (DeepSeek-R1's template), so the reply starts inside the reasoning.
        """
        t = getattr(self.tokenizer, "chat_template", None)
        if not isinstance(t, str) or THINK_OPEN not in t or THINK_CLOSE not in t:
            return [], False
        try:
            prompt = self._render_text([{"role": "user", "content": "U"}], True)
        except Exception:  # a template that rejects a one-message chat is reported elsewhere
            return [THINK_OPEN, THINK_CLOSE], False
        return [THINK_OPEN, THINK_CLOSE], isinstance(prompt, str) and prompt.rstrip().endswith(THINK_OPEN)

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
