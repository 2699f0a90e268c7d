"""A fake engine that speaks the engine protocol and writes tokens at a set rate, so a
benchmark measures the gateway alone (``bench/gateway_load.py --engine fake``).

    python -m bench.serving_lib.fake_engine [--port 0] [--rate 50]

Every ``1 / rate`` seconds (one "step") each running request gets one token: one
``delta`` item of a short word, all of a connection's items in one ``step`` frame, as
the real engine sends them; a request ends with ``done`` (``finish_reason: "length"``)
after its ``max_tokens``, with usage, timings and token ids shaped as the real engine's
(prompt ids: one per prompt character, capped). ``abort`` ends a request at once,
``stats`` and ``ping`` are answered. It reads no model and computes nothing, so its CPU
per token is a small fraction of the gateway's. Prints ``ENGINE READY ws://HOST:PORT``
once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field

from websockets.asyncio.server import ServerConnection, serve

from engine.protocol import (
    AbortFrame,
    DeltaFrame,
    DoneFrame,
    EngineInfo,
    FrameError,
    GenerateFrame,
    HelloFrame,
    PingFrame,
    PongFrame,
    ReplyItem,
    StatsFrame,
    StatsRequest,
    StepFrame,
    Timings,
    Usage,
    decode_client_frame,
    encode,
)

WORDS = [" the", " river", " runs", " past", " old", " mills", " and", " green", " fields", "."]
MAX_PROMPT_IDS = 512  # prompt ids reported per request (the gateway stores them as the turn's segment)


@dataclass
class _Request:
    request_id: str
    max_tokens: int
    prompt_ids: list[int]
    arrived: float
    output_ids: list[int] = field(default_factory=list)
    first_token_at: float = 0.0


class FakeEngine:
    """The fake engine's state: one step loop over every connection's running requests.

    Args:
        rate: tokens per second for each request (one token a step; steps every ``1/rate`` s).
    """

    def __init__(self, rate: float) -> None:
        self.step_s = 1.0 / rate
        self.conns: dict[ServerConnection, dict[str, _Request]] = {}
        self.info = EngineInfo(model="fake", max_model_len=1 << 20, block_size=16, num_blocks=1 << 16,
                               dtype="none", device="none")

    async def handle(self, ws: ServerConnection) -> None:
        """One gateway connection: hello, then its frames until it closes."""
        running: dict[str, _Request] = {}
        self.conns[ws] = running
        try:
            await ws.send(encode(HelloFrame(self.info)))
            async for raw in ws:
                try:
                    frame = decode_client_frame(raw)
                except FrameError:
                    continue
                if isinstance(frame, GenerateFrame):
                    text = "".join(str(m.get("content", "")) for m in frame.messages or [])
                    max_tokens = int((frame.params or {}).get("max_tokens") or 16)
                    running[frame.request_id] = _Request(frame.request_id, max_tokens,
                                                         [ord(c) % 1000 for c in text[:MAX_PROMPT_IDS]],
                                                         time.monotonic())
                elif isinstance(frame, AbortFrame):
                    req = running.pop(frame.request_id, None)
                    if req is not None:
                        await ws.send(encode(StepFrame([self._done(req, "abort")])))
                elif isinstance(frame, StatsRequest):
                    await ws.send(encode(StatsFrame({"running": sum(len(r) for r in self.conns.values()),
                                                     "waiting": 0})))
                elif isinstance(frame, PingFrame):
                    await ws.send(encode(PongFrame()))
        finally:
            self.conns.pop(ws, None)

    def _done(self, req: _Request, reason: str) -> DoneFrame:
        now = time.monotonic()
        n = len(req.output_ids)
        ttft = (req.first_token_at - req.arrived) * 1000 if n else 0.0
        tpot = (now - req.first_token_at) * 1000 / (n - 1) if n > 1 else 0.0
        return DoneFrame(req.request_id, finish_reason=reason, output_token_ids=list(req.output_ids),
                         prompt_token_ids=list(req.prompt_ids),
                         usage=Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=n),
                         timings=Timings(ttft_ms=ttft, tpot_ms=tpot, e2e_ms=(now - req.arrived) * 1000,
                                         tokens_per_step=1.0))

    async def step_loop(self) -> None:
        """Every ``step_s``: one token for every running request, one step frame per connection."""
        next_at = time.monotonic()
        while True:
            next_at += self.step_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            now = time.monotonic()
            for ws, running in list(self.conns.items()):
                items: list[ReplyItem] = []
                for rid, req in list(running.items()):
                    token = len(req.output_ids)
                    if not req.output_ids:
                        req.first_token_at = now
                    req.output_ids.append(token % len(WORDS))
                    word = WORDS[token % len(WORDS)]
                    if len(req.output_ids) >= req.max_tokens:
                        del running[rid]
                        done = self._done(req, "length")
                        done.text, done.token_ids = word, [req.output_ids[-1]]
                        done.output_text = "".join(WORDS[i % len(WORDS)] for i in range(len(req.output_ids)))
                        items.append(done)
                    else:
                        items.append(DeltaFrame(rid, text=word, token_ids=[req.output_ids[-1]]))
                if items:
                    try:
                        await ws.send(encode(StepFrame(items)))
                    except Exception:
                        pass  # the connection is closing; its handler cleans up


async def _main(host: str, port: int, rate: float) -> None:
    engine = FakeEngine(rate)
    async with serve(engine.handle, host, port, max_size=None, compression=None) as server:
        bound = next(iter(server.sockets)).getsockname()
        print(f"ENGINE READY ws://{bound[0]}:{bound[1]}", flush=True)
        await engine.step_loop()


def main() -> None:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--rate", type=float, default=50.0, help="tokens per second for each request")
    a = p.parse_args()
    try:
        asyncio.run(_main(a.host, a.port, a.rate))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
