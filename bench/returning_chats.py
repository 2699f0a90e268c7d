"""Returning chats, side by side: does a chat that comes back stay fast?

The sequence, through each system's OpenAI API (whole history sent each turn, greedy,
short replies, streamed; TTFT measured on the client):

1. cold: a new chat of about ``--tokens`` prompt tokens (its first turn);
2. hot: its next turn at once (the prefix is in the cache);
3. noise: ``--noise`` other chats of the same size, one turn each;
4. return: the first chat's next turn.

Then the restart variant: a second chat, cold and hot, the noise, the server restarted,
and its return. Systems:

- ``ours``: engine + gateway, the engine's pool forced small (``--num-blocks``, about
  2.5 chats) so the noise evicts the first chat, and the disk KV tier on (a fresh folder);
- ``ours, tier off``: the same with ``--no-kv-disk`` (what a return cost before the tier);
- ``llama.cpp``: ``llama-server -c 4096 --parallel 1`` on the same weights in Q4_0 (its
  fastest CPU format, ``bench/build_llamacpp.sh --models``; the package's Q4_1 file when
  that has not been run), otherwise at its defaults (its
  prompt cache in RAM is on by default), plus ``-t/-tb`` threads and ``--poll 0`` as in
  ``bench/serving.py`` (a spinning server starves the client on 2 vCPUs).

    python -m bench.returning_chats --tokens 1200            # about 5 minutes on 2 vCPUs
    python -m bench.returning_chats --tokens 600 --noise 3 --no-llamacpp   # a quick look

Prints one markdown table (TTFT in ms, cached prompt tokens and, for ours, how many came
from disk) and the targets of docs/kv_tiers.md as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.llamacpp_paths import LLAMA_SERVER as LLAMA_SERVER_DEFAULT
from bench.llamacpp_paths import PEER_Q4_0
from bench.serving_lib.openai_client import RequestResult, SSEParser, apply_chunk
from bench.serving_lib.procs import Child, start_child
from bench.serving_lib.systems import (
    ROOT,
    _cleanup_redis,
    default_gguf,
    free_port,
    llama_server_available,
    wait_http,
)
from bench.serving_lib.workloads import SYSTEM_PROMPT, TextMaker


@dataclass
class Turn:
    """One measured turn: TTFT (ms), prompt and cached tokens, cached tokens by tier."""

    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int | None
    by_tier: dict[str, int] | None = None
    text: str = ""
    completion_tokens: int = 0


async def one_turn(client: httpx.AsyncClient, messages: list[dict[str, str]], reply_tokens: int) -> Turn:
    """Stream one greedy reply, retrying while the server answers 503 (a restarted engine
    not yet reconnected), up to a minute; raises RuntimeError when it failed."""
    for _ in range(120):
        try:
            return await _one_turn(client, messages, reply_tokens)
        except _Unavailable:
            await asyncio.sleep(0.5)
    raise RuntimeError("the server stayed unavailable")


class _Unavailable(RuntimeError):
    pass


async def _one_turn(client: httpx.AsyncClient, messages: list[dict[str, str]], reply_tokens: int) -> Turn:
    body = {"model": "default", "messages": messages, "max_tokens": reply_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult()
    parser = SSEParser()
    by_tier = None
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code == 503:
            raise _Unavailable()
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for text in r.aiter_text():
            now = (time.perf_counter() - t0) * 1000
            for data in parser.feed(text):
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                apply_chunk(res, chunk, now)
                usage = chunk.get("usage") or {}
                by_tier = (usage.get("prompt_tokens_details") or {}).get("cached_tokens_by_tier", by_tier)
    if not res.chunk_ms:
        raise RuntimeError("no text came back")
    return Turn(res.ttft_ms, res.prompt_tokens, res.cached_tokens, by_tier, res.text, res.output_tokens)


@dataclass
class Server:
    """A system under test that can be restarted on the same port."""

    label: str
    children: list[Child] = field(default_factory=list)
    base_url: str = ""

    def start(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def restart(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def stop(self) -> None:
        for c in reversed(self.children):
            c.stop()
        self.children.clear()


@dataclass
class OursServer(Server):
    """Engine (its port kept across restarts) + a bench gateway in front of it."""

    num_blocks: int = 256
    kv_dir: Path | None = None  # None: the tier off
    threads: int = 2
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = field(default_factory=lambda: f"bench-returning-{uuid.uuid4().hex[:8]}:")
    port: int = 0
    engine: Child | None = None

    def _engine(self) -> Child:
        cmd = [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--threads", str(self.threads), "--num-blocks", str(self.num_blocks)]
        cmd += ["--kv-disk-dir", str(self.kv_dir)] if self.kv_dir else ["--no-kv-disk"]
        return start_child(cmd, r"ENGINE READY (ws://\S+)", 600, {"HF_HUB_OFFLINE": "1", "KV_DISK": ""}, str(ROOT))

    def start(self) -> None:
        self.port = free_port()
        self.engine = self._engine()
        gw = start_child([sys.executable, "-m", "bench.serving_lib.gateway_proc", "--engine",
                          f"ws://127.0.0.1:{self.port}", "--redis-url", self.redis_url,
                          "--key-prefix", self.key_prefix], r"GATEWAY READY (http://\S+)", 120,
                         {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}, str(ROOT))
        self.children = [self.engine, gw]
        self.base_url = gw.match.group(1)
        wait_http(self.base_url + "/readyz", 120)

    def restart(self) -> None:
        assert self.engine is not None
        self.engine.stop()
        self.engine = self._engine()
        self.children[0] = self.engine
        wait_http(self.base_url + "/readyz", 120)

    def stop(self) -> None:
        super().stop()
        _cleanup_redis(self.redis_url, self.key_prefix)


@dataclass
class LlamaServer(Server):
    """llama-server with one slot of 4096 tokens, otherwise its defaults."""

    binary: Path = LLAMA_SERVER_DEFAULT
    threads: int = 2
    port: int = 0
    command: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.port = self.port or free_port()
        # llama.cpp's fastest CPU format when bench/build_llamacpp.sh --models made it, as bench/serving.py's peer
        gguf = PEER_Q4_0 if PEER_Q4_0.is_file() else default_gguf()
        self.command = [str(self.binary), "-m", str(gguf), "-t", str(self.threads), "-tb",
                        str(self.threads), "-c", "4096", "--parallel", "1", "--poll", "0", "--host", "127.0.0.1",
                        "--port", str(self.port), "--no-webui"]
        self.children = [start_child(self.command, r"listening|server is listening|HTTP server", 300)]
        self.base_url = f"http://127.0.0.1:{self.port}"
        wait_http(self.base_url + "/health", 300)

    def restart(self) -> None:
        self.stop()
        self.start()


def chat(maker: TextMaker, tokens: int) -> list[dict[str, str]]:
    """A new chat's first messages: the system prompt and one user message of about
    ``tokens`` tokens in all."""
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "Read this and answer briefly. " + maker.text(max(16, tokens - 70))}]


async def sequence(server: Server, tokens: int, noise: int, reply_tokens: int, seed: int,
                   restart: bool) -> dict[str, Turn]:
    """One sentinel / noise / return sequence (see the module doc); with ``restart`` the
    server restarts between the noise and the return."""
    maker = TextMaker(random.Random(seed))
    out: dict[str, Turn] = {}
    # one client: one cookie, so one user (one cache salt) on our gateway; a new connection
    # per request (llama-server closes idle keep-alive connections after 5 s)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        first = chat(maker, tokens)
        out["cold"] = await one_turn(client, first, reply_tokens)
        hist = first + [{"role": "assistant", "content": out["cold"].text},
                        {"role": "user", "content": "Thanks. Say it again in other words."}]
        out["hot"] = await one_turn(client, hist, reply_tokens)
        for _ in range(noise):
            await one_turn(client, chat(maker, tokens), reply_tokens)
        if restart:
            server.restart()
        hist = hist + [{"role": "assistant", "content": out["hot"].text},
                       {"role": "user", "content": "And once more, shorter."}]
        out["return"] = await one_turn(client, hist, reply_tokens)
        if isinstance(server, OursServer):  # where a restore's time went (engine counters)
            metrics = (await client.get("/metrics")).text
            for line in metrics.splitlines():
                if line.startswith(("engine_kv_disk_restore_ms_total", "engine_kv_disk_pages_read_total")):
                    print(f"  {server.label} ({'restart' if restart else 'eviction'}): {line}", flush=True)
    return out


async def many_chats(server: Server, chats: int, tokens: int, rounds: int, reply_tokens: int,
                     seed: int) -> dict[str, float]:
    """``chats`` chats of about ``tokens`` tokens taking ``rounds`` turns each, one request at
    a time, in random order round by round. Returns the TTFT p50 and p99 (ms) of the turns
    after each chat's first, and their prefix hit ratio: cached prompt tokens over the
    tokens of the chat's previous prompt and reply (what a cache could have held)."""
    rng = random.Random(seed)
    maker = TextMaker(rng)
    hists = [chat(maker, tokens) for _ in range(chats)]
    prev: list[int] = [0] * chats
    ttfts: list[float] = []
    cached = known = 0
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for r in range(rounds):
            order = list(range(chats))
            rng.shuffle(order)
            for c in order:
                t = await one_turn(client, hists[c], reply_tokens)
                if r:
                    ttfts.append(t.ttft_ms)
                    cached += t.cached_tokens or 0
                    known += prev[c]
                prev[c] = t.prompt_tokens + t.completion_tokens
                hists[c] = hists[c] + [{"role": "assistant", "content": t.text},
                                       {"role": "user", "content": f"Go on ({r + 1})."}]
    ttfts.sort()
    return {"ttft_p50": ttfts[len(ttfts) // 2], "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "hit_ratio": cached / known if known else 0.0, "turns": len(ttfts)}


def _cell(t: Turn) -> str:
    cached = "?" if t.cached_tokens is None else f"{t.cached_tokens:,}"
    disk = f" ({t.by_tier['disk']:,} disk)" if t.by_tier and t.by_tier.get("disk") else ""
    return f"{t.ttft_ms:,.0f} ms, {cached} cached{disk}"


def table(results: dict[str, dict[str, dict[str, Turn]]]) -> str:
    """The markdown table of every system's two sequences."""
    lines = ["| system | sequence | cold | hot | return |", "|---|---|---|---|---|"]
    for label, seqs in results.items():
        for name, turns in seqs.items():
            lines.append(f"| {label} | {name} | {_cell(turns['cold'])} | {_cell(turns['hot'])} | "
                         f"**{_cell(turns['return'])}** |")
    return "\n".join(lines)


def targets(results: dict[str, dict[str, dict[str, Turn]]]) -> list[str]:
    """The issue's targets as ratios (ours with the tier on)."""
    ours = results.get("ours")
    if not ours:
        return []
    lines = []
    ev = ours.get("eviction")
    if ev:
        lines.append(f"eviction: ours return / ours hot = {ev['return'].ttft_ms / ev['hot'].ttft_ms:.2f} "
                     "(target <= 1.5)")
        peer = results.get("llama.cpp", {}).get("eviction")
        if peer:
            lines.append(f"eviction: ours return / llama.cpp return = "
                         f"{ev['return'].ttft_ms / peer['return'].ttft_ms:.2f} (target <= 1.0)")
    rs = ours.get("restart")
    if rs:
        lines.append(f"restart: ours return / ours hot = {rs['return'].ttft_ms / rs['hot'].ttft_ms:.2f} "
                     "(target <= 2.0)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.returning_chats", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1200, help="prompt tokens of each chat's first turn")
    p.add_argument("--noise", type=int, default=6, help="other chats between the hot turn and the return")
    p.add_argument("--reply-tokens", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="our pool in blocks of 16 (default: about 2.5 chats, so the noise evicts)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--no-tier-off", action="store_true", help="skip the 'ours, tier off' run")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: bench/build_llamacpp.sh's)")
    p.add_argument("--json", default=None, help="write the raw figures here")
    p.add_argument("--many", type=int, default=0, metavar="CHATS",
                   help="instead: CHATS chats taking --rounds turns in random order, ours with the tier on and "
                        "off (the pool holds about a third of them)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--many-tier", default="both", choices=["both", "on", "off"],
                   help="--many: run ours with the tier on, off, or both (one at a time keeps a quiet run short)")
    p.add_argument("--read-rate", type=int, default=0, metavar="PAGES",
                   help="instead: the disk tier's restore read rate over PAGES pages (no server)")
    a = p.parse_args(argv)
    if a.read_rate:
        return read_rate(a.read_rate)
    if a.many:
        return many_main(a)
    num_blocks = a.num_blocks or max(64, int(2.5 * (a.tokens + 3 * a.reply_tokens + 40) / 16))
    kv_dir = Path(tempfile.mkdtemp(prefix="returning-kv-"))
    systems: list[Server] = [OursServer("ours", num_blocks=num_blocks, kv_dir=kv_dir, threads=a.threads)]
    if not a.no_tier_off:
        systems.append(OursServer("ours, tier off", num_blocks=num_blocks, kv_dir=None, threads=a.threads))
    binary = Path(a.llama_server) if a.llama_server else LLAMA_SERVER_DEFAULT
    if not a.no_llamacpp:
        if llama_server_available(binary):
            systems.append(LlamaServer("llama.cpp", binary=binary, threads=a.threads))
        else:
            print(f"llama-server not found at {binary}: skipped", file=sys.stderr)
    results: dict[str, dict[str, dict[str, Turn]]] = {}
    print(f"load average {os.getloadavg()[0]:.2f}; {a.tokens} tokens a chat, {a.noise} noise chats, "
          f"{a.reply_tokens}-token replies; our pool {num_blocks} blocks of 16", flush=True)
    try:
        for s in systems:
            s.start()
            try:
                results[s.label] = {"eviction": asyncio.run(sequence(s, a.tokens, a.noise, a.reply_tokens, 1, False))}
                if s.label != "ours, tier off":
                    results[s.label]["restart"] = asyncio.run(
                        sequence(s, a.tokens, a.noise, a.reply_tokens, 2, True))
            except Exception as e:  # keep the other systems' figures
                print(f"{s.label}: failed: {type(e).__name__}: {e}", flush=True)
                if isinstance(s, LlamaServer) and s.children:
                    print("\n".join(list(s.children[0].tail)[-10:]), flush=True)
            finally:
                s.stop()
            print(f"{s.label}: done", flush=True)
            print(table({s.label: results.get(s.label, {})}), flush=True)
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)
    print(table(results))
    for line in targets(results):
        print(line)
    print(f"load average after {os.getloadavg()[0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({k: {n: {t: vars(x) for t, x in v.items()} for n, v in seqs.items()}
                                            for k, seqs in results.items()}, indent=1))
    return 0


def read_rate(pages: int) -> int:
    """``--read-rate``: the disk tier's restore read rate (read, check, decode into one
    buffer, as its reader thread does) over ``pages`` SmolLM2-shaped pages, from the page
    cache and after ``posix_fadvise(DONTNEED)`` drops those files from it (the disk)."""
    import torch

    from engine.kv_page import PageHeader, PageKey, decode_page, encode_page
    from engine.tiers.disk import DiskPageStore

    key = PageKey("bench", "int8", "bfloat16", 16, 30, 3, 64)  # SmolLM2-135M's KV shape
    folder = Path(tempfile.mkdtemp(prefix="kv-read-rate-"))
    try:
        store = DiskPageStore(folder, key.fingerprint(), 1 << 40)
        kv = torch.randn(key.shape).to(torch.bfloat16)
        for h in range(1, pages + 1):
            store.put(h, encode_page(PageHeader(key, "s", h, h - 1, tuple(range(16))), kv))
        os.sync()
        buf = torch.empty((pages, *key.shape), dtype=key.torch_dtype)

        def read_all() -> float:
            t0 = time.perf_counter()
            n = 0
            for h in range(1, pages + 1):
                data = store.get(h)
                assert data is not None
                n += len(data)
                decode_page(data, key, chain_hash=h, out=buf[h - 1])
            return n / (time.perf_counter() - t0) / 1e9

        warm = max(read_all() for _ in range(3))
        for h in range(1, pages + 1):
            fd = os.open(store.path_of(h), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        cold = read_all()
        mb = pages * key.payload_bytes / 1e6
        print(f"restore read rate over {pages} pages ({mb:.0f} MB): {warm:.2f} GB/s from the page cache, "
              f"{cold:.2f} GB/s after dropping them from it")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def many_main(a: argparse.Namespace) -> int:
    """``--many``: the many-users run, tier on against tier off."""
    per_chat = (a.tokens + a.rounds * (a.reply_tokens + 20) + 40) // 16 + 1
    num_blocks = a.num_blocks or max(64, a.many * per_chat // 3)
    kv_dir = Path(tempfile.mkdtemp(prefix="returning-kv-"))
    print(f"load average {os.getloadavg()[0]:.2f}; {a.many} chats of {a.tokens} tokens, {a.rounds} rounds; "
          f"our pool {num_blocks} blocks of 16", flush=True)
    lines = ["| ours | turn TTFT p50 | p99 | prefix hit ratio | turns |", "|---|---|---|---|---|"]
    try:
        variants = [(label, folder) for label, folder in (("tier on", kv_dir), ("tier off", None))
                    if a.many_tier in ("both", label.split()[1])]
        for label, folder in variants:
            s = OursServer(label, num_blocks=num_blocks, kv_dir=folder, threads=a.threads)
            s.start()
            try:
                r = asyncio.run(many_chats(s, a.many, a.tokens, a.rounds, a.reply_tokens, 3))
            finally:
                s.stop()
            lines.append(f"| {label} | {r['ttft_p50']:,.0f} ms | {r['ttft_p99']:,.0f} ms | {r['hit_ratio']:.3f} | "
                         f"{r['turns']} |")
            print(lines[-1], flush=True)
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)
    print("\n".join(lines))
    print(f"load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
