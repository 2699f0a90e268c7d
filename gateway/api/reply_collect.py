"""What the API writers keep of a request's reply events to build a whole answer.

Every API (chat completions, completions, Anthropic Messages, Responses) answers a
non-streamed request from the same things: each choice's text, its tokens' logprobs,
the prompt's logprobs (completions' ``echo``) and its ``Finished`` (finish reason,
usage, whole tool calls). ``ChoiceReply`` collects them for one choice and
``CollectingWriter`` gives a writer the ``take`` of ``openai_api.Writer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.api.openai_replies import Delta, Finished, ReplyEvent
from gateway.replies.reply_end import ReplyEnd


@dataclass
class ChoiceReply:
    """One choice's reply so far.

    Attributes:
        text: the text of each ``Delta``, in order.
        logprobs: each token's logprob entry (the engine's wire shape), in order.
        prompt_logprobs: the prompt's entries, once the engine sent them, else None.
        finished: the ``Finished`` event, once it came.
    """

    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    prompt_logprobs: list[dict[str, Any]] | None = None
    finished: Finished | None = None

    def take(self, ev: ReplyEvent) -> None:
        """Keep one event (a ``Failed`` is the caller's to answer: nothing is kept)."""
        if isinstance(ev, Delta):
            if ev.prompt_logprobs is not None:
                self.prompt_logprobs = ev.prompt_logprobs
            self.text.append(ev.text)
            self.logprobs.extend(ev.logprobs)
        elif isinstance(ev, Finished):
            self.finished = ev

    @property
    def whole_text(self) -> str:
        """The text so far, joined."""
        return "".join(self.text)

    @property
    def done(self) -> Finished:
        """The ``Finished`` event, or a plain "stop" when none came."""
        return self.finished or Finished(ReplyEnd("stop"))


class CollectingWriter:
    """A writer's whole-answer half: ``choices`` (one ``ChoiceReply`` or subclass per
    choice, set by the subclass) and ``take``."""

    choices: Sequence[ChoiceReply]

    def take(self, index: int, ev: ReplyEvent) -> None:
        """Keep one event of choice ``index`` for the writer's ``body``."""
        self.choices[index].take(ev)

    def finished_choices(self) -> list[Finished]:
        """The ``Finished`` of every choice that has one, in choice order."""
        return [c.finished for c in self.choices if c.finished is not None]


def _rate(n: int, ms: float) -> tuple[float, float]:
    """(ms per token, tokens per second); 0.0 for both when nothing was timed."""
    return (ms / n, 1000.0 * n / ms) if n > 0 and ms > 0 else (0.0, 0.0)


def llama_timings(prompt_n: int, cache_n: int, predicted_n: int, prompt_ms: float,
                  predicted_ms: float) -> dict[str, float | int]:
    """llama-server's ``timings`` object: ``cache_n`` prompt tokens reused from the prefix
    cache, ``prompt_n`` computed in ``prompt_ms`` (ms), ``predicted_n`` reply tokens in
    ``predicted_ms`` (ms), with each phase's ms per token and tokens per second (0.0 for
    an untimed phase)."""
    prompt_per_token, prompt_per_s = _rate(prompt_n, prompt_ms)
    predicted_per_token, predicted_per_s = _rate(predicted_n, predicted_ms)
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_per_token, "prompt_per_second": prompt_per_s,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_per_token, "predicted_per_second": predicted_per_s}


def finished_timings(done: Finished) -> dict[str, float | int]:
    """``llama_timings`` of a finished reply, from the engine's counts and latencies: the
    prompt phase is the time to the first token (``ttft_ms``, its queueing included), the
    reply's the rest of the end-to-end time."""
    u, t = done.usage, done.timings
    cached = int(u.get("cached_tokens", 0))
    ttft, e2e = float(t.get("ttft_ms", 0.0)), float(t.get("e2e_ms", 0.0))
    return llama_timings(int(u.get("prompt_tokens", 0)) - cached, cached, int(u.get("completion_tokens", 0)),
                         ttft, max(0.0, e2e - ttft))


def live_timings(started: float, first_at: float | None, n_tokens: int, prompt_usage: dict[str, int] | None,
                 now: float) -> dict[str, float | int]:
    """``llama_timings`` while a reply streams, on the gateway's clock (``time.perf_counter``
    seconds): the prompt phase from the request's arrival ``started`` to its first text
    ``first_at`` (None: not yet), the reply's from then to ``now``; ``n_tokens`` reply
    tokens so far and the prompt's counts from the first delta (``Delta.prompt_usage``)."""
    u = prompt_usage or {}
    cached = int(u.get("cached_tokens", 0))
    first = first_at if first_at is not None else now
    return llama_timings(int(u.get("prompt_tokens", 0)) - cached, cached, n_tokens,
                         1000.0 * (first - started), 1000.0 * (now - first))


def prompt_progress(done: int, total: int, cached: int, started: float, now: float) -> dict[str, float | int]:
    """llama-server's ``prompt_progress`` object: ``total`` prompt tokens, ``cache`` of them
    from the prefix cache, ``processed`` (cached ones included) so far, ``time_ms`` since
    the request came (``started``, ``now``: ``time.perf_counter`` seconds)."""
    return {"total": total, "cache": cached, "processed": done, "time_ms": round(1000.0 * (now - started), 3)}
