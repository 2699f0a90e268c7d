"""How a reply ended, typed once: ``ReplyEnd``. The stored assistant message and the
``done`` entry of the reply's stream (which the browser's ``done`` frame repeats) are both
derived from it, so a reply's usage and timings are assembled in this one place.

Timings kept with a reply: ``ttft_ms``, ``tpot_ms`` and ``e2e_ms`` (ms), and how decode
went, ``acceptance_rate`` and ``tokens_per_step`` (speculative decoding; 0.0 and 1.0
without it). The engine's ``queue_ms``, ``draft_tokens`` and ``accepted_tokens`` are in
its ``/metrics`` and stats, not stored per message. A reply that failed before the engine
said how it went has zero TTFT, TPOT and end-to-end time only.

Usage and timings are those of the engine request that wrote the reply, also for a reply
extended by ``continue``: its ``prompt_tokens`` include the tokens the reply already had,
``completion_tokens`` are those written now, and ``continued_tokens`` (only on a continued
reply) says how many it had before, so the reply's whole length is ``continued_tokens +
completion_tokens`` and the timings (and any rate derived from them) cover only the part
written now (docs/protocol.md, ``continue``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine.protocol import DoneFrame, Timings

_TIMING_NAMES = frozenset(f.name for f in fields(Timings))


@dataclass(frozen=True)
class ReplyEnd:
    """A finished reply's end.

    Attributes:
        finish_reason: "stop", "length", "abort", "tool_calls" or "error".
        prompt_tokens, cached_tokens, completion_tokens: tokens; ``cached_disk_tokens``: of
            the cached ones, those restored from the engine's disk KV tier (0: none).
        timings: the engine's latencies (ms), None when the engine never said (an error).
        cut_reason: why a reply stopped short (``user_stop``, ``gateway_shutdown``,
            ``engine_lost``, ``upstream_error``, ``error``), None for a whole reply.
        error: ``{"code", "message", "status"?}`` of a reply that failed part-way, else None.
        reasoning_ms: how long the reply reasoned (ms; ``gateway/replies/reasoning_clock.py``),
            None when it has no reasoning.
        tool_calls: the calls a turn with tools made, in OpenAI's chat shape (``[{"id",
            "type": "function", "function": {"name", "arguments"}}]``), else None.
        continued_tokens: tokens a continued reply had before this request wrote on (they
            are part of ``prompt_tokens``, not of ``completion_tokens``); 0 for a reply
            written by one request.
    """

    finish_reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cached_disk_tokens: int = 0
    timings: Timings | None = None
    cut_reason: str | None = None
    error: dict[str, Any] | None = None
    reasoning_ms: float | None = None
    tool_calls: list[dict[str, Any]] | None = None
    continued_tokens: int = 0

    @classmethod
    def of_done(cls, done: DoneFrame, cut_reason: str | None, completion_tokens: int | None = None,
                reasoning_ms: float | None = None) -> ReplyEnd:
        """The end the engine reported; ``completion_tokens`` overrides its count (a reply
        the gateway ended without the engine's word counts what it received)."""
        u = done.usage
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in done.output_tool_calls or ()]
        return cls(done.finish_reason, u.prompt_tokens, u.cached_tokens,
                   u.completion_tokens if completion_tokens is None else completion_tokens,
                   u.cached_disk_tokens, done.timings, cut_reason, reasoning_ms=reasoning_ms,
                   tool_calls=calls or None)

    @classmethod
    def of_error(cls, error: dict[str, Any], cut_reason: str, completion_tokens: int,
                 reasoning_ms: float | None = None) -> ReplyEnd:
        """A reply that failed after some of it was written (``completion_tokens`` of it)."""
        return cls("error", completion_tokens=completion_tokens, cut_reason=cut_reason, error=error,
                   reasoning_ms=reasoning_ms)

    @classmethod
    def of_done_entry(cls, done: dict[str, Any]) -> ReplyEnd:
        """The end a reply stream's ``done`` entry carries (what ``done_entry`` wrote: its
        finish reason, usage and timings; missing counts read as 0, a missing ``timings`` as
        None), so that a reader of the stream derives its answer from the same type."""
        u = done.get("usage") or {}
        t = done.get("timings")
        kept: dict[str, Any] = {k: v for k, v in (t or {}).items() if k in _TIMING_NAMES}  # JSON numbers
        timings = None if t is None else Timings(**kept)
        return cls(done.get("finish_reason", "stop"), int(u.get("prompt_tokens", 0)), int(u.get("cached_tokens", 0)),
                   int(u.get("completion_tokens", 0)), int(u.get("cached_disk_tokens", 0)), timings,
                   error=done.get("error"), reasoning_ms=done.get("reasoning_ms"), tool_calls=done.get("tool_calls"),
                   continued_tokens=int(u.get("continued_tokens", 0)))

    def usage(self) -> dict[str, int]:
        """The ``usage`` object of the stored message and of ``done`` (tokens);
        ``continued_tokens`` only on a continued reply (module doc)."""
        out = {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
               "completion_tokens": self.completion_tokens}
        if self.cached_disk_tokens:
            out["cached_disk_tokens"] = self.cached_disk_tokens
        if self.continued_tokens:
            out["continued_tokens"] = self.continued_tokens
        return out

    def timings_dict(self) -> dict[str, float]:
        """The ``timings`` object of the stored message and of ``done`` (see module doc)."""
        t = self.timings if self.timings is not None else Timings()
        out = {"ttft_ms": t.ttft_ms, "tpot_ms": t.tpot_ms, "e2e_ms": t.e2e_ms}
        if self.timings is not None:
            out.update(acceptance_rate=t.acceptance_rate, tokens_per_step=t.tokens_per_step)
        return out

    def stored_message(self, content: str, created_at: float, request_id: str) -> dict[str, Any]:
        """The assistant message as stored (the chat's history entry, less its ids)."""
        partial = self.finish_reason in ("abort", "error")
        msg: dict[str, Any] = {"content": content, "status": "partial" if partial else "complete",
                               "finish_reason": self.finish_reason}
        if self.error is not None:
            msg["error"] = self.error
        if self.cut_reason is not None:
            msg["cut_reason"] = self.cut_reason
        msg.update(usage=self.usage(), timings=self.timings_dict(), created_at=created_at, request_id=request_id)
        if self.reasoning_ms is not None:
            msg["reasoning_ms"] = self.reasoning_ms
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg

    def done_entry(self, request_id: str, session_id: str, message_id: str,
                   title: str | None = None) -> dict[str, Any]:
        """The ``done`` entry of the reply's stream, which the browser gets as its ``done`` frame."""
        done: dict[str, Any] = {"request_id": request_id, "session_id": session_id, "message_id": message_id,
                                "finish_reason": self.finish_reason, "usage": self.usage(),
                                "timings": self.timings_dict()}
        if self.error is not None:
            done["error"] = self.error
        if title:
            done["title"] = title
        if self.reasoning_ms is not None:
            done["reasoning_ms"] = self.reasoning_ms
        if self.tool_calls:
            done["tool_calls"] = self.tool_calls
        return done
