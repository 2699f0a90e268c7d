"""One streaming OpenAI chat-completions request, timed on the client.

The same client drives every system: it POSTs ``/v1/chat/completions`` with
``stream: true`` and ``stream_options.include_usage``, parses the Server-Sent Events
(WHATWG HTML "Server-sent events" section, the subset OpenAI-style servers emit) and
records the arrival time of every chunk that carries text.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


class SSEParser:
    """Incremental Server-Sent Events parser: ``feed(text)`` returns the ``data`` of each
    event completed by that text (multi-line data joined with ``\\n``; comments, ``event``,
    ``id`` and ``retry`` fields ignored; LF, CRLF or CR line ends)."""

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []

    def feed(self, text: str) -> list[str]:
        """Parse more of the stream; returns the events it completed, in order."""
        self._buf += text.replace("\r\n", "\n").replace("\r", "\n")
        out: list[str] = []
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            if line == "":
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if name == "data":
                self._data.append(value)
        return out

    def close(self) -> list[str]:
        """End of stream: an event left without its blank line is still returned."""
        out = self.feed("\n\n") if self._buf or self._data else []
        return out


@dataclass
class RequestResult:
    """What the client saw of one request. Times are milliseconds from sending it.

    ``chunk_ms``: arrival of each chunk with non-empty text; ``output_tokens``: the
    server's ``usage.completion_tokens`` (else the number of text chunks);
    ``cached_tokens``: ``usage.prompt_tokens_details.cached_tokens`` or llama.cpp's
    ``timings.cache_n`` (None when the server reports neither).
    """

    ok: bool = False
    error: str | None = None
    chunk_ms: list[float] = field(default_factory=list)
    end_ms: float = 0.0
    text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    tags: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft_ms(self) -> float:
        """Time to the first text chunk (ms); NaN when none came."""
        return self.chunk_ms[0] if self.chunk_ms else float("nan")

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first (ms): (last chunk - first chunk) /
        (tokens - 1); NaN with fewer than 2 tokens."""
        if len(self.chunk_ms) < 1 or self.output_tokens < 2:
            return float("nan")
        return (self.chunk_ms[-1] - self.chunk_ms[0]) / (self.output_tokens - 1)

    @property
    def gaps_ms(self) -> list[float]:
        """Gaps between consecutive text chunks (ms)."""
        return [b - a for a, b in zip(self.chunk_ms, self.chunk_ms[1:])]


def apply_chunk(res: RequestResult, chunk: dict[str, Any], t_ms: float) -> None:
    """Fold one parsed ``chat.completion.chunk`` (arrived at ``t_ms``) into ``res``.

    Raises:
        RuntimeError: the chunk is an in-stream ``error`` object.
    """
    if "error" in chunk:
        raise RuntimeError(f"stream error: {chunk['error']}")
    for choice in chunk.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content") or ""
        if piece:
            res.chunk_ms.append(t_ms)
            res.text += piece
    usage = chunk.get("usage")
    if usage:
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        res.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            res.cached_tokens = int(details["cached_tokens"])
    timings = chunk.get("timings")  # llama.cpp's own numbers
    if timings and res.cached_tokens is None and timings.get("cache_n") is not None:
        res.cached_tokens = int(timings["cache_n"])


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any], tags: dict[str, Any] | None = None,
                      path: str = "/v1/chat/completions") -> RequestResult:
    """Send one streaming chat request and time it (never raises: failures are in
    ``error``). ``body`` gets ``stream`` and ``stream_options`` set."""
    res = RequestResult(tags=dict(tags or {}))
    body = dict(body, stream=True, stream_options={"include_usage": True})
    parser = SSEParser()
    t0 = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for text in r.aiter_text():
                t = (time.perf_counter() - t0) * 1000
                for data in parser.feed(text):
                    if data.strip() == "[DONE]":
                        done = True
                        continue
                    apply_chunk(res, json.loads(data), t)
            for data in parser.close():
                if data.strip() == "[DONE]":
                    done = True
    except Exception as e:  # the benchmark reports failures instead of stopping
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.end_ms = (time.perf_counter() - t0) * 1000
    if not res.output_tokens:
        res.output_tokens = len(res.chunk_ms)
    res.ok = done
    if not done:
        res.error = "stream ended without [DONE]"
    return res
