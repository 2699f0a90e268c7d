"""Routing at scale, on paper: a discrete-event simulation of many engines and users.

    python bench/routing_sim.py [--engines 64] [--users 10000] [--duration 600] [--warmup 300]
                                [--load 0.6[,0.8,...]] [--costs cpu|gpu] [--seed 1] [--json PATH]

What it runs is the routing code that ships: each request is routed by the real
``gateway.engines.client.EngineRouter.choose`` (so ``gateway.engines.routing.choose_cache_aware``,
``choose``, ``rendezvous_rank`` and ``RoutingPolicy``, the prompt's chained block hashes
of ``engine.block_hash`` and ``gateway.engines.prefix_index.PrefixIndex.match``), over stub
``EngineClient`` objects that are "connected" and whose in-flight requests are the
simulated engine's (one gateway: its in-flight count is the engine's exact load), and a
``Placements`` that keeps placements in a dict and counts the Redis commands it would
send. The index is fed with the simulated engines' ``kv_events`` (the pages each
engine's prefix cache stores and evicts, named by the same chained BLAKE2b hashes of the
same token ids as the real engine names them, one frame per step that changed the
cache, sized by the real ``engine.protocol.encode``).

The engines are modelled, not run (see ``Costs`` for the figures and where each comes
from): continuous batching with chunked prefill (every step decodes one token for each
decoding request and spends the rest of the step's token budget on prompt chunks, first
come first served), a step time that grows with the batch and with the decoding
requests' contexts, a prompt chunk cost that grows with the cached context before it,
at most ``max_num_seqs`` running requests, and a KV pool of ``kv_pages`` pages of 16
tokens holding an LRU prefix cache with the radix tree's behaviour: a prompt hits its
longest cached prefix (at most ``prompt - 1`` tokens, as the engine's scheduler asks),
pages of running requests are pinned, unpinned pages are evicted least recently used
first, and a page is always touched after its descendants so a chain is evicted from
its leaf, as the tree evicts leaves. A request is admitted when its prompt and its whole
reply fit the pool (the real engine allocates as it goes and preempts instead; this is
the conservative side). Prompt pages enter the cache when the prefill ends and reply
pages when the reply ends, as ``engine/scheduler.py`` inserts them.

The users (``Workload``): each user has one chat at a time (a "heavy" share has several
concurrent busy chats); a chat opens with the default system prompt or, for a share of
chats, with one of a few long shared documents (Zipf popularity), then runs turns of a
new message and a reply with a think time between them; between chats the user is
away, for a mean time chosen so that the offered work is ``--load`` times the fleet's
capacity (estimated at a reference batch; the measured busy share and batch are
reported). All draws come from per-user generators seeded by ``--seed``, so every
policy sees the same users, chats and messages.

Reports per policy: cache hit ratio (cached prompt tokens / prompt tokens, the engine's
own definition), engine busy share, mean running batch, load imbalance (max / mean and
coefficient of variation of per-engine busy time and of requests), TTFT p50/p99,
throughput, Redis commands per request, CPU per routing decision; then the gateway's
costs: index size, ``kv_events`` frames and bytes per second, CPU per frame, CPU per
decision at 64/256/1024 engines (a micro-benchmark), and the request rate at which one
gateway core or one Redis (~100k simple commands/s) becomes the limit. Prints markdown
tables; ``--json`` also writes everything as JSON. Deterministic for a given ``--seed``
except the CPU-time columns.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.block_hash import chain_hashes, namespace_of, namespace_seed  # noqa: E402
from engine.protocol import EngineInfo, KvEventsFrame, encode  # noqa: E402
from gateway.engines.client import EngineClient, EngineRouter, RoutePrompt  # noqa: E402
from gateway.engines.routing import Placements, RoutingPolicy  # noqa: E402

__all__ = ["COSTS", "Costs", "PolicySpec", "SimConfig", "SimResult", "Workload", "decision_cost", "main",
           "parse_policies", "run_sim"]

WEIGHTS_ID = "sim"  # the stub engines' weights_id (their prefix-cache namespace)
REDIS_OPS_PER_S = 100_000  # simple commands/s one Redis core serves (the brief's figure)
REPLY_PATH_CPU_MS_PER_TOKEN = 0.26  # gateway CPU per streamed token, docs/benchmarks.md "The reply path"


# ----- costs ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Costs:
    """What one engine's steps cost and what its KV pool holds.

    Attributes:
        name: "cpu" or "gpu".
        measured: True when every figure is measured (``source`` says where).
        source: where the figures come from.
        decode_ms: (batch, ms per decode step) points at contexts of ``decode_ref_ctx``
            tokens; linear between points and beyond the last two.
        decode_ref_ctx: the context (tokens) the ``decode_ms`` points were measured at.
        attn_us: (batch, microseconds per step per decoding request per context token
            beyond ``decode_ref_ctx``, all layers) points: the decode attention's growth
            with context.
        chunk_ms: (cached context tokens before the chunk, ms for a prompt chunk of
            ``chunk_tokens``) points; a chunk of n tokens costs n / chunk_tokens of it.
        chunk_tokens: the step's token budget (prompt chunk tokens + decoding requests).
        kv_pages: KV pages (16 tokens) per engine.
        max_num_seqs: most running requests per engine.
        ref_batch: the batch at which the load target estimates an engine's capacity.
    """

    name: str
    measured: bool
    source: str
    decode_ms: tuple[tuple[float, float], ...]
    decode_ref_ctx: int
    attn_us: tuple[tuple[float, float], ...]
    chunk_ms: tuple[tuple[float, float], ...]
    chunk_tokens: int
    kv_pages: int
    max_num_seqs: int
    ref_batch: int


# SmolLM2-135M: 30 layers, 3 KV heads of 64, bfloat16 KV: 2 * 30 * 3 * 64 * 2 bytes = 23,040
# bytes a token, 368,640 a 16-token page; a 1 GiB pool (`--kv-cache-gib 1`, the engine's
# fixed default before it followed free memory, engine/kv_cache.py) holds 1 GiB // 368,640 = 2,912 pages.
CPU_COSTS = Costs(
    name="cpu", measured=True,
    source=("docs/benchmarks.md, SmolLM2-135M default format on 2 threads: decode step by batch "
            "('Decode step by format', default column: 8.3/12.9/46.2 ms at batch 1/4/16, 300-token "
            "contexts); decode attention growth ('Decode attention', ours bf16 KV, x 30 layers: "
            "slope over 64-8192 at batch 1 and 4, 256-8192 at batch 16); prompt chunk by cached "
            "context ('Prefill', bench/decode_step.py --prefill-chunk: 785/1099/1698/2358/3432 ms "
            "for 512 tokens after 0/1024/2048/4096/6000 cached); KV pool: the default 1 GiB "
            "budget / 368,640 bytes a page = 2,912 pages"),
    decode_ms=((1, 8.3), (4, 12.9), (16, 46.2)),
    decode_ref_ctx=300,
    # per layer (us per token of context per request): b1 (450-17)/8128, b4 (3331-32)/8128/4,
    # b16 (15645-261)/7936/16; times 30 layers
    attn_us=((1, 30 * 433 / 8128), (4, 30 * 3299 / 8128 / 4), (16, 30 * 15384 / 7936 / 16)),
    chunk_ms=((0, 785.0), (1024, 1099.0), (2048, 1698.0), (4096, 2358.0), (6000, 3432.0)),
    chunk_tokens=512,
    kv_pages=2912,
    max_num_seqs=64,
    ref_batch=16,
)

# ASSUMED, not measured: an H100-class GPU serving an 8B model in bfloat16 (Llama-3.1-8B:
# 32 layers, 8 KV heads of 128: 128 KiB of KV a token, 2 MiB a page). A decode step reads
# 16 GB of weights at ~3.3 TB/s (~5 ms) plus overhead; 60 GB of KV after weights and
# activations = 28,000 pages (~450k tokens); prefill ~11k tokens/s on a 2048-token chunk.
GPU_COSTS = Costs(
    name="gpu", measured=False,
    source=("ASSUMED (not measured): H100-class GPU, 8B model in bfloat16; decode 7/8/11/15/24 ms at "
            "batch 1/16/64/128/256; +0.06 us per context token per request (KV read at ~2.2 TB/s "
            "effective); a 2048-token chunk 180 ms plus 8 ms per 1000 cached tokens; 28,000 pages "
            "of KV; 256 running requests"),
    decode_ms=((1, 7.0), (16, 8.0), (64, 11.0), (128, 15.0), (256, 24.0)),
    decode_ref_ctx=0,
    attn_us=((1, 0.06), (256, 0.06)),
    chunk_ms=((0, 180.0), (8192, 245.0)),
    chunk_tokens=2048,
    kv_pages=28_000,
    max_num_seqs=256,
    ref_batch=128,
)

COSTS = {"cpu": CPU_COSTS, "gpu": GPU_COSTS}


def interp(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation through ``points`` (sorted by x), clamped below the
    first point and extrapolated along the last two beyond the last."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


# ----- workload ------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """The users and their chats (all lengths in tokens, times in seconds).

    Attributes:
        users: users in all.
        heavy_share: share of users with ``heavy_chats`` concurrent busy chats.
        heavy_chats: concurrent chats of a heavy user.
        heavy_think_s: median think time of a heavy user's chats (lognormal, sigma 0.8).
        heavy_busy: a heavy user's chats are away between chats this many times less
            than a normal user's.
        think_s: median think time between a reply's end and the next message
            (lognormal, sigma 0.8; mean 1.38x the median).
        turns_mean: mean turns of a chat (geometric, at most ``turns_max``).
        turns_max: most turns of a chat.
        msg_median, msg_sigma, msg_max: a new message's length (lognormal, clipped to
            [4, msg_max]).
        reply_median, reply_sigma, reply_max: a reply's length (lognormal, clipped to
            [8, reply_max]; 512 is the gateway's default max_tokens).
        system_tokens: the default system prompt every other chat opens with.
        doc_share: share of chats that open with a shared document instead.
        docs: distinct shared documents (Zipf popularity).
        doc_tokens: a document's length (each within +-100 of it).
        zipf_s: the Zipf exponent of the documents' popularity.
        max_context: a chat ends before a turn whose prompt and reply would pass this.
    """

    users: int = 10_000
    heavy_share: float = 0.05
    heavy_chats: int = 4
    heavy_think_s: float = 8.0
    heavy_busy: float = 10.0
    think_s: float = 20.0
    turns_mean: float = 6.0
    turns_max: int = 30
    msg_median: float = 60.0
    msg_sigma: float = 0.9
    msg_max: int = 1500
    reply_median: float = 200.0
    reply_sigma: float = 0.6
    reply_max: int = 512
    system_tokens: int = 32
    doc_share: float = 0.3
    docs: int = 8
    doc_tokens: int = 1500
    zipf_s: float = 1.1
    max_context: int = 8192


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def _tokens(rng: random.Random, n: int) -> array:
    """``n`` token ids (uint16) from ``rng``."""
    return array("H", rng.randbytes(2 * n))


@dataclass
class Chat:
    """One chat: its token stream (prompt pages named by chained hashes as the engine names
    them) and what is left of it."""

    key: str
    slot: Slot
    tokens: array
    pages: list[int]
    turns_left: int
    doc: int
    turn: int = 0
    prev_computed: int = 0  # tokens the previous turn's engine computed (its prompt + reply - 1)

    def extend(self, more: array, seed: int, block_size: int) -> None:
        """Append tokens and name the new whole pages (``engine.block_hash.chain_hashes``)."""
        self.tokens.extend(more)
        full = len(self.tokens) // block_size
        have = len(self.pages)
        if full > have:
            parent = self.pages[-1] if self.pages else seed
            self.pages.extend(chain_hashes(parent, self.tokens[have * block_size: full * block_size], block_size))


@dataclass
class Slot:
    """One concurrent chat process of a user: chats one after another, its own generator."""

    user: int
    index: int
    heavy: bool
    rng: random.Random
    chats: int = 0


@dataclass
class Request:
    """One turn sent to an engine."""

    rid: str
    chat: Chat
    prompt: int  # prompt tokens
    reply: int  # reply tokens
    t_arrive: float
    engine: int
    measured: bool
    bound_cached: int  # cached tokens with an infinite cache and perfect routing
    cached: int = 0
    to_prefill: int = 0
    prefilled: int = 0
    left: int = 0  # decode steps left after the first token
    reserved: int = 0  # private pages still held
    ttft: float = -1.0
    finished: int = 0


# ----- the engine model ----------------------------------------------------------------

class SimEngine:
    """One engine: continuous batching with chunked prefill over an LRU prefix cache of
    chained page hashes (the module doc gives the model and its sources).

    Args:
        index: the engine's slot (0..N-1).
        url: its address (its identity for the router).
        costs: step costs and pool size.
        sim: the simulation (its clock, event queue and counters).
    """

    def __init__(self, index: int, url: str, costs: Costs, sim: Sim) -> None:
        self.index = index
        self.url = url
        self.costs = costs
        self.sim = sim
        self.capacity = costs.kv_pages
        self.lru: OrderedDict[int, None] = OrderedDict()  # unpinned cached pages, oldest first
        self.pins: dict[int, int] = {}  # pinned cached page -> running requests holding it
        self.private = 0  # pages reserved by running requests, not (yet) in the cache
        self.waiting: list[Request] = []
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.mode = "idle"  # idle | step (one step with prompt chunks) | jump (k decode-only steps)
        self.version = 0
        self.step_start = 0.0
        self.step_dt = 0.0
        self.jump_k = 0
        self.chunks: list[tuple[Request, int]] = []
        self.pending: dict[int, bool] = {}  # page hash -> stored (True) / evicted (False) this step
        self.busy_s = 0.0  # in the measured window
        self.batch_s = 0.0  # running requests x seconds, in the measured window
        self.requests = 0  # measured requests routed here
        self.peak_cached = 0

    # --- pool ----
    def free(self) -> int:
        """Pages neither cached nor reserved."""
        return self.capacity - len(self.lru) - len(self.pins) - self.private

    def running(self) -> int:
        """Requests admitted and not finished."""
        return len(self.prefilling) + len(self.decoding)

    def _try_admit(self, r: Request) -> bool:
        bs = 16
        pages, lru, pins = r.chat.pages, self.lru, self.pins
        limit = (r.prompt - 1) // bs
        m = 0
        in_lru = 0
        while m < limit:
            h = pages[m]
            if h in pins:
                pass
            elif h in lru:
                in_lru += 1
            else:
                break
            m += 1
        need = -(-(r.prompt + r.reply) // bs) - m
        if self.free() + len(lru) - in_lru < need:
            return False
        for h in pages[:m]:
            c = pins.get(h)
            if c is None:
                del lru[h]
                pins[h] = 1
            else:
                pins[h] = c + 1
        while self.free() < need:
            h, _ = lru.popitem(last=False)
            self.pending[h] = False
        self.private += need
        r.reserved = need
        r.cached = m * bs
        r.to_prefill = r.prompt - r.cached
        return True

    def _insert(self, r: Request, lo: int, hi: int) -> None:
        """The request's computed pages ``lo..hi-1`` enter the cache, pinned by it."""
        pins, lru, pending = self.pins, self.lru, self.pending
        for h in r.chat.pages[lo:hi]:
            c = pins.get(h)
            if c is not None:
                pins[h] = c + 1
            elif h in lru:
                del lru[h]
                pins[h] = 1
            else:
                pins[h] = 1
                pending[h] = True
        n = max(0, hi - lo)
        r.reserved -= n
        self.private -= n

    def _release(self, r: Request, full: int) -> None:
        """Unpin the request's pages ``0..full-1``, deepest first (so a chain's leaf is the
        least recent), and give back its private pages."""
        pins, lru = self.pins, self.lru
        for h in reversed(r.chat.pages[:full]):
            c = pins[h] - 1
            if c:
                pins[h] = c
            else:
                del pins[h]
                lru[h] = None
        self.private -= r.reserved
        r.reserved = 0
        self.peak_cached = max(self.peak_cached, len(lru) + len(pins))

    # --- steps ----
    def enqueue(self, t: float, r: Request) -> None:
        """A routed request arrives at ``t``: it joins at the next step boundary."""
        self.waiting.append(r)
        if self.mode == "idle":
            self._next(t)
        elif self.mode == "jump":
            n = max(1, math.ceil((t - self.step_start) / self.step_dt - 1e-9))
            if n < self.jump_k:
                self.jump_k = n
                self.version += 1
                self.sim.push(self.step_start + n * self.step_dt, self.tick, self.version)

    def _decode_ms(self) -> float:
        c = self.costs
        b = len(self.decoding)
        extra = 0
        for r in self.decoding:
            ctx = r.prompt + r.reply - r.left
            if ctx > c.decode_ref_ctx:
                extra += ctx - c.decode_ref_ctx
        return interp(c.decode_ms, b) + interp(c.attn_us, b) * extra / 1000.0

    def _next(self, t: float) -> None:
        """Admit what fits (first come, first served) and start the next step at ``t``."""
        c = self.costs
        while self.waiting and self.running() < c.max_num_seqs and self._try_admit(self.waiting[0]):
            self.prefilling.append(self.waiting.pop(0))
        b = len(self.decoding)
        budget = c.chunk_tokens - b
        chunks: list[tuple[Request, int]] = []
        ms = 0.0
        for r in self.prefilling:
            if budget <= 0:
                break
            n = min(r.to_prefill - r.prefilled, budget)
            chunks.append((r, n))
            budget -= n
            ms += interp(c.chunk_ms, r.cached + r.prefilled) * n / c.chunk_tokens
        self.step_start = t
        self.chunks = chunks
        if chunks:
            if b:
                ms += self._decode_ms()
            self.mode, self.step_dt, self.jump_k = "step", ms / 1000.0, 1
            dt = self.step_dt
        elif b:
            self.mode, self.step_dt = "jump", self._decode_ms() / 1000.0
            self.jump_k = min(r.left for r in self.decoding)
            dt = self.jump_k * self.step_dt
        else:
            self.mode = "idle"
            self._flush(t)
            return
        self.version += 1
        self.sim.push(t + dt, self.tick, self.version)
        self._flush(t)

    def tick(self, t: float, version: int) -> None:
        """The step (or run of decode steps) that began at ``step_start`` ends at ``t``."""
        if version != self.version:
            return
        sim = self.sim
        lo, hi = max(self.step_start, sim.t0), min(t, sim.t1)
        if hi > lo:
            self.busy_s += hi - lo
            self.batch_s += (hi - lo) * self.running()
        k = self.jump_k if self.mode == "jump" else 1
        for r in self.decoding:
            r.left -= k
        done_prefill = []
        if self.mode == "step":
            for r, n in self.chunks:
                r.prefilled += n
                if r.prefilled >= r.to_prefill:
                    done_prefill.append(r)
        for r in done_prefill:
            self.prefilling.remove(r)
            r.ttft = t - r.t_arrive
            self._insert(r, r.cached // 16, r.prompt // 16)
            r.left = r.reply - 1
            self.decoding.append(r)
        still = []
        for r in self.decoding:
            if r.left <= 0:
                self._finish(t, r)
            else:
                still.append(r)
        self.decoding = still
        self._next(t)

    def _finish(self, t: float, r: Request) -> None:
        computed = r.prompt + r.reply - 1
        full = computed // 16
        self._insert(r, r.prompt // 16, full)
        self._release(r, full)
        r.finished += 1
        self.sim.finished(t, r, computed)

    def _flush(self, t: float) -> None:
        """Send this step's ``kv_events`` frame, if the cache changed."""
        if self.pending:
            pending, self.pending = self.pending, {}
            stored = [h for h, live in pending.items() if live]
            removed = [h for h, live in pending.items() if not live]
            self.sim.kv_frame(t, self, stored, removed)


# ----- the gateway side ----------------------------------------------------------------

class CountingPlacements(Placements):
    """``Placements`` kept in a dict: counts the Redis commands the real one would send
    (``GET`` per lookup; ``SET`` or ``DEL`` per change) instead of sending them."""

    def __init__(self) -> None:  # no Redis: nothing of the parent's state is used
        self.store: dict[str, str] = {}
        self.gets = 0
        self.sets = 0
        self.deletes = 0

    async def get(self, key: str) -> str | None:
        """The chat's placement (one ``GET``)."""
        self.gets += 1
        return self.store.get(key)

    async def set(self, key: str, url: str | None) -> None:
        """Store or forget the chat's placement (one ``SET ... EX`` or ``DEL``)."""
        if url is None:
            self.deletes += 1
            self.store.pop(key, None)
        else:
            self.sets += 1
            self.store[key] = url


def run_now(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (the router over ``CountingPlacements``) to
    its result, without an event loop.

    Raises:
        RuntimeError: it suspended (it awaited real I/O).
    """
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the routing coroutine suspended; the simulation cannot drive it")


def stub_clients(n: int, kv_pages: int) -> list[EngineClient]:
    """``n`` ``EngineClient`` objects that look connected (never started: no socket)."""
    clients = []
    for i in range(n):
        c = EngineClient(f"ws://engine-{i}:9000")
        c.info = EngineInfo(model="sim", max_model_len=8192, block_size=16, num_blocks=kv_pages,
                            weights_id=WEIGHTS_ID)
        c.protocol_version = 4
        c._ready.set()
        clients.append(c)
    return clients


# ----- the simulation ------------------------------------------------------------------

@dataclass(frozen=True)
class PolicySpec:
    """One routing setting to simulate.

    Attributes:
        policy: a ``gateway.engines.routing.POLICIES`` name.
        load_tokens: ``cache_aware``'s load weight (tokens per request of load).
        first_turn_ids: route a chat's first turn with its prompt's token ids (what the
            gateway does when it can read the engines' tokenizer; False: the gateway
            without it, which knows a chat's ids only from its second turn on).
    """

    policy: str
    load_tokens: float = 16.0
    first_turn_ids: bool = True

    @property
    def label(self) -> str:
        """The row name: ``cache_aware w=16``, ``, no tokenizer`` without turn-1 ids."""
        if self.policy != "cache_aware":
            return self.policy
        return f"cache_aware w={self.load_tokens:g}" + ("" if self.first_turn_ids else ", no tokenizer")


@dataclass(frozen=True)
class SimConfig:
    """One simulation run.

    Attributes:
        engines: engines in the fleet.
        workload: the users.
        costs: the engines' costs.
        spec: the routing setting.
        load: offered work as a share of the fleet's capacity at ``costs.ref_batch``.
        duration_s: the measured window (simulated seconds) after ``warmup_s``.
        warmup_s: simulated seconds before the window (counted nowhere).
        seed: seeds every draw.
        max_index_pages: the gateway index's bound (``RoutingPolicy.max_index_pages``).
    """

    engines: int = 64
    workload: Workload = field(default_factory=Workload)
    costs: Costs = CPU_COSTS
    spec: PolicySpec = field(default_factory=lambda: PolicySpec("cache_aware"))
    load: float = 0.6
    duration_s: float = 600.0
    warmup_s: float = 300.0
    seed: int = 1
    max_index_pages: int = 2_000_000


@dataclass
class SimResult:
    """What one run measured (requests: those arriving in the measured window)."""

    label: str
    requests: int
    finished_once: bool
    prompt_tokens: int
    cached_tokens: int
    bound_cached_tokens: int
    hit_ratio: float
    bound_hit_ratio: float
    busy_share: float
    mean_batch: float
    busy_max_over_mean: float
    busy_cv: float
    requests_cv: float
    requests_max_over_mean: float
    ttft_p50_s: float
    ttft_p99_s: float
    requests_per_s: float
    output_tokens_per_s: float
    redis_ops_per_request: float
    route_cpu_us: float
    index_pages_peak: int
    index_pages_end: int
    index_bytes_end: int
    index_dropped_pages: int
    kv_frames_per_s: float
    kv_bytes_per_s: float
    kv_hashes_per_s: float
    apply_cpu_us_per_frame: float
    fleet_cached_pages: int
    offered_turns_per_s: float
    normal_off_s: float
    sim_wall_s: float
    index_within_bound: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by the nearest-rank method; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _cv(xs: Sequence[float]) -> float:
    mean = sum(xs) / len(xs)
    if mean == 0:
        return 0.0
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) / mean


class Sim:
    """The event loop: users, the real router, the engine models, the counters."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        w = cfg.workload
        self.t0 = cfg.warmup_s
        self.t1 = cfg.warmup_s + cfg.duration_s
        self.heap: list[tuple[float, int, Any, Any]] = []
        self.seq = 0
        self.seed = namespace_seed(namespace_of(WEIGHTS_ID))
        self.engines = [SimEngine(i, f"ws://engine-{i}:9000", cfg.costs, self) for i in range(cfg.engines)]
        self.by_url = {e.url: e for e in self.engines}
        self.clients = stub_clients(cfg.engines, cfg.costs.kv_pages)
        self.client_of = {c.url: c for c in self.clients}
        policy = RoutingPolicy(policy=cfg.spec.policy, load_tokens=cfg.spec.load_tokens,
                               max_index_pages=cfg.max_index_pages)
        self.placements = CountingPlacements()
        self.router = EngineRouter(self.clients, policy, self.placements)
        self.router._rng = random.Random(f"{cfg.seed}:router")  # the random baseline, seeded
        self.indexing = cfg.spec.policy == "cache_aware"
        doc_rng = random.Random(f"{cfg.seed}:docs")
        self.system = _tokens(doc_rng, w.system_tokens)
        self.system_pages = chain_hashes(self.seed, self.system, 16)
        self.docs = [_tokens(doc_rng, w.doc_tokens + doc_rng.randint(-100, 100)) for _ in range(w.docs)]
        self.doc_pages = [chain_hashes(self.seed, d, 16) for d in self.docs]
        weights = [1 / (k + 1) ** w.zipf_s for k in range(w.docs)]
        total = sum(weights)
        self.doc_cdf = list(_accumulate([x / total for x in weights]))
        self.doc_seen: set[int] = set()
        self.system_seen = False
        self.requests: list[Request] = []
        self.n_routed = 0
        self.route_ns = 0
        self.routed_measured = 0
        self.frames = 0
        self.frame_bytes = 0
        self.frame_hashes = 0
        self.apply_ns = 0
        self.applies = 0
        self.index_peak = 0
        self.index_within_bound = True
        self.offered_turns_per_s, self.normal_off_s = self._calibrate()

    # --- events ----
    def push(self, t: float, fn: Any, arg: Any) -> None:
        """Run ``fn(t, arg)`` at simulated time ``t``."""
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, arg))

    def run(self) -> None:
        """Start every user, then run events until none is left (no new turn starts after
        the measured window; those in flight finish)."""
        w = self.cfg.workload
        n_heavy = round(w.users * w.heavy_share)
        for u in range(w.users):
            heavy = u < n_heavy
            for s in range(w.heavy_chats if heavy else 1):
                slot = Slot(u, s, heavy, random.Random(f"{self.cfg.seed}:{u}:{s}"))
                off = self.normal_off_s / (w.heavy_busy if heavy else 1.0)
                self.push(slot.rng.expovariate(1 / off) if off > 0 else slot.rng.uniform(0, w.think_s),
                          self.start_chat, slot)
        heap = self.heap
        while heap:
            t, _, fn, arg = heapq.heappop(heap)
            fn(t, arg)

    # --- workload ----
    def _chat_turns(self, rng: random.Random) -> int:
        w = self.cfg.workload
        p = 1 / w.turns_mean
        return min(w.turns_max, 1 + int(math.log(1 - rng.random()) / math.log(1 - p)) if p < 1 else 1)

    def _calibrate(self) -> tuple[float, float]:
        """The offered turn rate for ``load`` and the mean away time of normal users that
        gives it (0 when the users cannot offer that much even never away).

        Work per turn (engine-seconds) is estimated with ideal caching (only the new
        message is prefilled; a document or system prompt is cached) at ``ref_batch``:
        the new message's chunk cost at its context plus, per reply token, the step time
        at ``ref_batch`` divided by it plus the attention at the context. Estimated by
        drawing 4,000 chats from the workload's distributions."""
        cfg, w, c = self.cfg, self.cfg.workload, self.cfg.costs
        rng = random.Random(f"{cfg.seed}:calibrate")
        work = turns = 0.0
        dur = 0.0
        step_share = interp(c.decode_ms, c.ref_batch) / c.ref_batch
        attn = interp(c.attn_us, c.ref_batch) / 1000.0
        ref_step_s = interp(c.decode_ms, c.ref_batch) / 1000.0
        for _ in range(4000):
            k = self._chat_turns(rng)
            ctx = w.doc_tokens if rng.random() < w.doc_share else w.system_tokens
            for _turn in range(k):
                m = _lognormal(rng, w.msg_median, w.msg_sigma, 4, w.msg_max)
                r = _lognormal(rng, w.reply_median, w.reply_sigma, 8, w.reply_max)
                if ctx + m + r > w.max_context:
                    break
                ms = interp(c.chunk_ms, ctx) * m / c.chunk_tokens
                ms += r * (step_share + attn * max(0, ctx + m + r / 2 - c.decode_ref_ctx))
                work += ms / 1000.0
                turns += 1
                dur += r * ref_step_s
                ctx += m + r
        per_turn = work / turns
        turns_per_chat = turns / 4000
        reply_s = dur / turns
        target = cfg.load * cfg.engines / per_turn  # turns/s
        n_heavy = round(w.users * w.heavy_share)
        slots_heavy, normal = n_heavy * w.heavy_chats, w.users - n_heavy

        def rate(off: float) -> float:  # turns/s offered by all users when normal ones are away `off` s
            def one(think_median: float, away: float) -> float:
                return turns_per_chat / (turns_per_chat * (think_median * math.exp(0.8 ** 2 / 2) + reply_s) + away)
            return normal * one(w.think_s, off) + slots_heavy * one(w.heavy_think_s, off / w.heavy_busy)

        if rate(0.0) <= target:
            return rate(0.0), 0.0
        lo, hi = 0.0, 1.0
        while rate(hi) > target:
            hi *= 2
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if rate(mid) > target else (lo, mid)
        return target, hi

    def start_chat(self, t: float, slot: Slot) -> None:
        """A slot opens a new chat (with a document or the system prompt)."""
        if t >= self.t1:
            return
        w, rng = self.cfg.workload, slot.rng
        slot.chats += 1
        doc = -1
        if rng.random() < w.doc_share:
            u = rng.random()
            doc = next((i for i, p in enumerate(self.doc_cdf) if u <= p), w.docs - 1)
        if doc >= 0:
            tokens, pages = array("H", self.docs[doc]), list(self.doc_pages[doc])
        else:
            tokens, pages = array("H", self.system), list(self.system_pages)
        chat = Chat(f"u{slot.user}-s{slot.index}-c{slot.chats}", slot, tokens, pages, self._chat_turns(rng), doc)
        self.turn(t, chat)

    def turn(self, t: float, chat: Chat) -> None:
        """The chat's user sends a message: route it and hand it to the engine."""
        w, rng = self.cfg.workload, chat.slot.rng
        msg = _lognormal(rng, w.msg_median, w.msg_sigma, 4, w.msg_max)
        reply = _lognormal(rng, w.reply_median, w.reply_sigma, 8, w.reply_max)
        history = len(chat.tokens)
        if t >= self.t1 or chat.turns_left <= 0 or history + msg + reply > w.max_context:
            self._chat_over(t, chat)
            return
        prompt = history + msg
        if chat.turn == 0:
            ids = chat.tokens if self.cfg.spec.first_turn_ids else array("H")
            if chat.doc >= 0:
                known = len(self.doc_pages[chat.doc]) if chat.doc in self.doc_seen else 0
                self.doc_seen.add(chat.doc)
            else:
                known = len(self.system_pages) if self.system_seen else 0
                self.system_seen = True
        else:
            ids = chat.tokens
            known = chat.prev_computed // 16
        if chat.turn == 0 and self.cfg.spec.first_turn_ids:
            # with the tokenizer the gateway knows the whole first prompt: the new message is appended first
            chat.extend(_tokens(rng, msg), self.seed, 16)
            ids = chat.tokens
            msg_added = True
        else:
            msg_added = False
        route = RoutePrompt(ids, prompt)  # routed before the chat's tokens grow: no copy needed
        t_cpu = time.process_time_ns()
        client = run_now(self.router.choose(chat.key, prompt=route))
        self.route_ns += time.process_time_ns() - t_cpu
        self.n_routed += 1
        if not msg_added:
            chat.extend(_tokens(rng, msg), self.seed, 16)
        chat.extend(_tokens(rng, reply), self.seed, 16)
        engine = self.by_url[client.url]
        measured = self.t0 <= t < self.t1
        r = Request(f"{chat.key}-t{chat.turn}", chat, prompt, reply, t, engine.index, measured,
                    min(known, (prompt - 1) // 16) * 16)
        client._requests[r.rid] = None  # only its count is read (the stub never streams)
        if measured:
            self.requests.append(r)
            engine.requests += 1
        engine.enqueue(t, r)

    def _chat_over(self, t: float, chat: Chat) -> None:
        slot, w = chat.slot, self.cfg.workload
        off = self.normal_off_s / (w.heavy_busy if slot.heavy else 1.0)
        wait = slot.rng.expovariate(1 / off) if off > 0 else 0.0
        self.push(t + wait, self.start_chat, slot)

    def finished(self, t: float, r: Request, computed: int) -> None:
        """A reply ended on its engine: the chat's user thinks, then sends the next turn."""
        del self.client_of[self.engines[r.engine].url]._requests[r.rid]
        chat = r.chat
        chat.turn += 1
        chat.turns_left -= 1
        chat.prev_computed = computed
        w = self.cfg.workload
        median = w.heavy_think_s if chat.slot.heavy else w.think_s
        self.push(t + chat.slot.rng.lognormvariate(math.log(median), 0.8), self.turn, chat)

    def kv_frame(self, t: float, engine: SimEngine, stored: list[int], removed: list[int]) -> None:
        """An engine's ``kv_events`` frame: counted, sized, and applied to the router's index
        (only ``cache_aware`` subscribes, as ``EngineRouter`` does)."""
        if self.t0 <= t < self.t1:
            self.frames += 1
            self.frame_bytes += len(encode(KvEventsFrame(stored, removed)))
            self.frame_hashes += len(stored) + len(removed)
        if self.indexing:
            t_cpu = time.process_time_ns()
            self.router.index.apply(engine.url, stored, removed)
            self.apply_ns += time.process_time_ns() - t_cpu
            self.applies += 1
            n = len(self.router.index)
            self.index_peak = max(self.index_peak, n)
            if n > self.router.index.max_pages:
                self.index_within_bound = False

    # --- results ----
    def result(self, wall_s: float) -> SimResult:
        """The measured window's figures."""
        cfg = self.cfg
        reqs = self.requests
        done = [r for r in reqs if r.finished == 1]
        prompt = sum(r.prompt for r in reqs)
        cached = sum(r.cached for r in reqs)
        bound = sum(r.bound_cached for r in reqs)
        busy = [e.busy_s for e in self.engines]
        counts = [float(e.requests) for e in self.engines]
        mean_busy = sum(busy) / len(busy)
        mean_count = sum(counts) / len(counts)
        ttfts = [r.ttft for r in done]
        out_tokens = sum(r.reply for r in done)
        index = self.router.index
        pl = self.placements
        index_bytes = 0
        if self.indexing:
            owners = index._owners
            index_bytes = sys.getsizeof(owners) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in owners.items())
        return SimResult(
            label=cfg.spec.label,
            requests=len(reqs),
            finished_once=all(r.finished == 1 for r in reqs),
            prompt_tokens=prompt,
            cached_tokens=cached,
            bound_cached_tokens=bound,
            hit_ratio=cached / prompt if prompt else 0.0,
            bound_hit_ratio=bound / prompt if prompt else 0.0,
            busy_share=sum(busy) / (len(busy) * cfg.duration_s),
            mean_batch=sum(e.batch_s for e in self.engines) / max(1e-9, sum(busy)),
            busy_max_over_mean=max(busy) / mean_busy if mean_busy else 0.0,
            busy_cv=_cv(busy),
            requests_cv=_cv(counts),
            requests_max_over_mean=max(counts) / mean_count if mean_count else 0.0,
            ttft_p50_s=percentile(ttfts, 0.5),
            ttft_p99_s=percentile(ttfts, 0.99),
            requests_per_s=len(done) / cfg.duration_s,
            output_tokens_per_s=out_tokens / cfg.duration_s,
            redis_ops_per_request=(pl.gets + pl.sets + pl.deletes) / max(1, self.n_routed),
            route_cpu_us=self.route_ns / max(1, self.n_routed) / 1000.0,
            index_pages_peak=self.index_peak,
            index_pages_end=len(index) if self.indexing else 0,
            index_bytes_end=index_bytes,
            index_dropped_pages=index.dropped_pages,
            kv_frames_per_s=self.frames / cfg.duration_s,
            kv_bytes_per_s=self.frame_bytes / cfg.duration_s,
            kv_hashes_per_s=self.frame_hashes / cfg.duration_s,
            apply_cpu_us_per_frame=self.apply_ns / max(1, self.applies) / 1000.0,
            fleet_cached_pages=sum(len(e.lru) + len(e.pins) for e in self.engines),
            offered_turns_per_s=self.offered_turns_per_s,
            normal_off_s=self.normal_off_s,
            sim_wall_s=wall_s,
            index_within_bound=self.index_within_bound,
        )


def _accumulate(xs: Sequence[float]) -> list[float]:
    out, s = [], 0.0
    for x in xs:
        s += x
        out.append(s)
    return out


def run_sim(cfg: SimConfig) -> SimResult:
    """Simulate one routing setting (``cfg.spec``) and return its figures.

    Raises:
        ValueError: an engine's pool cannot hold a chat of ``max_context`` tokens.
    """
    if cfg.costs.kv_pages * 16 < cfg.workload.max_context + 16:
        raise ValueError(f"{cfg.costs.kv_pages} pages cannot hold a {cfg.workload.max_context}-token chat")
    start = time.perf_counter()
    sim = Sim(cfg)
    sim.run()
    return sim.result(time.perf_counter() - start)


# ----- the routing decision's cost at more engines ---------------------------------------

def decision_cost(engines: int, prompt_tokens: int = 2048, index_pages: int = 200_000, trials: int = 200,
                  seed: int = 1) -> dict[str, float]:
    """CPU microseconds per ``cache_aware`` decision of the real ``EngineRouter.choose``
    (hash the prompt's known ids, ``PrefixIndex.match``, loads, ``choose_cache_aware``,
    the placement lookup), with ``engines`` stub engines and an index of about
    ``index_pages`` pages (the prompt's pages held by 3 engines, the rest random), and of
    ``PrefixIndex.apply`` per page. Measured with ``time.process_time_ns``.

    Returns:
        ``{"engines", "decision_us", "hash_us", "apply_us_per_page"}``.
    """
    rng = random.Random(f"{seed}:decision")
    clients = stub_clients(engines, CPU_COSTS.kv_pages)
    router = EngineRouter(clients, RoutingPolicy(), CountingPlacements())
    tokens = _tokens(rng, prompt_tokens)
    pages = chain_hashes(namespace_seed(namespace_of(WEIGHTS_ID)), tokens, 16)
    per = max(1, index_pages // engines)
    t_apply = time.process_time_ns()
    n_applied = 0
    for i, c in enumerate(clients):
        stored = [rng.getrandbits(64) for _ in range(per)]
        if i < 3:
            stored += pages
        router.index.apply(c.url, stored, [])
        n_applied += len(stored)
    apply_us = (time.process_time_ns() - t_apply) / n_applied / 1000.0
    for i, c in enumerate(clients):
        for j in range(i % 7):
            c._requests[f"x{i}-{j}"] = None  # type: ignore[assignment]  # a load of i % 7
    prompt = RoutePrompt(tokens, prompt_tokens + 60)
    for k in range(20):  # warm-up, not timed
        run_now(router.choose(f"warm-{k}", prompt=prompt))
    t = time.process_time_ns()
    for k in range(trials):
        run_now(router.choose(f"chat-{k}", prompt=prompt))
    decision = (time.process_time_ns() - t) / trials / 1000.0
    seed_h = namespace_seed(namespace_of(WEIGHTS_ID))
    t = time.process_time_ns()
    for _ in range(trials):
        chain_hashes(seed_h, tokens, 16)
    hashing = (time.process_time_ns() - t) / trials / 1000.0
    return {"engines": engines, "decision_us": decision, "hash_us": hashing, "apply_us_per_page": apply_us}


# ----- report ----------------------------------------------------------------------------

def parse_policies(text: str) -> list[PolicySpec]:
    """``random,hash,cache_aware:256,cache_aware-noids:256`` -> specs (``:load_tokens``
    for cache_aware; ``-noids``: a gateway that cannot read the engines' tokenizer).

    Raises:
        ValueError: an unknown policy name.
    """
    out = []
    for part in text.split(","):
        name, _, weight = part.strip().partition(":")
        ids = not name.endswith("-noids")
        name = name.removesuffix("-noids")
        RoutingPolicy(policy=name)  # validates the name
        out.append(PolicySpec(name, float(weight) if weight else 16.0, ids))
    return out


DEFAULT_POLICIES = ("random,round_robin,hash,sticky,cache_aware:16,cache_aware:64,cache_aware:256,"
                    "cache_aware-noids:16")


def policy_table(results: list[SimResult]) -> str:
    """The per-policy markdown table."""
    head = ("| policy | load | hit ratio | bound | busy share | mean batch | busy max/mean | busy CV | "
            "requests CV | TTFT p50 (s) | TTFT p99 (s) | req/s | out tok/s | Redis ops/req | route CPU us |")
    lines = [head, "|" + "---|" * 15]
    for r in results:
        lines.append(
            f"| {r.label} | {r.extra.get('load', 0):.2f} | {r.hit_ratio:.3f} | {r.bound_hit_ratio:.3f} | "
            f"{r.busy_share:.2f} | {r.mean_batch:.1f} | {r.busy_max_over_mean:.2f} | {r.busy_cv:.2f} | "
            f"{r.requests_cv:.2f} | {r.ttft_p50_s:.2f} | {r.ttft_p99_s:.2f} | {r.requests_per_s:.2f} | "
            f"{r.output_tokens_per_s:.0f} | {r.redis_ops_per_request:.2f} | {r.route_cpu_us:.0f} |")
    return "\n".join(lines)


def gateway_table(r: SimResult, decisions: list[dict[str, float]]) -> str:
    """The gateway's costs for one ``cache_aware`` run, and where a core or Redis limits."""
    mean_reply = r.output_tokens_per_s / max(1e-9, r.requests_per_s)
    frames_per_req = r.kv_frames_per_s / max(1e-9, r.requests_per_s)
    route_ms = (r.route_cpu_us + frames_per_req * r.apply_cpu_us_per_frame) / 1000.0
    lines = ["| measure | value |", "|---|---|",
             f"| index pages (peak / end; bound {r.extra.get('max_index_pages', 0):,}) | "
             f"{r.index_pages_peak:,} / {r.index_pages_end:,} |",
             f"| index memory at the end (dict + ints, sys.getsizeof) | {r.index_bytes_end / 2**20:.1f} MiB "
             f"({r.index_bytes_end / max(1, r.index_pages_end):.0f} B/page) |",
             f"| pages cached in the whole fleet at the end | {r.fleet_cached_pages:,} |",
             f"| pages forgotten by the bound | {r.index_dropped_pages:,} |",
             f"| kv_events frames/s into the gateway | {r.kv_frames_per_s:,.0f} ({frames_per_req:.1f} per request) |",
             f"| kv_events bytes/s (JSON) | {r.kv_bytes_per_s / 1000:,.0f} kB/s ({r.kv_hashes_per_s:,.0f} hashes/s) |",
             f"| CPU per frame applied to the index | {r.apply_cpu_us_per_frame:.1f} us |",
             f"| CPU per routing decision in the run ({r.extra.get('engines', 0)} engines) | "
             f"{r.route_cpu_us:.0f} us |",
             f"| routing CPU per request (decision + its frames) | {route_ms * 1000:.0f} us: one core routes "
             f"{1000 / route_ms:,.0f} req/s |"]
    for d in decisions:
        lines.append(f"| decision at {int(d['engines'])} engines (2,048-token prompt, micro-benchmark) | "
                     f"{d['decision_us']:.0f} us ({d['hash_us']:.0f} of it hashing the prompt): "
                     f"{1e6 / d['decision_us']:,.0f} decisions/s per core |")
    if r.redis_ops_per_request > 0:
        lines.append(f"| Redis placement commands per request | {r.redis_ops_per_request:.2f}: one Redis "
                     f"(~{REDIS_OPS_PER_S // 1000}k ops/s) at {REDIS_OPS_PER_S / r.redis_ops_per_request:,.0f} "
                     f"req/s |")
    lines.append(f"| reply path, measured {REPLY_PATH_CPU_MS_PER_TOKEN} ms gateway CPU per token, "
                 f"{mean_reply:.0f}-token replies | one core streams "
                 f"{1000 / REPLY_PATH_CPU_MS_PER_TOKEN / mean_reply:,.0f} req/s; this fleet's "
                 f"{r.output_tokens_per_s:,.0f} tok/s need "
                 f"{r.output_tokens_per_s * REPLY_PATH_CPU_MS_PER_TOKEN / 1000:.1f} cores |")
    lines.append(f"| reply path Redis: one XADD per delta | ~{mean_reply:.0f} per request: one Redis at "
                 f"~{REDIS_OPS_PER_S / max(1.0, mean_reply):,.0f} req/s (at one token a delta) |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module doc). Returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--users", type=int, default=10_000)
    p.add_argument("--duration", type=float, default=600.0, help="measured simulated seconds")
    p.add_argument("--warmup", type=float, default=300.0, help="simulated seconds before the window")
    p.add_argument("--load", default="0.6", help="offered load(s), comma-separated (a sweep)")
    p.add_argument("--costs", choices=sorted(COSTS), default="cpu")
    p.add_argument("--policies", default=DEFAULT_POLICIES)
    p.add_argument("--doc-share", type=float, default=Workload.doc_share)
    p.add_argument("--max-index-pages", type=int, default=RoutingPolicy.max_index_pages)
    p.add_argument("--decision-engines", default="64,256,1024", help="engine counts of the decision micro-benchmark")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="also write every figure here")
    a = p.parse_args(argv)
    costs = COSTS[a.costs]
    workload = Workload(users=a.users, doc_share=a.doc_share)
    specs = parse_policies(a.policies)
    print(f"costs: {costs.name} ({'measured' if costs.measured else 'ASSUMED'}): {costs.source}", flush=True)
    results: list[SimResult] = []
    for load in [float(x) for x in a.load.split(",")]:
        for spec in specs:
            cfg = SimConfig(engines=a.engines, workload=workload, costs=costs, spec=spec, load=load,
                            duration_s=a.duration, warmup_s=a.warmup, seed=a.seed, max_index_pages=a.max_index_pages)
            r = run_sim(cfg)
            r.extra.update(load=load, engines=a.engines, max_index_pages=a.max_index_pages)
            results.append(r)
            print(f"  {r.label} at load {load}: {r.requests} requests, hit {r.hit_ratio:.3f}, "
                  f"TTFT p99 {r.ttft_p99_s:.2f} s, {r.sim_wall_s:.0f} s wall", file=sys.stderr, flush=True)
    decisions = [decision_cost(int(n), seed=a.seed) for n in a.decision_engines.split(",") if n]
    first = results[0]
    print(f"\n{a.engines} engines, {a.users:,} users, {a.duration:.0f} s measured after {a.warmup:.0f} s, seed "
          f"{a.seed}; offered {first.offered_turns_per_s:.1f} turns/s (normal users away {first.normal_off_s:.0f} s "
          f"on average between chats)\n")
    print(policy_table(results))
    aware = [r for r in results if r.label == "cache_aware b=0.5"] or [r for r in results if r.index_pages_peak]
    if aware:
        print(f"\nThe gateway's costs ({aware[0].label}, load {aware[0].extra['load']:.2f}):\n")
        print(gateway_table(aware[0], decisions))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"costs": asdict(costs), "workload": asdict(workload),
                       "results": [asdict(r) for r in results], "decisions": decisions}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
