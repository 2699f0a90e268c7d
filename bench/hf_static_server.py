"""transformers' ``generate`` behind a minimal static-batching OpenAI chat API (a benchmark peer).

    python bench/hf_static_server.py --model DIR [--dtype float32] [--threads 2]
        [--port 0] [--max-batch 32] [--window-ms 50]

Static batching, the way a plain ``generate`` server works: the first waiting request
opens a batch, requests arriving within ``--window-ms`` join it (up to ``--max-batch``),
the batch is left-padded and run by one ``model.generate`` call to its longest output,
and only then does the next batch start. Tokens stream to each request as the batch
produces them (a ``generate`` streamer), as OpenAI ``chat.completion.chunk`` SSE events,
with ``usage`` at the end when ``stream_options.include_usage`` is set. Greedy only
(``temperature`` is ignored); ``ignore_eos`` is honoured by ``min_new_tokens``.
Prints ``HF READY http://127.0.0.1:PORT`` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Pending:
    """One request waiting for or running in a batch: prompt ids, output cap (tokens),
    and the queue its tokens go to (``None`` ends it)."""

    ids: list[int]
    max_tokens: int
    ignore_eos: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    produced: int = 0


class RowStreamer:
    """A ``generate`` streamer that hands each row's new token to its request's queue
    (thread-safe, via the event loop) until that row hits its own cap or EOS."""

    def __init__(self, batch: list[Pending], loop: asyncio.AbstractEventLoop, eos: set[int]) -> None:
        self.batch, self.loop, self.eos = batch, loop, eos
        self.calls = 0
        self.open = [True] * len(batch)

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 1:
            return  # the first call is the prompt
        tokens = value.reshape(-1).tolist()
        for i, (p, tok) in enumerate(zip(self.batch, tokens)):
            if not self.open[i]:
                continue
            p.produced += 1
            self.loop.call_soon_threadsafe(p.queue.put_nowait, tok)
            if p.produced >= p.max_tokens or (tok in self.eos and not p.ignore_eos):
                self.open[i] = False
                self.loop.call_soon_threadsafe(p.queue.put_nowait, None)

    def end(self) -> None:
        for i, p in enumerate(self.batch):
            if self.open[i]:
                self.open[i] = False
                self.loop.call_soon_threadsafe(p.queue.put_nowait, None)


class StaticBatcher:
    """Collects requests into static batches and runs them one at a time (module doc)."""

    def __init__(self, model: Any, tokenizer: Any, max_batch: int, window_s: float) -> None:
        self.model, self.tok = model, tokenizer
        self.max_batch, self.window_s = max_batch, window_s
        self.waiting: asyncio.Queue[Pending] = asyncio.Queue()
        self.batches = 0
        eos = tokenizer.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos or [])
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos or {0})

    async def run(self) -> None:
        """Form and run batches forever."""
        while True:
            first = await self.waiting.get()
            batch = [first]
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.waiting.get(), left))
                except asyncio.TimeoutError:
                    break
            self.batches += 1
            await asyncio.to_thread(self._generate, batch, asyncio.get_running_loop())

    def _generate(self, batch: list[Pending], loop: asyncio.AbstractEventLoop) -> None:
        import torch

        streamer = RowStreamer(batch, loop, self.eos)
        try:
            width = max(len(p.ids) for p in batch)
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, p in enumerate(batch):  # left padding: every row's last token is aligned
                ids[i, width - len(p.ids):] = torch.tensor(p.ids)
                mask[i, width - len(p.ids):] = 1
            longest = max(p.max_tokens for p in batch)
            min_new = longest if all(p.ignore_eos for p in batch) else 0
            with torch.inference_mode():
                self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                                    min_new_tokens=min_new, do_sample=False, pad_token_id=self.pad,
                                    streamer=streamer)
        finally:
            streamer.end()


def _chunk(cid: str, model: str, delta: dict[str, Any] | None, finish: str | None = None,
           usage: dict[str, Any] | None = None) -> str:
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                            "model": model, "choices": [] if delta is None else
                            [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def build_app(batcher: StaticBatcher, model_name: str) -> Any:
    """The Starlette app: ``POST /v1/chat/completions`` (streaming and not), ``GET /health``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    tok = batcher.tok

    async def completions(request: Request) -> Any:
        body = await request.json()
        text = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        cap = int(body.get("max_completion_tokens") or body.get("max_tokens") or 128)
        p = Pending(ids, cap, bool(body.get("ignore_eos", False)))
        await batcher.waiting.put(p)
        cid = f"chatcmpl-{uuid.uuid4().hex}"

        async def tokens() -> AsyncIterator[tuple[str, int]]:
            out: list[int] = []
            sent = ""
            while True:
                t = await p.queue.get()
                if t is None:
                    return
                out.append(t)
                full = tok.decode(out, skip_special_tokens=False)
                if full.endswith("\ufffd"):
                    continue  # an incomplete UTF-8 character: wait for the next token
                yield full[len(sent):], len(out)
                sent = full

        def usage(n: int) -> dict[str, Any]:
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        if not body.get("stream"):
            text_out, n = "", 0
            async for piece, n in tokens():  # noqa: B007  (n after the loop: tokens sent)
                text_out += piece
            return JSONResponse({"id": cid, "object": "chat.completion", "model": model_name,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": text_out},
                                              "finish_reason": "length" if n >= cap else "stop"}],
                                 "usage": usage(n)})

        async def events() -> AsyncIterator[str]:
            yield _chunk(cid, model_name, {"role": "assistant", "content": ""})
            n = 0
            async for piece, n in tokens():  # noqa: B007  (n after the loop: tokens sent)
                if piece:
                    yield _chunk(cid, model_name, {"content": piece})
            yield _chunk(cid, model_name, {}, "length" if n >= cap else "stop")
            if (body.get("stream_options") or {}).get("include_usage"):
                yield _chunk(cid, model_name, None, usage=usage(n))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request) -> Any:
        return JSONResponse({"status": "ok", "batches": batcher.batches})

    async def lifespan(app: Any) -> AsyncIterator[None]:
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    from contextlib import asynccontextmanager

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"]),
                             Route("/health", health, methods=["GET"])],
                     lifespan=asynccontextmanager(lifespan))


def main(argv: list[str] | None = None) -> int:
    """Load the model and serve until killed; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a transformers model folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--window-ms", type=float, default=50.0)
    a = p.parse_args(argv)

    import socket

    import torch
    import uvicorn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(a.model)
    app = build_app(StaticBatcher(model, tok, a.max_batch, a.window_ms / 1000), os.path.basename(a.model.rstrip("/")))
    sock = socket.socket()
    sock.bind(("127.0.0.1", a.port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        print(f"HF READY http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
        await task

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
