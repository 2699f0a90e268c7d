"""Serving, side by side: ours (gateway + engine) against llama.cpp's llama-server and
transformers' ``generate`` with static batching, all through the OpenAI chat API.

    python bench/serving.py [--quick] [--json] [--write-docs]
                            [--systems ours,llamacpp,llamacpp-q4_1,hf] [--workloads chat,mixed,single]
                            [--levels 1,4,16,32] [--arrival closed|poisson --rate R]

One client (``serving_lib.openai_client``: httpx, streaming SSE) drives every system, on
the same SmolLM2-135M weights and 2 threads each (systems run one after another, never
at the same time). Each runs its default settings: ours the engine's "auto" format
(``engine/formats.py``; on the CPU int8 weights, float32 activations, a bfloat16 KV
cache; ``--dtype``/``--quantization`` pick another), transformers ``--hf-dtype``
(bfloat16). llama.cpp (``llamacpp``) runs its fastest CPU format, Q4_0 made from the same weights by
its own tools (``bench/build_llamacpp.sh --models``; the package's Q4_1 file when that has not been
run, or ``--gguf``), and ``llamacpp-q4_1`` the package's Q4_1 file; the targets are against the
first. Every request is greedy with ``ignore_eos``, so each system generates
exactly the same number of tokens; the text is not compared (llama.cpp quantizes
weights to 4 bits and activations to 8, so near-ties decode differently).
llama.cpp's ``llama-server`` and files are those of ``$LLAMACPP_DIR`` (default
``~/.cache/chatserve/llama.cpp``, where ``bench/build_llamacpp.sh`` builds; ``bench/llamacpp_paths.py``).

Workloads (``serving_lib.workloads``):
- chat: at concurrency C, C users each hold an 8-turn conversation (closed loop: a user
  sends turn k+1 when reply k ends), a shared system prompt, user messages of 20-200
  tokens, replies of 16-128; reports TTFT by turn and the prefix-cache hit ratio
  (cached / prompt tokens over turns 2-8, where the system reports cached tokens);
- mixed: 2C independent prompts of 32-1024 tokens with 16-256 outputs, C in flight
  (``--arrival poisson --rate R``: Poisson arrivals instead, unbounded in flight);
- single: one user, one stream, for latency.
Per system, workload and concurrency: requests/s, output tokens/s, TTFT p50/p99, TPOT
p50/p99, inter-token gap p99. ``--quick`` runs chat at 16 users with short turns, a
small mixed run at 4 and one single stream (about 4 minutes for all three systems on
the 2-vCPU development machine, one of them ours).
Prints a table last; ``--json`` prints one JSON object instead; ``--write-docs``
rewrites the generated part of docs/benchmarks.md's serving section and the plots in
docs/img/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from bench.serving_lib import docs  # noqa: E402
from bench.serving_lib.openai_client import RequestResult, stream_chat  # noqa: E402
from bench.serving_lib.stats import fmt, percentile  # noqa: E402
from bench.serving_lib.workloads import RequestSpec, chat_users, mixed_requests, poisson_offsets, single_requests  # noqa: E402

DOC_TAG = "serving.py"
DOC_BEGIN, DOC_END = f"<!-- {DOC_TAG}: begin -->", f"<!-- {DOC_TAG}: end -->"


@dataclass
class Plan:
    """Sizes of one run (tokens are approximate for prompts, exact for outputs)."""

    levels: tuple[int, ...] = (1, 4, 16, 32)
    workloads: tuple[str, ...] = ("chat", "mixed", "single")
    turns: int = 8
    user_tokens: tuple[int, int] = (20, 200)
    reply_tokens: tuple[int, int] = (16, 128)
    mixed_prompt: tuple[int, int] = (32, 1024)
    mixed_output: tuple[int, int] = (16, 256)
    mixed_per_level: int = 2
    mixed_levels: tuple[int, ...] | None = None
    single_requests: int = 3
    single_output: int = 128
    arrival: str = "closed"
    rate: float = 2.0
    seed: int = 0


QUICK = Plan(levels=(16,), turns=8, user_tokens=(20, 60), reply_tokens=(16, 32), mixed_prompt=(32, 256),
             mixed_output=(16, 64), mixed_levels=(4,), single_requests=1, single_output=64)


# ---- running a workload ----------------------------------------------------------------

async def run_closed(client: httpx.AsyncClient, specs: Sequence[RequestSpec], concurrency: int,
                     model: str) -> tuple[list[RequestResult], float]:
    """Closed loop: ``concurrency`` workers take the specs in order; returns the results
    (in spec order) and the wall time (s)."""
    out: list[RequestResult | None] = [None] * len(specs)
    nxt = iter(range(len(specs)))

    async def worker() -> None:
        for i in nxt:
            out[i] = await stream_chat(client, specs[i].body(model), specs[i].tags)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return [r for r in out if r is not None], time.perf_counter() - t0


async def run_poisson(client: httpx.AsyncClient, specs: Sequence[RequestSpec], offsets: Sequence[float],
                      model: str) -> tuple[list[RequestResult], float]:
    """Open loop: spec ``i`` is sent at ``offsets[i]`` seconds whatever is in flight."""
    t0 = time.perf_counter()

    async def one(spec: RequestSpec, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        return await stream_chat(client, spec.body(model), spec.tags)

    res = await asyncio.gather(*(one(s, t) for s, t in zip(specs, offsets)))
    return list(res), time.perf_counter() - t0


async def run_chat(client: httpx.AsyncClient, users: list, model: str) -> tuple[list[RequestResult], float]:
    """Every user runs its conversation turn by turn, all users at once."""
    results: list[RequestResult] = []

    async def user(conv: Any) -> None:
        while not conv.finished:
            spec = conv.next_request()
            r = await stream_chat(client, spec.body(model), spec.tags)
            results.append(r)
            conv.record_reply(r.text if r.ok else "")
            if not r.ok:
                return  # a failed turn ends the conversation (counted as an error)

    t0 = time.perf_counter()
    await asyncio.gather(*(user(u) for u in users))
    return results, time.perf_counter() - t0


def summarize_run(results: Sequence[RequestResult], wall_s: float, expected: int) -> dict[str, Any]:
    """Throughput and latency of one run (module doc), with the raw samples kept for plots.

    ``expected``: requests planned (missing or failed ones count as errors).
    """
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_ms for r in ok if r.chunk_ms]
    tpot = [r.tpot_ms for r in ok if not math.isnan(r.tpot_ms)]
    gaps = [g for r in ok for g in r.gaps_ms]
    out = {"requests": len(ok), "errors": expected - len(ok), "wall_s": wall_s,
           "req_s": len(ok) / wall_s if wall_s else 0.0,
           "output_tok_s": sum(r.output_tokens for r in ok) / wall_s if wall_s else 0.0,
           "output_tokens": sum(r.output_tokens for r in ok), "prompt_tokens": sum(r.prompt_tokens for r in ok),
           "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
           "tpot_p50": percentile(tpot, 0.5), "tpot_p99": percentile(tpot, 0.99),
           "itl_p99": percentile(gaps, 0.99), "ttft_ms": ttft, "tpot_ms": tpot,
           "error_samples": [r.error for r in results if not r.ok][:3]}
    turns = sorted({int(r.tags["turn"]) for r in ok if "turn" in r.tags})
    if turns:
        out["ttft_by_turn"] = {str(t): [r.ttft_ms for r in ok if r.tags.get("turn") == t and r.chunk_ms]
                               for t in turns}
        later = [r for r in ok if r.tags.get("turn", 1) >= 2 and r.cached_tokens is not None]
        prompt = sum(r.prompt_tokens for r in later)
        out["cache_hit"] = sum(r.cached_tokens or 0 for r in later) / prompt if later and prompt else None
    return out


async def run_workload(base_url: str, workload: str, level: int, plan: Plan, model: str) -> dict[str, Any]:
    """One workload at one concurrency level against the API at ``base_url``."""
    # a fresh connection per request: a pooled keep-alive connection that the server
    # closes just as a request is sent fails with "Server disconnected" (seen with
    # llama-server's 5 s idle timeout); one TCP connect on loopback costs well under 1 ms
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(900, connect=30), limits=limits) as c:
        seed = plan.seed * 1000 + level
        if workload == "chat":
            users = chat_users(level, plan.turns, seed, plan.user_tokens, plan.reply_tokens[1],
                               plan.reply_tokens[0])
            res, wall = await run_chat(c, users, model)
            return summarize_run(res, wall, level * plan.turns)
        if workload == "mixed":
            specs = mixed_requests(max(4, plan.mixed_per_level * level), seed, plan.mixed_prompt, plan.mixed_output)
            if plan.arrival == "poisson":
                offs = poisson_offsets(plan.rate, len(specs), random.Random(seed))
                res, wall = await run_poisson(c, specs, offs, model)
            else:
                res, wall = await run_closed(c, specs, level, model)
            return summarize_run(res, wall, len(specs))
        if workload == "single":
            specs = single_requests(plan.single_requests, seed, 64, plan.single_output)
            res, wall = await run_closed(c, specs, 1, model)
            return summarize_run(res, wall, len(specs))
    raise ValueError(f"unknown workload {workload!r}")


def schedule(plan: Plan) -> list[tuple[int, str]]:
    """(concurrency, workload) pairs in run order (ascending concurrency, so a system
    restarted per level starts once per level)."""
    pairs = []
    if "single" in plan.workloads:
        pairs.append((1, "single"))
    if "chat" in plan.workloads:
        pairs += [(c, "chat") for c in plan.levels]
    if "mixed" in plan.workloads:
        pairs += [(c, "mixed") for c in (plan.mixed_levels or plan.levels)]
    return sorted(pairs, key=lambda p: (p[0], p[1] != "single"))


# ---- reporting -----------------------------------------------------------------------------

def results_table(results: dict[str, Any]) -> str:
    """One Markdown row per system, workload and concurrency."""
    head = ("| system | workload | conc. | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
            "| gap p99 | cache hit | errors |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for system, by_w in results.items():
        for w in ("chat", "mixed", "single"):
            for lvl in sorted(by_w.get(w, {}), key=int):
                r = by_w[w][lvl]
                hit = "-" if r.get("cache_hit") is None else f"{100 * r['cache_hit']:.0f}%"
                rows.append(f"| {system} | {w} | {lvl} | {fmt(r['req_s'], 2)} | {fmt(r['output_tok_s'], 0)} "
                            f"| {fmt(r['ttft_p50'], 0)} | {fmt(r['ttft_p99'], 0)} | {fmt(r['tpot_p50'], 1)} "
                            f"| {fmt(r['tpot_p99'], 1)} | {fmt(r['itl_p99'], 1)} | {hit} | {r['errors']} |")
    return head + "\n" + "\n".join(rows)


def turn_table(results: dict[str, Any], level: str) -> str:
    """Chat TTFT p50 (ms) by turn at one concurrency level, one row per system."""
    runs = {s: w["chat"][level] for s, w in results.items() if level in w.get("chat", {})}
    if not runs:
        return ""
    turns = sorted({int(t) for r in runs.values() for t in r["ttft_by_turn"]})
    head = "| system | " + " | ".join(f"turn {t}" for t in turns) + " |\n|---|" + "---|" * len(turns)
    rows = [f"| {s} | " + " | ".join(fmt(percentile(r["ttft_by_turn"].get(str(t), []), 0.5), 0) for t in turns)
            + " |" for s, r in runs.items()]
    return head + "\n" + "\n".join(rows)


def systems_table(info: dict[str, Any], results: dict[str, Any]) -> str:
    """Version, weights, bytes read per decode step, and the bandwidth a single stream's
    TPOT implies (bytes per step / TPOT p50)."""
    head = ("| system | version | weights | weight bytes read per token (batch 1) | implied GB/s, single stream "
            "| time in this run (s) |\n|---|---|---|---|---|---|")
    rows = []
    for s, d in info.items():
        single = results.get(s, {}).get("single", {}).get("1")
        bw = d["bytes_per_step"] / (single["tpot_p50"] / 1000) / 1e9 if single and single["tpot_p50"] == \
            single["tpot_p50"] and single["tpot_p50"] > 0 else float("nan")
        rows.append(f"| {s} | {d['version']} | {d['weights']} | {d['bytes_per_step'] / 2**20:.0f} MiB | {fmt(bw, 1)} "
                    f"| {fmt(d.get('wall_s', float('nan')), 0)} |")
    return head + "\n" + "\n".join(rows)


def peer_label(results: dict[str, Any]) -> str:
    """The llama.cpp system the targets compare against: its Q4_0 (fastest CPU format)
    when it ran, else the first llama.cpp label in ``results`` ("llama.cpp" when none)."""
    labels = [x for x in results if x.startswith("llama.cpp")]
    return "llama.cpp Q4_0" if "llama.cpp Q4_0" in labels else (labels[0] if labels else "llama.cpp")


def targets(results: dict[str, Any], ours: str = "ours", peer: str | None = None, level: str = "16",
            quick: bool = True, mixed_level: str = "4") -> list[str]:
    """The engine-speed targets against ``peer`` (default ``peer_label(results)``), each as one
    line saying met or missed and by how much: chat at ``level`` users at least 2x the peer's
    output tokens/s in the quick run (1.5x in the full sweep), its last turn's TTFT p50 at
    most 0.5x the peer's, mixed at ``mixed_level`` at least 1.5x the peer's output tokens/s,
    and a single stream's TPOT at most 0.6x the peer's."""
    peer = peer or peer_label(results)
    lines = []
    o, p = results.get(ours, {}), results.get(peer, {})
    oc, pc = o.get("chat", {}).get(level), p.get("chat", {}).get(level)
    if oc and pc:
        want = 2.0 if quick else 1.5
        ratio = oc["output_tok_s"] / pc["output_tok_s"] if pc["output_tok_s"] else float("nan")
        lines.append(f"chat at {level} users, output tokens/s at least {want:g}x {peer}'s: ours "
                     f"{oc['output_tok_s']:.0f}, {peer} {pc['output_tok_s']:.0f} ({ratio:.2f}x): "
                     f"{'met' if ratio >= want else 'MISSED'}")
        last = str(max(int(t) for t in oc["ttft_by_turn"]))
        ot = percentile(oc["ttft_by_turn"][last], 0.5)
        pt = percentile(pc["ttft_by_turn"].get(last, []), 0.5)
        lines.append(f"chat at {level} users, turn-{last} TTFT p50 at most 0.5x {peer}'s: ours {ot:.0f} ms, {peer} "
                     f"{pt:.0f} ms ({ot / pt:.2f}x): {'met' if ot <= 0.5 * pt else 'MISSED'}")
    om, pm = o.get("mixed", {}).get(mixed_level), p.get("mixed", {}).get(mixed_level)
    if om and pm:
        ratio = om["output_tok_s"] / pm["output_tok_s"] if pm["output_tok_s"] else float("nan")
        lines.append(f"mixed at {mixed_level}, output tokens/s at least 1.5x {peer}'s: ours {om['output_tok_s']:.0f}, "
                     f"{peer} {pm['output_tok_s']:.0f} ({ratio:.2f}x): {'met' if ratio >= 1.5 else 'MISSED'}")
    os_, ps = o.get("single", {}).get("1"), p.get("single", {}).get("1")
    if os_ and ps:
        r = os_["tpot_p50"] / ps["tpot_p50"]
        lines.append(f"single stream, TPOT at most 0.6x {peer}'s: ours {os_['tpot_p50']:.1f} ms, {peer} "
                     f"{ps['tpot_p50']:.1f} ms ({r:.2f}x): {'met' if r <= 0.6 else 'MISSED'}")
    return lines


def doc_block(report: dict[str, Any], cmd: str, images: list[str]) -> str:
    """The generated part of docs/benchmarks.md's serving section (Markdown)."""
    res, level = report["results"], report["turn_level"]
    parts = [f"Command: `{cmd}` (wall time {report['wall_s'] / 60:.1f} min; {report['host']}; "
             f"load average before the run {report['load_before']}).", "",
             systems_table(report["systems"], res), "",
             "Times in ms; TPOT = (last chunk - first chunk) / (output tokens - 1) per request; gap = time "
             "between consecutive streamed chunks; cache hit = cached / prompt tokens over turns 2+ "
             "(as the system reports it; `-` where it does not).", "", results_table(res)]
    tt = turn_table(res, level)
    if tt:
        parts += ["", f"Chat TTFT p50 (ms) by turn, {level} users:", "", tt]
    t = targets(res, level=level, quick=report.get("quick", True))
    if t:
        parts += ["", "Targets:", ""] + [f"- {x}" for x in t]
    if images:
        parts += [""] + [f"![{Path(i).stem}]({i})" for i in images]
    return "\n".join(parts)


def replace_block(doc: str, heading: str, block: str, quick: bool = False) -> str:
    """``doc`` with this script's generated block (between ``DOC_BEGIN``/``DOC_END``, or
    the ``--quick`` run's own markers when ``quick``) in the section under ``heading``
    replaced by ``block`` (see ``serving_lib.docs``). The full sweep and the quick run
    keep one block each.

    Raises:
        ValueError: no markers and no ``heading`` in ``doc``.
    """
    return docs.replace_block(doc, heading, block, DOC_TAG + (" --quick" if quick else ""))


# ---- main ---------------------------------------------------------------------------------

def _csv_ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def _pair(s: str) -> tuple[int, int]:
    a, b = _csv_ints(s)
    return a, b


def build_systems(a: argparse.Namespace) -> dict[str, Any]:
    """The systems named by ``--systems`` (label -> System), ours first."""
    from bench.serving_lib import systems as S

    out: dict[str, Any] = {}
    model = Path(a.model) if a.model else None
    for name in a.systems.split(","):
        if name == "ours":
            out["ours"] = S.Ours("ours", model_dir=model, dtype=a.dtype, threads=a.threads, redis_url=a.redis_url,
                                 kv_cache_gib=a.kv_cache_gib, quantization=a.quantization)
        elif name in ("llamacpp", "llamacpp-q4_1"):
            binary = Path(a.llama_server) if a.llama_server else S.LLAMA_SERVER_DEFAULT
            if S.llama_server_available(binary):
                if name == "llamacpp" and a.gguf:
                    label, gguf = "llama.cpp", Path(a.gguf)
                elif name == "llamacpp" and S.PEER_Q4_0.is_file():
                    label, gguf = "llama.cpp Q4_0", S.PEER_Q4_0
                else:  # the package's Q4_1 file
                    label, gguf = "llama.cpp Q4_1", None
                    if name == "llamacpp":
                        print("no llama.cpp Q4_0 file (run bench/build_llamacpp.sh --models): its Q4_1 is the peer",
                              file=sys.stderr)
                if label not in out:
                    out[label] = S.LlamaCpp(label, binary=binary, threads=a.threads, gguf=gguf)
            elif name == "llamacpp" and S.llama_python_available():
                out["llama-cpp-python (Python server)"] = S.LlamaCpp(
                    "llama-cpp-python (Python server)", threads=a.threads, python_fallback=True)
            else:
                print(f"skipping {name}: no {binary} (run bench/build_llamacpp.sh)", file=sys.stderr)
        elif name == "hf":
            out["transformers (static)"] = S.HFStatic("transformers (static)", model_dir=model, dtype=a.hf_dtype,
                                                     threads=a.threads)
        else:
            raise SystemExit(f"unknown system {name!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns 0, or 1 when any request failed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md and docs/img/")
    p.add_argument("--systems", default="ours,llamacpp,llamacpp-q4_1,hf")
    p.add_argument("--workloads", default=None, help="comma list of chat,mixed,single")
    p.add_argument("--levels", default=None, help="concurrency levels, e.g. 1,4,16,32")
    p.add_argument("--turns", type=int, default=None)
    p.add_argument("--reply-tokens", default=None, help="min,max reply tokens of the chat workload")
    p.add_argument("--user-tokens", default=None, help="min,max user message tokens of the chat workload")
    p.add_argument("--single-requests", type=int, default=None)
    p.add_argument("--single-output", type=int, default=None)
    p.add_argument("--arrival", choices=["closed", "poisson"], default="closed")
    p.add_argument("--rate", type=float, default=2.0, help="requests/s of Poisson arrivals (mixed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="our activations (auto: the engine's default format for this machine)")
    p.add_argument("--quantization", default="auto", choices=["auto", "int8", "none", ""],
                   help="our weights ('' or none: weights in --dtype)")
    p.add_argument("--hf-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="transformers' weights and activations")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None, help="HF model folder (default: the bundled SmolLM2)")
    p.add_argument("--kv-cache-gib", type=float, default=3.0,
                   help="our engine's KV budget: 3 GiB is ~68k tokens in float32, ~136k in bfloat16")
    p.add_argument("--gguf", default=None,
                   help="GGUF for llamacpp (default: its Q4_0 of bench/build_llamacpp.sh --models, else the package's)")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: bench/build_llamacpp.sh's)")
    p.add_argument("--ours-url", default=None, help="measure this running gateway instead of starting ours")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    a = p.parse_args(argv)

    base = QUICK if a.quick else Plan()
    plan = Plan(**{**base.__dict__})
    if a.levels:
        plan.levels = _csv_ints(a.levels)
        plan.mixed_levels = None
    if a.workloads:
        plan.workloads = tuple(a.workloads.split(","))
    plan.turns = a.turns or plan.turns
    plan.reply_tokens = _pair(a.reply_tokens) if a.reply_tokens else plan.reply_tokens
    plan.user_tokens = _pair(a.user_tokens) if a.user_tokens else plan.user_tokens
    plan.single_requests = a.single_requests or plan.single_requests
    plan.single_output = a.single_output or plan.single_output
    plan.arrival, plan.rate, plan.seed = a.arrival, a.rate, a.seed

    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    t_start = time.perf_counter()
    systems = build_systems(a)
    if a.ours_url and "ours" in systems:
        systems["ours"].base_url = a.ours_url  # start() returns it; stop() leaves it running
        systems["ours"].children = []
    results: dict[str, Any] = {}
    info: dict[str, Any] = {}
    for label, system in systems.items():
        info[label] = system.describe()
        results[label] = {}
        current = None
        t_system = time.perf_counter()
        try:
            for level, workload in schedule(plan):
                if current != level:
                    url = system.start(level)
                    current = level
                    if label != "ours" or not a.ours_url:
                        # one untimed request so first-request costs (allocations, compiles) are not measured
                        asyncio.run(run_workload(url, "single", 1, Plan(single_requests=1, single_output=4,
                                                                          seed=999), system.model_name))
                print(f"[{label}] {workload} at {level} ...", file=sys.stderr, flush=True)
                r = asyncio.run(run_workload(url, workload, level, plan, system.model_name))
                results[label].setdefault(workload, {})[str(level)] = r
                print(f"[{label}] {workload} at {level}: {r['output_tok_s']:.0f} tok/s, TTFT p50 "
                      f"{fmt(r['ttft_p50'], 0)} ms, errors {r['errors']} {r['error_samples'][:1]}",
                      file=sys.stderr, flush=True)
        finally:
            if not (label == "ours" and a.ours_url):
                system.stop()
            info[label]["wall_s"] = time.perf_counter() - t_system
            print(f"[{label}] done in {info[label]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t_start
    turn_level = "16" if "16" in {str(c) for c in plan.levels} else str(max(plan.levels))
    report = {"plan": plan.__dict__, "systems": info, "results": results, "wall_s": wall,
              "turn_level": turn_level, "load_before": load_before, "quick": a.quick,
              "host": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"}
    cmd = "python bench/serving.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.write_docs:
        from bench.serving_lib import plots

        img = ROOT / "docs" / "img"
        img.mkdir(parents=True, exist_ok=True)
        sfx = "_quick" if a.quick else ""
        made = [plots.throughput_vs_concurrency(results, img / f"serving_throughput{sfx}.png"),
                plots.ttft_by_turn(results, turn_level, img / f"serving_ttft_by_turn{sfx}.png"),
                plots.latency_cdfs(results, "chat", turn_level, img / f"serving_latency_cdf{sfx}.png")]
        images = [f"img/{m.name}" for m in made if m is not None]
        doc_path = ROOT / "docs" / "benchmarks.md"
        doc = doc_path.read_text()
        doc_path.write_text(replace_block(doc, "## Serving, side by side", doc_block(report, cmd.strip(), images),
                                          quick=a.quick))
    errors = sum(r["errors"] for by_w in results.values() for w in by_w.values() for r in w.values())
    if a.json:
        print(json.dumps(report, default=str))
    else:
        print("\n".join(targets(results, level=turn_level, quick=a.quick)))
        print(systems_table(info, results))
        print(results_table(results))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
