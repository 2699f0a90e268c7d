"""llama-server's native completion API, ``POST /completion`` (docs/protocol.md section 4,
"llama-server's /completion").

The body is translated onto ``/v1/completions`` (``completions.parse_completion_request``,
the same engine path): ``prompt`` (a string, token ids, ``{"prompt_string": text}``, one
sequence mixing token ids and texts (each text's tokens spliced in its place), or a list
of those, each its own answer), ``n_predict`` (``max_tokens``; absent or negative: the
server's default), ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop``,
``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``, ``ignore_eos``,
``return_tokens``, ``stream``, ``logit_bias`` (``llama_logit_bias``), ``n_probs``
(``logprobs``: alternatives per token, answered as ``completion_probabilities``; with
``post_sampling_probs`` as the probabilities the sampler drew from, the engine's
``processed_logprobs``).
llama-server's slot and cache knobs (``cache_prompt``, ``id_slot``, ``n_keep``...) are
accepted and ignored (this server has no slots; its prefix cache is always on); multimodal
data and anything else unknown is a 400.

The answer has the keys llama.cpp clients read: ``content``, ``stop`` (true),
``tokens`` (the reply's ids with ``return_tokens``, else empty), ``tokens_predicted``,
``tokens_evaluated``, ``stop_type`` (``eos``, ``word`` or ``limit``), ``stopping_word``,
``truncated`` (always false: a prompt too long is refused, never cut), ``has_new_line``,
``generation_settings`` (the sampling settings sent) and ``timings`` (llama-server's object,
``reply_collect.llama_timings``: ``prompt_n`` prompt tokens computed, ``cache_n`` those
reused from the prefix cache, ``predicted_n``, their ms and rates); a list of those for
several prompts. Streamed, each
SSE event is ``{"index", "content", "tokens": [], "stop": false}``, and each prompt's last
event is its whole answer without the text, ``stop`` true; no ``[DONE]``, as llama-server.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gateway.api.completions import CompletionRequest, parse_completion_request
from gateway.api.openai_chat import openai_error_event
from gateway.api.openai_replies import Delta, Finished, ReplyEvent
from gateway.api.openai_request import bad
from gateway.api.reply_collect import ChoiceReply, CollectingWriter, finished_timings
from gateway.api.sse import json_bytes, sse

# llama-server's name -> ours (the same meaning)
_RENAMED = {"n_predict": "max_tokens", "repeat_penalty": "repetition_penalty", "n_probs": "logprobs"}
_SAME = ("prompt", "logit_bias", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "presence_penalty",
         "frequency_penalty", "ignore_eos", "stream", "model")
# llama-server's slot, cache and reporting knobs: nothing to do here (no slots; the prefix cache is always on)
# (backend_sampling: where llama-server samples, not what it samples from)
_IGNORED = frozenset({"cache_prompt", "id_slot", "slot_id", "n_keep", "n_indent", "t_max_predict_ms",
                      "t_max_prompt_ms", "response_fields", "timings_per_token", "return_progress", "n_cmpl",
                      "backend_sampling"})
_SETTINGS = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "ignore_eos")


def _prompt(p: Any) -> Any:
    """llama-server's ``{"prompt_string": text}`` object as its text (other parts refused)."""
    if isinstance(p, dict):
        extra = sorted(k for k in p if k != "prompt_string")
        if extra:
            raise bad(f"prompt part '{extra[0]}' is not supported (text and token prompts only)", "prompt")
        return p.get("prompt_string")
    return p


def llama_logit_bias(value: Any, tokenize: Callable[[str], list[int]] | None) -> Any:
    """llama-server's ``logit_bias`` (``[[token, bias], ...]`` or ``{token: bias}``, a token
    being an id, a string of digits, or a text whose every token gets the bias; bias
    ``false``: never) as OpenAI's ``{id: bias}``. Anything else is returned as it is, for
    the usual check to refuse. ``tokenize`` (the served tokenizer) is needed only for texts.

    Raises:
        OpenAIError: 400 for a text without ``tokenize``.
    """
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        return value
    out: dict[str, Any] = {}
    for key, bias in pairs:
        bias = -100 if bias is False else bias
        if isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        elif isinstance(key, str) and key.isdigit():
            ids = [int(key)]
        elif isinstance(key, str) and tokenize is not None:
            ids = tokenize(key)
        else:
            raise bad("logit_bias keys must be token ids or texts", "logit_bias")
        out.update({str(i): bias for i in ids})
    return out


def _is_mixed(p: Any) -> bool:
    """A prompt that is one sequence of token ids and texts (llama-server's mixed prompt)."""
    return (isinstance(p, list) and any(isinstance(x, str) for x in p)
            and any(isinstance(x, int) and not isinstance(x, bool) for x in p)
            and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in p))


def _splice(p: list[Any], tokenize: Callable[[str], list[int]] | None) -> list[int]:
    """A mixed prompt as token ids: each text's tokens in its place (no special tokens added).

    Raises:
        OpenAIError: 400 without ``tokenize``.
    """
    if tokenize is None:
        raise bad("a prompt mixing token ids and texts needs the served tokenizer", "prompt")
    return [t for x in p for t in (tokenize(x) if isinstance(x, str) else [x])]


def needs_tokenizer(body: Any) -> bool:
    """The body's ``logit_bias`` names a token by its text, or a prompt mixes token ids and texts."""
    bias = body.get("logit_bias") if isinstance(body, dict) else None
    keys = bias.keys() if isinstance(bias, dict) else [p[0] for p in bias if isinstance(p, list) and p] \
        if isinstance(bias, list) else []
    prompt = body.get("prompt") if isinstance(body, dict) else None
    mixed = _is_mixed(prompt) or (isinstance(prompt, list) and any(_is_mixed(x) for x in prompt))
    return mixed or any(isinstance(k, str) and not k.isdigit() for k in keys)


def parse_llama_completion(body: Any, tokenize: Callable[[str], list[int]] | None = None
                           ) -> tuple[CompletionRequest, bool]:
    """Validate a decoded ``/completion`` body: the equivalent completions request and
    whether to return the reply's token ids (``tokenize``: the served tokenizer, for a
    ``logit_bias`` that names tokens by their text).

    Raises:
        OpenAIError: 400 naming the first bad or unsupported field.
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    out: dict[str, Any] = {}
    for k, v in body.items():
        if k in _IGNORED or k in ("return_tokens", "post_sampling_probs") or (k == "n_probs" and v == 0):
            continue
        if k in _RENAMED:
            out[_RENAMED[k]] = v
        elif k in _SAME:
            out[k] = v
        else:
            raise bad(f"'{k}' is not supported by this server's /completion", k)
    if "logit_bias" in out:
        out["logit_bias"] = llama_logit_bias(out["logit_bias"], tokenize)
    if "prompt" in out:
        p = out["prompt"]
        if _is_mixed(p):
            out["prompt"] = _splice(p, tokenize)
        else:
            out["prompt"] = [_splice(x, tokenize) if _is_mixed(x) else _prompt(x) for x in p] if isinstance(
                p, list) and any(isinstance(x, (dict, str, list)) for x in p) else _prompt(p)
    n_predict = out.get("max_tokens")
    if "max_tokens" in out and (not isinstance(n_predict, int) or isinstance(n_predict, bool)):
        raise bad("'n_predict' must be an integer", "n_predict")
    if isinstance(n_predict, int) and n_predict < 0:
        del out["max_tokens"]  # llama-server's "no limit": the server's default
    return_tokens = body.get("return_tokens", False)
    if not isinstance(return_tokens, bool):
        raise bad("'return_tokens' must be a boolean", "return_tokens")
    post_sampling = body.get("post_sampling_probs", False)
    if not isinstance(post_sampling, bool):
        raise bad("'post_sampling_probs' must be a boolean", "post_sampling_probs")
    creq = parse_completion_request(out)
    params = {k: v for k, v in creq.params.items() if k != "max_tokens" or "max_tokens" in out}
    if post_sampling and "logprobs" in params:
        params["processed_logprobs"] = True  # the engine reports the distribution it drew from
    creq = CompletionRequest(creq.prompts, creq.model, params, creq.n, creq.logprobs, creq.echo,
                             creq.stream, creq.include_usage)
    return creq, return_tokens


def _probabilities(entries: list[dict[str, Any]], post_sampling: bool = False) -> list[dict[str, Any]]:
    """Engine logprob entries in llama-server's ``completion_probabilities`` layout; with
    ``post_sampling`` (the engine's ``processed_logprobs``) as probabilities, ``prob`` and
    ``top_probs``, leaving out the alternatives the sampler could not draw (probability 0)."""
    if post_sampling:
        def prob(e: dict[str, Any]) -> dict[str, Any]:
            return {"id": e["token_id"], "token": e["token"], "prob": math.exp(e["logprob"]), "bytes": e["bytes"]}

        return [{**prob(e), "top_probs": [p for p in map(prob, e.get("top", [])) if p["prob"] > 0.0]}
                for e in entries]

    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"id": e["token_id"], "token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}

    return [{**one(e), "top_logprobs": [one(t) for t in e.get("top", [])]} for e in entries]


def _stop_type(done: Finished) -> str:
    if done.finish_reason == "length":
        return "limit"
    if isinstance(done.stop_reason, str):
        return "word"
    return "eos" if done.finish_reason == "stop" else "none"


class LlamaCompletionWriter(CollectingWriter):
    """Builds llama-server's ``/completion`` answer from the engine's events
    (``openai_api.Writer``).

    Args:
        creq: the translated request.
        return_tokens: put the reply's token ids in ``tokens``.
        model: the served model's name.
    """

    def __init__(self, creq: CompletionRequest, return_tokens: bool, model: str) -> None:
        self.creq = creq
        self.return_tokens = return_tokens
        self.model = model
        self.choices: list[ChoiceReply] = [ChoiceReply() for _ in creq.prompts]

    def _final(self, index: int, content: str) -> dict[str, Any]:
        done = self.choices[index].done
        prompt = self.creq.prompts[index]
        u = done.usage
        predicted = int(u.get("completion_tokens", len(done.output_token_ids)))
        evaluated = int(u.get("prompt_tokens", len(done.prompt_token_ids)))
        cached = int(u.get("cached_tokens", 0))
        settings = {"n_predict": self.creq.params.get("max_tokens", -1),
                    **{k: self.creq.params[k] for k in _SETTINGS if k in self.creq.params}}
        return {"index": index, "content": content, "id_slot": -1, "stop": True, "model": self.model,
                "tokens": list(done.output_token_ids) if self.return_tokens else [],
                "tokens_predicted": predicted, "tokens_evaluated": evaluated,
                "tokens_cached": cached,
                "generation_settings": settings, "prompt": prompt.get("prompt", ""),
                "has_new_line": "\n" in self.choices[index].whole_text, "truncated": False,
                "stop_type": _stop_type(done),
                "stopping_word": done.stop_reason if isinstance(done.stop_reason, str) else "",
                # llama-server's prompt_n counts the prompt tokens computed, cache_n those reused
                "timings": finished_timings(done),
                **self._probs(self.choices[index].logprobs if content else [])}

    def _probs(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        if self.creq.logprobs is None:
            return {}
        return {"completion_probabilities": _probabilities(entries, bool(self.creq.params.get("processed_logprobs")))}

    def start_events(self) -> list[bytes]:
        """Nothing before the first text."""
        return []

    def stream_events(self, index: int, ev: ReplyEvent) -> list[bytes]:
        """A chunk per text; the prompt's whole answer (no text, ``stop`` true) at its end."""
        if isinstance(ev, Delta) and ev.text:
            self.choices[index].take(ev)
            return [sse(json_bytes({"index": index, "content": ev.text, "tokens": [], "stop": False,
                                    "id_slot": -1, "tokens_predicted": 0, "tokens_evaluated": 0,
                                    **self._probs(ev.logprobs)}))]
        if isinstance(ev, Finished):
            self.choices[index].take(ev)
            return [sse(json_bytes(self._final(index, "")))]
        return []

    def end_events(self) -> list[bytes]:
        """Nothing (llama-server sends no ``[DONE]`` here)."""
        return []

    error_event = staticmethod(openai_error_event)

    def body(self) -> Any:
        """One prompt's answer, or the list of them."""
        answers = [self._final(i, c.whole_text) for i, c in enumerate(self.choices)]
        return answers[0] if len(answers) == 1 else answers
