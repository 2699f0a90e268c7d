"""Prefill/decode disaggregation against one engine, side by side in one run.

    python bench/disaggregation.py [--rates 0.05,0.1] [--window-s 60] [--prompt-tokens 2000]
                                   [--streams 4] [--reply-tokens 16] [--threads 2] [--json]

Two setups on the same model and format (the default SmolLM2, the CPU's default format,
speculation and the disk KV tier off so that neither setup gets help the other lacks):

- ``one``: one engine of role ``both`` with ``--threads`` torch threads;
- ``pd``: a prefill engine and a decode engine with ``--threads / 2`` threads each, the
  benchmark acting as the gateway does (``gateway/engines/disagg.py``): a new chat's
  ``generate`` goes to the prefill engine, then to the decode engine with ``kv_source``.

Load, per arrival rate: ``--streams`` chats decode long replies (each restarted with a
new 24-token message when it ends, so that many stream all the time; the gateway keeps
such a short turn on its decode engine, ``ROUTING_LOCAL_PREFILL_TOKENS``) while new chats arrive as a Poisson process at
the rate (seeded, the same arrival times for both setups), each with a prompt of
``--prompt-tokens`` random token ids (no prefix cache hit) and a reply of
``--reply-tokens``. The window is ``--window-s`` seconds of arrivals; arrivals still
running at its end are waited for.

Reported per setup and rate: the inter-token latency p50/p99/p99.9/max of the streaming
replies (ms; a step that brings k tokens counts k gaps of its time / k; a prompt chunk
delays a handful of steps in thousands, so it shows beyond p99), TTFT p50/p99 of the new
chats (ms, from their arrival to their first token, prefill and transfer included),
goodput (new chats per minute whose TTFT was under 10 s and TPOT under 100 ms), KV bytes
and milliseconds per transfer (the decode engine's ``kv_pull*`` counters), the share
of decode steps that also computed a prompt chunk (the engines' ``mixed_steps_total`` /
``decode_steps_total``, with the prompt tokens per such step), and the share delayed by
a prefill chunk (``long_chunk_steps_total``: one prompt's chunk over two pages; not a
stream's 24-token message, which the decode engine computes as the gateway would, nor
the last page of a moved prompt). Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from websockets.asyncio.client import connect  # noqa: E402

from bench.serving_lib.procs import Child, start_child  # noqa: E402
from bench.serving_lib.stats import fmt, percentile  # noqa: E402
from bench.serving_lib.systems import free_port  # noqa: E402

TTFT_SLO_MS, TPOT_SLO_MS = 10_000.0, 100.0
STREAM_TOKENS = 256  # a streaming chat's reply (tokens); restarted when it ends
STREAM_PROMPT_TOKENS = 24  # its next message (tokens): below the gateway's local_prefill_tokens


def start_engine(threads: int, role: str, extra: list[str]) -> tuple[Child, str]:
    """One ``python -m engine serve`` process; returns it and its ws:// URL."""
    cmd = [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
           "--threads", str(threads), "--role", role, "--no-kv-disk", "--speculative", "off",
           "--log-level", "warning", *extra]
    child = start_child(cmd, r"ENGINE READY (ws://\S+)", timeout_s=600, cwd=str(ROOT))
    return child, child.match.group(1)


class Link:
    """One WebSocket to one engine, requests multiplexed by id (the internal protocol)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats_q: asyncio.Queue = asyncio.Queue()

    async def __aenter__(self) -> Link:
        self.ws = await connect(self.url, max_size=None, compression=None)
        await self.ws.recv()  # hello
        self.reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.reader.cancel()
        await self.ws.close()

    async def _read(self) -> None:
        async for raw in self.ws:
            f = json.loads(raw)
            now = time.perf_counter()
            if f["type"] == "stats":
                self.stats_q.put_nowait(f)
            for item in f.get("items", [f]):
                q = self.queues.get(item.get("request_id", ""))
                if q is not None:
                    q.put_nowait((now, item))

    async def generate(self, rid: str, ids: list[int], max_tokens: int, kv_source: str | None = None):
        """Yield ``(arrival time, item)`` of one request until its done/error item."""
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        frame: dict[str, Any] = {"type": "generate", "request_id": rid, "prompt_token_ids": ids,
                                 "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
        if kv_source:
            frame["kv_source"] = kv_source
        await self.ws.send(json.dumps(frame))
        try:
            while True:
                now, item = await q.get()
                yield now, item
                if item["type"] in ("done", "error"):
                    return
        finally:
            self.queues.pop(rid, None)

    async def stats(self) -> dict[str, Any]:
        await self.ws.send(json.dumps({"type": "stats"}))
        return await self.stats_q.get()


@dataclass
class Result:
    """What one setup measured at one rate."""

    itl_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    errors: int = 0
    window_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)


def prompt(rng: random.Random, n: int) -> list[int]:
    """``n`` random token ids of the SmolLM2 vocabulary (past its special tokens)."""
    return [rng.randrange(100, 49_000) for _ in range(n)]


async def stream_forever(link: Link, rid: str, rng: random.Random, stop: asyncio.Event, res: Result) -> None:
    """A chat that decodes long replies back to back until ``stop``, each turn a short
    message that the gateway keeps on the decode engine (``STREAM_PROMPT_TOKENS`` is below
    ``ROUTING_LOCAL_PREFILL_TOKENS``); its token gaps go to ``res``."""
    n = 0
    while not stop.is_set():
        n += 1
        last = None
        async for now, item in link.generate(f"{rid}-{n}", prompt(rng, STREAM_PROMPT_TOKENS), STREAM_TOKENS):
            k = len(item.get("token_ids", []))
            if item["type"] == "error":
                res.errors += 1
                break
            if k and last is not None and not stop.is_set():
                res.itl_ms.extend([(now - last) * 1000 / k] * k)
            if k:
                last = now


async def new_chat(prefill: Link, decode: Link, rid: str, ids: list[int], reply: int, res: Result) -> None:
    """One arriving chat: through the prefill engine first when it differs from the decode one."""
    start = time.perf_counter()
    source = None
    if prefill is not decode:
        async for _, item in prefill.generate(rid + "-p", ids, 1):
            if item["type"] == "error":
                res.errors += 1
                return
        source = prefill.url
    first = last = None
    n = 0
    async for now, item in decode.generate(rid, ids, reply, source):
        if item["type"] == "error":
            res.errors += 1
            return
        k = len(item.get("token_ids", []))
        if k and first is None:
            first = now
        n += k
        last = now
    if first is None or last is None:
        res.errors += 1
        return
    res.ttft_ms.append((first - start) * 1000)
    res.tpot_ms.append((last - first) * 1000 / max(1, n - 1))


async def run_rate(prefill_url: str, decode_url: str, rate: float, args: argparse.Namespace, seed: int) -> Result:
    """One setup at one arrival rate (module doc)."""
    res = Result()
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < args.window_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    async with Link(decode_url) as decode:
        prefill = decode if prefill_url == decode_url else await Link(prefill_url).__aenter__()
        try:
            before = {u: await link.stats() for u, link in {prefill_url: prefill, decode_url: decode}.items()}
            stop = asyncio.Event()
            streams = [asyncio.create_task(stream_forever(decode, f"s{i}", random.Random(seed * 100 + i), stop, res))
                       for i in range(args.streams)]
            await asyncio.sleep(2.0)  # the streams are decoding before the first arrival
            t0 = time.perf_counter()
            chats = []
            for i, at in enumerate(arrivals):
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                chats.append(asyncio.create_task(new_chat(prefill, decode, f"n{i}", prompt(rng, args.prompt_tokens),
                                                          args.reply_tokens, res)))
            await asyncio.sleep(max(0.0, t0 + args.window_s - time.perf_counter()))
            await asyncio.gather(*chats)
            res.window_s = time.perf_counter() - t0
            stop.set()
            after = {u: await link.stats() for u, link in {prefill_url: prefill, decode_url: decode}.items()}
            await asyncio.gather(*streams)
        finally:
            if prefill is not decode:
                await prefill.__aexit__(None, None, None)
    d0, d1 = before[decode_url], after[decode_url]
    res.stats = {k: d1.get(k, 0) - d0.get(k, 0) for k in
                 ("kv_pulls_total", "kv_pull_bytes_total", "kv_pull_ms_total", "kv_pull_failures_total",
                  "decode_steps_total", "mixed_steps_total", "mixed_prompt_tokens_total", "long_chunk_steps_total")}
    return res


def summary(res: Result) -> dict[str, Any]:
    """The reported figures of one result (module doc)."""
    s = res.stats
    good = sum(1 for a, b in zip(res.ttft_ms, res.tpot_ms) if a < TTFT_SLO_MS and b < TPOT_SLO_MS)
    pulls = max(1, s.get("kv_pulls_total", 0))
    return {
        "new_chats": len(res.ttft_ms), "errors": res.errors,
        "itl_p50_ms": percentile(res.itl_ms, 0.5), "itl_p99_ms": percentile(res.itl_ms, 0.99),
        "itl_p999_ms": percentile(res.itl_ms, 0.999), "itl_max_ms": max(res.itl_ms, default=math.nan),
        "ttft_p50_ms": percentile(res.ttft_ms, 0.5), "ttft_p99_ms": percentile(res.ttft_ms, 0.99),
        "goodput_per_min": good * 60 / max(res.window_s, 1e-9), "good": good,
        "kv_mb_per_transfer": s.get("kv_pull_bytes_total", 0) / pulls / 1e6 if s.get("kv_pulls_total") else 0.0,
        "kv_ms_per_transfer": s.get("kv_pull_ms_total", 0) / pulls if s.get("kv_pulls_total") else 0.0,
        "transfer_failures": s.get("kv_pull_failures_total", 0),
        "mixed_step_share": s.get("mixed_steps_total", 0) / max(1, s.get("decode_steps_total", 0)),
        "prompt_tokens_per_mixed_step": s.get("mixed_prompt_tokens_total", 0) / max(1, s.get("mixed_steps_total", 0)),
        "chunk_step_share": s.get("long_chunk_steps_total", 0) / max(1, s.get("decode_steps_total", 0)),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rates = [float(r) for r in args.rates.split(",")]
    extra = ["--max-num-seqs", "32"]
    out: dict[str, Any] = {"rates": rates, "setups": {}}
    for setup in ("one", "pd"):
        children: list[Child] = []
        try:
            if setup == "one":
                child, url = start_engine(args.threads, "both", extra)
                children.append(child)
                prefill_url = decode_url = url
            else:
                half = max(1, args.threads // 2)
                pchild, prefill_url = start_engine(half, "prefill", extra)
                dchild, decode_url = start_engine(half, "decode", extra)
                children += [pchild, dchild]
            rows = {}
            for n, rate in enumerate(rates):
                res = await run_rate(prefill_url, decode_url, rate, args, seed=1000 + n)
                rows[str(rate)] = summary(res)
                print(setup, rate, json.dumps(rows[str(rate)]), flush=True)
            out["setups"][setup] = rows
        finally:
            for c in children:
                c.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="0.05,0.1", help="new chats per second, comma-separated")
    p.add_argument("--window-s", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--reply-tokens", type=int, default=16, help="a new chat's reply (tokens)")
    p.add_argument("--streams", type=int, default=4, help="chats decoding long replies all the time")
    p.add_argument("--threads", type=int, default=2, help="one engine's threads (each pd engine gets half)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = p.parse_args()
    out = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(out))
        return
    print(f"\n{'setup':5} {'rate/s':>6} {'chats':>5} {'ITL p50':>8} {'ITL p99':>8} {'p99.9':>7} {'max':>7} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'good/min':>8} {'MB/xfer':>7} {'ms/xfer':>7} {'mixed':>6} {'tok/mixed':>9} {'chunk':>6}")
    for setup, rows in out["setups"].items():
        for rate, r in rows.items():
            print(f"{setup:5} {rate:>6} {r['new_chats']:>5} {fmt(r['itl_p50_ms']):>8} {fmt(r['itl_p99_ms']):>8} "
                  f"{fmt(r['itl_p999_ms'], 0):>7} {fmt(r['itl_max_ms'], 0):>7} "
                  f"{fmt(r['ttft_p50_ms'], 0):>9} {fmt(r['ttft_p99_ms'], 0):>9} {fmt(r['goodput_per_min'], 2):>8} "
                  f"{fmt(r['kv_mb_per_transfer']):>7} {fmt(r['kv_ms_per_transfer'], 0):>7} "
                  f"{r['mixed_step_share']:>6.3f} {fmt(r['prompt_tokens_per_mixed_step']):>9} "
                  f"{r['chunk_step_share']:>6.4f}")


if __name__ == "__main__":
    main()
