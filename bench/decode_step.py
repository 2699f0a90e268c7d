"""Decode step time by serving format, against the memory-bandwidth floor measured in the
same run; paged decode attention against SDPA; and where one step's time goes.

    python bench/decode_step.py [--formats default,exact,int8+bf16] [--batches 1,4,16]
                                [--context 300] [--steps 20] [--threads 2] [--model PATH] [--json]
    python bench/decode_step.py --attention [--contexts 64,256,1024,2048,4096,8192] [--batches 1,16]
    python bench/decode_step.py --profile [--formats default] [--batches 1]
    python bench/decode_step.py --ops [--formats default] [--batches 1,16] [--context 300] [--sampling chat]
    python bench/decode_step.py --prefill-chunk [--prefixes 0,1024,2048,4096,6000]
    python bench/decode_step.py --quality [--formats default,int8+bf16] [--gguf Q4_0.gguf,...]
    python bench/decode_step.py --quality --agreement [--formats default,int8] [--gguf Q4_0.gguf] [--answers]
    python bench/decode_step.py --llama-bench [--gguf Q4_0.gguf,Q4_1.gguf] [--formats default]

Formats (``engine/formats.py``): ``default`` is what the engine picks on this machine
("auto"); ``exact`` is float32 everywhere through torch (transformers parity);
``int8``, ``int4`` and ``int4-sym`` are those weights on the CPU kernels (float32
activations); ``int4-torch`` is the 4-bit weights dequantized and run through torch in
float32 (activations and KV unrounded: the weights' share of ``int4``'s drift);
``int8+bf16`` is int8 weights with bfloat16 activations on torch's int8 kernel;
``bfloat16`` is bfloat16 weights. For each, the model (default: the bundled
SmolLM2-135M-Instruct) admits B requests with the same ``--context``-token prompt,
prefills them, and times ``--steps`` pure decode steps through ``EngineCore.step``
(schedule, forward, sample, detokenize; median ms per step).

The floor of a batch-1 step is the bytes it must read (every weight once, plus the KV
of the context) over the read bandwidth measured here (a 512 MiB float32 sum on the same
threads); the table prints both and the ratio.

``--attention`` times one layer's attention call alone (SmolLM2's 9 query and 3 KV
heads of 64) at each context: the CPU kernels' paged attention over a bfloat16 cache and
over a float32 one, against the torch backend (gather through the block tables, then
SDPA) over float32. ``--profile`` prints cProfile's table of 50 decode steps; ``--ops``
the time of each op of the fused CPU-kernel layers (``ops_table``) in decode steps and a
512-token prefill; its requests decode greedily, or with ``--sampling chat`` as a new chat
samples (``CHAT_SAMPLING``: temperature 0.7, top_p 0.95, frequency_penalty 0.4) after an
English prompt.
``--prefill-chunk`` times one 512-token prefill step after a cached prefix of each size.
``--quality`` prints each format's mean log-likelihood of a fixed English text and its
shift against ``exact`` (nats per token), the quality bar of the serving formats; each
``--gguf`` file (e.g. llama.cpp's Q4_0 made by ``bench/build_llamacpp.sh --models``) adds a
row: its weights dequantized and run in float32 (the weights' share of that format's
shift; llama.cpp also rounds activations to 8 bits, which this row leaves out).
``--quality --agreement`` scores greedy answers instead (``agreement_table``): 30 short
chat prompts, up to 32 tokens each; along the exact format's answers (teacher-forced,
through the decode path) each format's share of positions with the same top-1 token and
its mean KL divergence from exact's distribution, then how many of its own greedy answers
equal exact's; each ``--gguf`` file adds llama.cpp's ``llama-server`` on it, greedy.

``--llama-bench`` puts llama.cpp's own decode figure beside ours: ``llama-bench -t THREADS
-p 0 -n 128`` (tg128: 128 tokens generated one by one after an empty prompt) for each
``--gguf`` file (default: the Q4_0 and Q4_1 files of ``bench/build_llamacpp.sh --models``),
as ms per token, and our batch-1 decode step at a 1-token context (the same work: every
weight read once, almost no KV) for each of ``--formats``, with the ratios.
llama.cpp's programs and files are those of ``$LLAMACPP_DIR`` (default
``~/.cache/chatserve/llama.cpp``; ``bench/llamacpp_paths.py``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.llamacpp_paths import LLAMA_BENCH, PEER_Q4_0, PEER_Q4_1  # noqa: E402
from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.loader import load_model, model_weight_bytes  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

# what a new chat samples with (gateway/config.py Defaults), for --ops --sampling chat
CHAT_SAMPLING = {"temperature": 0.7, "top_p": 0.95, "frequency_penalty": 0.4}

FORMATS: dict[str, dict[str, Any]] = {
    "int4-torch": {"dtype": "float32", "quantization": "int4", "cpu_kernels": False},
    "default": {},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
    "int4-sym": {"dtype": "float32", "quantization": "int4-sym"},
    "exact": {"dtype": "float32", "quantization": "none"},
    "int8+bf16": {"dtype": "bfloat16", "quantization": "int8"},
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
}


def read_bandwidth_gbs(threads: int, mib: int = 512) -> float:
    """Read bandwidth of this machine in GB/s: median of 5 sums of a ``mib`` MiB float32
    tensor (random, so every page is real memory) on ``threads`` threads."""
    torch.set_num_threads(threads)
    x = torch.randn(mib * 2**20 // 4)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times[1:]) / 1e9


def batch1_read_bytes(model: torch.nn.Module) -> int:
    """Weight bytes a batch-1 decode step reads: every weight once, int8 weights as their
    int8 tensor and scales (a kept bfloat16 copy serves only large batches)."""
    from engine.models.quant import Int4Weight, Int8Weight

    # modules() and parameters() visit a tied (shared) weight once
    total = sum(m.read_bytes() for m in model.modules() if isinstance(m, (Int8Weight, Int4Weight)))
    return total + sum(p.numel() * p.element_size() for p in model.parameters())


def kv_read_bytes(core: EngineCore, context: int) -> int:
    """KV bytes one request's decode step reads at ``context`` tokens (K and V, all layers)."""
    kv = core.runner.kv
    k = kv.k_caches[0]
    per_token = 2 * len(kv.k_caches) * k.shape[2] * k.shape[3] * k.element_size()
    return per_token * context


def build_core(model: str | None, overrides: dict[str, Any], batches: list[int], context: int,
               steps: int) -> tuple[EngineCore, str]:
    """An engine core for one format, sized for the largest batch; returns it and its format line."""
    # one token a step: speculation would finish the requests early and change what a step
    # computes (bench/speculative.py measures it)
    overrides = {"speculative": "off", **overrides}
    cfg = EngineConfig(model=model, device="cpu", block_size=16,
                       num_blocks=max(batches) * (context + steps + 64) // 16 + 64,
                       max_num_batched_tokens=2048, max_num_seqs=max(batches), **overrides)
    engine = AsyncEngine.from_loaded(load_model(cfg), cfg, verbose=False)
    return engine.core, engine.info.format


def decode_steps(core: EngineCore, batch: int, context: int, steps: int, tag: str) -> list[float]:
    """Admit ``batch`` requests of a ``context``-token prompt, prefill them, time ``steps``
    decode steps (ms each), then abort them."""
    prompt = [100 + (i * 37) % 20000 for i in range(context)]
    for i in range(batch):
        core.add_request(f"{tag}.{i}", prompt, SamplingParams(max_tokens=steps + 8, temperature=0.0,
                                                                ignore_eos=True))
    while any(r.num_computed_tokens < context for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # prefill (the prefix cache makes all but the first cheap)
    core.step()
    times: list[float] = []
    for _ in range(steps):
        if len(core.scheduler.running) != batch:
            raise RuntimeError(f"{batch} requests should be decoding, {len(core.scheduler.running)} are")
        t0 = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - t0) * 1e3)
    for i in range(batch):
        core.abort(f"{tag}.{i}")
    return times


def time_format(model: str | None, overrides: dict[str, Any], batches: list[int], context: int,
                steps: int) -> dict[str, Any]:
    """Median decode-step ms for each batch size, and the bytes a batch-1 step reads."""
    core, fmt = build_core(model, overrides, batches, context, steps)
    m = core.runner.model
    out: dict[str, Any] = {"format": fmt, "weight_bytes": model_weight_bytes(m), "read_bytes": batch1_read_bytes(m),
                           "kv_bytes": kv_read_bytes(core, context), "step_ms": {}}
    for b in batches:
        out["step_ms"][b] = statistics.median(decode_steps(core, b, context, steps, f"b{b}"))
    return out


def format_table(results: dict[str, Any], batches: list[int], bandwidth: float) -> str:
    """Markdown: ms per step per batch size and format, ratios to ``exact``, and the floor."""
    names = list(results)
    head = "| batch | " + " | ".join(f"{n} ms/step" for n in names) + " |" + "".join(
        f" {n} vs exact |" for n in names if n != "exact" and "exact" in results)
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for b in batches:
        cells = [f"{results[n]['step_ms'][b]:.1f}" for n in names]
        ratios = [f"{results['exact']['step_ms'][b] / results[n]['step_ms'][b]:.2f}x"
                  for n in names if n != "exact" and "exact" in results]
        rows.append(f"| {b} | " + " | ".join(cells) + " |" + "".join(f" {r} |" for r in ratios))
    pad = " |" * (head.count("|") - 1 - len(names) - 1)

    def row(label: str, values: list[str]) -> None:
        rows.append(f"| {label} | " + " | ".join(values) + " |" + pad)

    row("weight MiB held", [f"{results[n]['weight_bytes'] / 2**20:.0f}" for n in names])
    row("MiB read by a batch-1 step (weights + KV)",
        [f"{(results[n]['read_bytes'] + results[n]['kv_bytes']) / 2**20:.0f}" for n in names])
    floors = {n: (results[n]["read_bytes"] + results[n]["kv_bytes"]) / (bandwidth * 1e9) * 1e3 for n in names}
    row(f"batch-1 floor at {bandwidth:.1f} GB/s (ms)", [f"{floors[n]:.1f}" for n in names])
    b1 = batches[0]
    row(f"batch-{b1} step / floor", [f"{results[n]['step_ms'][b1] / floors[n]:.2f}x" for n in names])
    return "\n".join(rows)


def attention_table(contexts: list[int], batches: list[int], threads: int) -> str:
    """Markdown: microseconds per layer's attention call, CPU kernels vs gather + SDPA."""
    from engine.attention.cpu_backend import CpuAttentionBackend
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.cpu.ops import cpu_kernels
    from engine.forward_batch import ForwardBatch

    kernels = cpu_kernels()
    if kernels is None:
        return "CPU kernels unavailable"
    torch.set_num_threads(threads)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    rows = ["| batch | context | ours bf16 KV (us) | ours f32 KV (us) | gather + SDPA f32 (us) | SDPA / ours bf16 |",
            "|---|---|---|---|---|---|"]
    for b in batches:
        for ctx in contexts:
            nblk = -(-(ctx + 1) // bs)
            tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(b)]
            batch = ForwardBatch.build(token_chunks=[[1]] * b, prefix_lens=[ctx] * b, block_tables=tables,
                                       sample_mask=[True] * b, block_size=bs)
            q = torch.randn(b, heads, dim)
            k, v = torch.randn(b, kv_heads, dim), torch.randn(b, kv_heads, dim)
            timings = []
            for backend, dtype in ((CpuAttentionBackend(kernels), torch.bfloat16),
                                   (CpuAttentionBackend(kernels), torch.float32),
                                   (TorchAttentionBackend(), torch.float32)):
                cache = torch.randn(b * nblk, bs, kv_heads, dim).to(dtype)
                batch.attn_metadata = None
                backend.prepare(batch)
                n = max(5, min(200, 2_000_000 // (b * ctx)))
                for _ in range(3):
                    backend.forward(q, k, v, cache, cache, batch, dim ** -0.5)
                t0 = time.perf_counter()
                for _ in range(n):
                    backend.forward(q, k, v, cache, cache, batch, dim ** -0.5)
                timings.append((time.perf_counter() - t0) / n * 1e6)
            rows.append(f"| {b} | {ctx} | {timings[0]:.0f} | {timings[1]:.0f} | {timings[2]:.0f} | "
                        f"{timings[2] / timings[0]:.1f}x |")
    return "\n".join(rows)


OP_NAMES = ("norm 1", "qkv proj", "rope", "attention", "o proj", "norm 2", "gate_up proj", "silu*mul", "down proj")


def ops_table(model: str | None, overrides: dict[str, Any], batches: list[int], context: int, steps: int,
              prefill: int = 512, sampling: str = "greedy") -> str:
    """Markdown: where a step's time goes, per op of the fused decoder layer (summed over
    the layers; ``cs_op_times_enable`` in kernels.c), and the rest of ``EngineCore.step``
    (embedding, final norm, LM head, sampling, scheduling): for a decode step at each batch
    size (``context``-token prompts; mean of ``steps`` steps) and for one ``prefill``-token
    prompt's prefill step (median of 3). ``sampling``: "greedy", or "chat" (the decode
    requests sample with ``CHAT_SAMPLING``, each with its own seed, after an English
    prompt).

    Raises:
        RuntimeError: the format does not run on the fused CPU-kernel layers.
    """
    import ctypes

    from engine.cpu.fused import FusedLayers
    from engine.cpu.ops import cpu_kernels

    core, fmt = build_core(model, overrides, batches, max(context, prefill), steps)
    kernels = cpu_kernels(overrides.get("cpu_isa", "auto"))
    if kernels is None or not isinstance(core.runner.layers, FusedLayers):
        raise RuntimeError(f"{fmt}: not the fused CPU-kernel layers")
    fn = kernels.lib.cs_op_times_enable
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_int
    buf = (ctypes.c_int64 * len(OP_NAMES))()

    def timed(run: Any) -> tuple[float, list[float]]:
        fn(1, None)
        t0 = time.perf_counter()
        run()
        wall = (time.perf_counter() - t0) * 1e3
        fn(0, buf)
        return wall, [v / 1e6 for v in buf]

    cols: dict[str, tuple[float, list[float]]] = {}
    prompt = [100 + (i * 37) % 20000 for i in range(context)]
    if sampling == "chat":
        # English (QUALITY_TEXT, repeated), so the model's next-token distributions are those
        # of text, not of the token soup above (whose nuclei are thousands of tokens wide)
        text = core.tokenizer.encode(QUALITY_TEXT)
        prompt = (text * (context // len(text) + 1))[:context]
    for b in batches:
        how = dict(CHAT_SAMPLING) if sampling == "chat" else {"temperature": 0.0}
        for i in range(b):
            seed = {"seed": i} if sampling == "chat" else {}
            core.add_request(f"o{b}.{i}", prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True,
                                                                 **how, **seed))
        while core.scheduler.waiting or any(r.num_computed_tokens < context for r in core.scheduler.running):
            core.step()
        core.step()

        def run_steps() -> None:
            for _ in range(steps):
                core.step()

        wall, ops = timed(run_steps)
        cols[f"decode, batch {b}"] = (wall / steps, [o / steps for o in ops])
        for i in range(b):
            core.abort(f"o{b}.{i}")
    runs = []
    for r in range(3):
        rng = [(7919 * (i + 1) + 131 * r) % 40000 + 100 for i in range(prefill)]
        core.add_request(f"pf{r}", rng, SamplingParams(max_tokens=1, temperature=0.0))
        runs.append(timed(core.step))
        while core.has_work():
            core.step()
    cols[f"prefill of {prefill}"] = sorted(runs)[1]
    names = list(cols)
    rows = [f"{fmt}; threads {torch.get_num_threads()}; decode at a {context}-token context, {sampling} sampling; "
            f"load average {os.getloadavg()[0]:.2f}", "",
            "| op (all layers) | " + " | ".join(f"{n} (ms)" for n in names) + " |", "|---|" + "---|" * len(names)]
    for k, op in enumerate(OP_NAMES):
        rows.append(f"| {op} | " + " | ".join(f"{cols[n][1][k]:.2f} ({cols[n][1][k] / cols[n][0]:.0%})"
                                                for n in names) + " |")
    rows.append("| rest of the step (embedding, final norm, LM head, sampling, scheduling) | " + " | ".join(
        f"{cols[n][0] - sum(cols[n][1]):.2f} ({1 - sum(cols[n][1]) / cols[n][0]:.0%})" for n in names) + " |")
    rows.append("| step | " + " | ".join(f"{cols[n][0]:.2f}" for n in names) + " |")
    return "\n".join(rows)


def prefill_chunk_table(model: str | None, overrides: dict[str, Any], prefixes: list[int], chunk: int = 512,
                        repeats: int = 3) -> str:
    """Markdown: ms of one ``chunk``-token prefill step after a cached prefix of each size,
    and the cost added per 1000 cached tokens against the first row (flat or rising is
    linear growth in the prefix; only attention reads it)."""
    cfg = EngineConfig(model=model, device="cpu", block_size=16, num_blocks=(max(prefixes) + chunk) // 8 + 64,
                       max_num_batched_tokens=chunk, max_num_seqs=4, **overrides)
    engine = AsyncEngine.from_loaded(load_model(cfg), cfg, verbose=False)
    core = engine.core
    rows = ["| cached prefix (tokens) | chunk step (ms) | added per 1000 cached tokens (ms) |", "|---|---|---|"]
    base = None
    for n, prefix in enumerate(prefixes):
        times = []
        for r in range(repeats):
            rng = [(7919 * (i + 1) * (n + 1) + 13 * r) % 40000 + 100 for i in range(prefix + chunk + 16)]
            if prefix:  # put the prefix in the radix tree first
                core.add_request(f"warm{n}.{r}", rng[:prefix + 1], SamplingParams(max_tokens=1, temperature=0.0))
                while core.has_work():
                    core.step()
            core.add_request(f"c{n}.{r}", rng[:prefix + chunk + 1], SamplingParams(max_tokens=1, temperature=0.0))
            t0 = time.perf_counter()
            core.step()  # the cached prefix is matched: this step computes the next `chunk` tokens
            times.append((time.perf_counter() - t0) * 1e3)
            while core.has_work():
                core.step()
        ms = statistics.median(times)
        base = (prefix, ms) if base is None else base
        per_k = (ms - base[1]) / ((prefix - base[0]) / 1000) if prefix > base[0] else float("nan")
        rows.append(f"| {prefix} | {ms:.0f} | {per_k:.1f} |")
    return "\n".join(rows)


def profile_table(model: str | None, overrides: dict[str, Any], batch: int, context: int) -> str:
    """cProfile of 50 decode steps: the functions that hold the most time (own time)."""
    core, fmt = build_core(model, overrides, [batch], context, 60)
    prompt = [100 + (i * 37) % 20000 for i in range(context)]
    for i in range(batch):
        core.add_request(f"p{i}", prompt, SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True))
    while core.scheduler.waiting or any(r.num_computed_tokens < context for r in core.scheduler.running):
        core.step()
    core.step()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(50):
        core.step()
    prof.disable()
    wall = (time.perf_counter() - t0) / 50 * 1e3
    stats = pstats.Stats(prof, stream=io.StringIO())
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    rows = [f"{fmt}, batch {batch}, context {context}: {wall:.1f} ms a step under the profiler",
            "", "| function | calls per step | own ms per step | share |", "|---|---|---|---|"]
    total = sum(v[2] for _, v in entries)
    for (path, line, name), (_cc, calls, own, _cum, _callers) in entries[:14]:
        where = f"{Path(path).name}:{line}({name})" if path != "~" else name
        rows.append(f"| `{where}` | {calls / 50:.0f} | {own / 50 * 1e3:.2f} | {own / total:.0%} |")
    return "\n".join(rows)


QUALITY_TEXT = (
    "Paris is the capital of France, and Berlin is the capital of Germany. Water boils at 100 degrees "
    "Celsius at sea level, and ice melts at zero. The Earth goes around the Sun once a year and turns on "
    "its axis once a day, which gives us night and day. Plants take in carbon dioxide and water and, with "
    "the energy of sunlight, make sugar and release oxygen. The heart pumps blood through the body; the "
    "lungs bring oxygen into it. A triangle has three sides, a square has four, and the angles of a "
    "triangle add up to 180 degrees. In 1969 two astronauts walked on the Moon while a third circled above "
    "them. To bake bread, mix flour, water, salt and yeast, let the dough rise, shape it, and bake it in a "
    "hot oven until the crust is brown. A good function does one thing, has a clear name, and says what it "
    "returns; tests check that it keeps its promise when the input is empty, large or strange.")


def text_logits(model: str | None, overrides: dict[str, Any], ids: list[int]) -> torch.Tensor:
    """One prefill of ``ids`` in a format, logits at every position: [len(ids), vocab] float64."""
    from engine.formats import resolved_config
    from engine.forward_batch import ForwardBatch
    from engine.kv_cache import KVCache
    from engine.model_runner import make_attention_backend, make_layer_runner

    cfg, _ = resolved_config(EngineConfig(model=model, device="cpu", **overrides))
    lm = load_model(cfg)
    bs, blocks = 16, -(-len(ids) // 16)
    kv = KVCache.allocate(lm.model_config, blocks, bs, cfg.kv_torch_dtype, "cpu")
    attn = make_attention_backend(cfg.attention_backend, torch.device("cpu"), lm.cpu_kernels)
    b = ForwardBatch.build(token_chunks=[ids], prefix_lens=[0], block_tables=[list(range(blocks))],
                           sample_mask=[True], block_size=bs)
    b.logits_indices = torch.arange(len(ids))
    return lm.model(b, kv, attn, make_layer_runner(lm.model, kv, attn, lm.cpu_kernels)).double()


def quality_table(model: str | None, names: list[str], ggufs: list[str] | None = None) -> str:
    """Markdown: each format's mean negative log-likelihood of QUALITY_TEXT (nats per token),
    its shift against ``exact`` and how often its top token is exact's; then one row per
    GGUF file in ``ggufs``, its weights dequantized by our loader and run exactly."""
    from transformers import AutoTokenizer

    from engine.loader import ensure_default_model

    tok = AutoTokenizer.from_pretrained(model or str(ensure_default_model()))
    ids = tok(QUALITY_TEXT)["input_ids"]
    target = torch.tensor(ids[1:])[:, None]
    logits = {n: text_logits(model, FORMATS[n], ids) for n in ["exact", *[n for n in names if n != "exact"]]}
    for path in ggufs or []:
        logits[f"{Path(path).name} (float32 compute)"] = text_logits(path, FORMATS["exact"], ids)
    nll = {n: -torch.log_softmax(x[:-1], -1).gather(1, target).mean().item() for n, x in logits.items()}
    rows = [f"{len(ids)} tokens of plain English text, one prefill per format", "",
            "| format | mean NLL (nats/token) | shift vs exact | same top token as exact |", "|---|---|---|---|"]
    for n, x in logits.items():
        same = (x.argmax(-1) == logits["exact"].argmax(-1)).double().mean().item()
        rows.append(f"| {n} | {nll[n]:.4f} | {abs(nll[n] - nll['exact']):.4f} | {same:.1%} |")
    return "\n".join(rows)


# Greedy answers on a fixed prompt set (--quality --agreement)
AGREEMENT_PROMPTS = (
    "What is the capital of France?", "What is the capital of Japan?", "Who wrote Romeo and Juliet?",
    "How many days are in a week?", "What is the largest planet in the solar system?",
    "What is 12 times 12?", "What color is the sky on a clear day?", "Name three primary colors.",
    "What is the boiling point of water in Celsius?", "Who painted the Mona Lisa?",
    "What language is spoken in Brazil?", "What is photosynthesis?", "How many legs does a spider have?",
    "What is the chemical symbol for gold?", "Who was the first person to walk on the Moon?",
    "What is the tallest mountain on Earth?", "Hello! How are you today?", "Tell me a short joke.",
    "Give me a tip for sleeping better.", "What should I cook for dinner tonight?",
    "Write a haiku about the sea.", "Can you recommend a good book?", "How do I make a cup of tea?",
    "What is a prime number?", "Explain what a computer virus is.", "Why do leaves change color in autumn?",
    "What is the speed of light?", "Translate 'good morning' into Spanish.",
    "What is the difference between weather and climate?", "Write a Python function that adds two numbers.",
)
AGREEMENT_TOKENS = 32


def greedy_tokens(model: str | None, overrides: dict[str, Any], prompts: list[list[int]], n: int,
                  forced: list[list[int]] | None = None,
                  logprobs: list[torch.Tensor] | None = None) -> list[list[int]]:
    """Each prompt's next ``n`` top-1 tokens in a format, all prompts in one batch: a
    prefill, then ``n - 1`` decode steps (the engine's decode path).

    Args:
        prompts: token ids per prompt.
        n: tokens per prompt.
        forced: None (each step feeds the format's own top token: its greedy answer), or per
            prompt ``n`` tokens fed instead (teacher forcing along another format's answer,
            so every position is scored on the same context).

    Returns:
        [len(prompts)][n] token ids: the top-1 token at each position.
    """
    from engine.formats import resolved_config
    from engine.forward_batch import ForwardBatch
    from engine.kv_cache import KVCache
    from engine.model_runner import make_attention_backend, make_layer_runner

    cfg, _ = resolved_config(EngineConfig(model=model, device="cpu", **overrides))
    lm = load_model(cfg)
    bs = 16
    per = -(-(max(len(p) for p in prompts) + n) // bs)
    kv = KVCache.allocate(lm.model_config, per * len(prompts), bs, cfg.kv_torch_dtype, "cpu")
    attn = make_attention_backend(cfg.attention_backend, torch.device("cpu"), lm.cpu_kernels)
    layers = make_layer_runner(lm.model, kv, attn, lm.cpu_kernels)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    out: list[list[int]] = [[] for _ in prompts]
    chunks, prefix = [list(p) for p in prompts], [0] * len(prompts)
    with torch.inference_mode():
        for step in range(n):
            b = ForwardBatch.build(token_chunks=chunks, prefix_lens=prefix, block_tables=tables,
                                   sample_mask=[True] * len(prompts), block_size=bs)
            logits = lm.model(b, kv, attn, layers)
            if logprobs is not None:
                logprobs.append(torch.log_softmax(logits.float(), -1))
            top = logits.argmax(-1).tolist()
            for i, t in enumerate(top):
                out[i].append(t)
            prefix = [p + len(c) for p, c in zip(prefix, chunks)]
            chunks = [[forced[i][step] if forced is not None else top[i]] for i in range(len(prompts))]
    return out


def llamacpp_greedy(gguf: str, prompts: list[list[int]], n: int, threads: int,
                    forced: list[list[int]] | None = None) -> list[list[int]]:
    """``greedy_tokens`` through llama.cpp's ``llama-server`` on ``gguf`` (one slot, prompt
    cache on, its default sampling chain reduced to greedy): each prompt's next ``n``
    top-1 tokens, free-running or, with ``forced``, one request per position with the
    prompt extended by the forced tokens so far (its decode path, as ours).

    Raises:
        RuntimeError: the server is not built or did not start.
    """
    import httpx

    from bench.serving_lib.systems import LlamaCpp, llama_server_available

    if not llama_server_available():
        raise RuntimeError("llama-server is not built: run bench/build_llamacpp.sh")
    server = LlamaCpp(label="llama.cpp", gguf=Path(gguf), threads=threads, slot_tokens=1024)
    base = server.start(1)
    body = {"n_predict": 1, "temperature": 0.0, "top_k": 1, "cache_prompt": True, "ignore_eos": True,
            "return_tokens": True, "samplers": ["top_k"]}

    def ask(ids: list[int], count: int) -> list[int]:
        r = client.post(base + "/completion", json={**body, "prompt": ids, "n_predict": count})
        r.raise_for_status()
        return list(r.json()["tokens"])

    try:
        with httpx.Client(timeout=120) as client:
            if forced is None:
                return [ask(p, n) for p in prompts]
            return [[ask(list(p) + f[:k], 1)[0] for k in range(n)] for p, f in zip(prompts, forced)]
    finally:
        server.stop()


def agreement_table(model: str | None, names: list[str], ggufs: list[str], threads: int,
                    answers: bool = False) -> str:
    """Markdown: for each format, greedy answers to AGREEMENT_PROMPTS (chat template,
    AGREEMENT_TOKENS tokens) against ``exact``'s: how often its top-1 token is exact's at
    each position of exact's answers (teacher-forced), how many answers are identical, and
    the mean length of the common start; then the same for llama.cpp's ``llama-server`` on
    each of ``ggufs`` (``llamacpp_greedy``; no KL: it returns no full distributions).
    ``answers``: also each prompt's answers."""
    from transformers import AutoTokenizer

    from engine.loader import ensure_default_model

    tok = AutoTokenizer.from_pretrained(model or str(ensure_default_model()))
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False))
               for q in AGREEMENT_PROMPTS]
    n = AGREEMENT_TOKENS
    ref_lp: list[torch.Tensor] = []
    ref = greedy_tokens(model, FORMATS["exact"], prompts, n, logprobs=ref_lp)
    # An answer ends at its end-of-turn token: the positions after it are no reply anyone reads.
    ends = [r.index(tok.eos_token_id) + 1 if tok.eos_token_id in r else n for r in ref]
    total = sum(ends)
    live = torch.tensor([[k < e for e in ends] for k in range(n)])  # [n, prompts]: positions scored
    rows = [f"{len(prompts)} chat prompts, greedy answers of at most {n} tokens ({total} positions)", "",
            "| format | same top-1 as exact along its answers | mean KL(exact ‖ format) (nats) "
            "| identical answers | mean common start (tokens) |",
            "|---|---|---|---|---|"]
    texts = {"exact": ref}

    def row(name: str, forced: list[list[int]], own: list[list[int]], kl: float | None) -> str:
        texts[name] = own
        same = sum(a == b for f, r, e in zip(forced, ref, ends) for a, b in zip(f[:e], r[:e])) / total
        equal = sum(o[:e] == r[:e] for o, r, e in zip(own, ref, ends))
        start = statistics.mean(next((k for k in range(e) if o[k] != r[k]), e) for o, r, e in zip(own, ref, ends))
        return (f"| {name} | {same:.1%} | {'n/a' if kl is None else f'{kl:.4f}'} | {equal}/{len(ref)} "
                f"| {start:.1f} |")

    for name in [x for x in names if x != "exact"]:
        lp: list[torch.Tensor] = []
        forced = greedy_tokens(model, FORMATS[name], prompts, n, forced=ref, logprobs=lp)
        kl = sum(float(((r.exp() * (r - q)).sum(-1) * m).sum()) for r, q, m in zip(ref_lp, lp, live)) / total
        rows.append(row(name, forced, greedy_tokens(model, FORMATS[name], prompts, n), kl))
    for g in ggufs:
        forced = llamacpp_greedy(g, prompts, n, threads, forced=ref)
        rows.append(row(f"llama.cpp {Path(g).name}", forced, llamacpp_greedy(g, prompts, n, threads), None))
    if answers:
        for i, q in enumerate(AGREEMENT_PROMPTS):
            rows.append(f"\n{q}")
            for name, t in texts.items():
                rows.append(f"  {name:>9}: {tok.decode(t[i])!r}")
    return "\n".join(rows)


PEER_GGUFS = [PEER_Q4_0, PEER_Q4_1]


def llama_bench_ms(gguf: str, threads: int, reps: int = 3) -> dict[str, float]:
    """llama-bench's tg128 on ``gguf``: {"ms": ms per generated token, "tok_s": tokens/s}.

    Raises:
        RuntimeError: llama-bench is not built or failed.
    """
    import subprocess

    if not LLAMA_BENCH.is_file():
        raise RuntimeError(f"no {LLAMA_BENCH}: run bench/build_llamacpp.sh")
    proc = subprocess.run([str(LLAMA_BENCH), "-m", gguf, "-t", str(threads), "-p", "0", "-n", "128", "-r", str(reps),
                           "-o", "json"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {proc.stderr[-1000:]}")
    row = json.loads(proc.stdout)[0]
    return {"ms": 1000 / row["avg_ts"], "tok_s": row["avg_ts"]}


def llama_bench_table(model: str | None, names: list[str], ggufs: list[str], threads: int, steps: int) -> str:
    """Markdown: our batch-1 decode step (1-token context) per format and llama-bench's
    tg128 ms per token per GGUF, with ours / theirs."""
    bandwidth = read_bandwidth_gbs(threads)
    ours = {n: time_format(model, FORMATS[n], [1], 1, steps) for n in names}
    peers = {Path(g).name: llama_bench_ms(g, threads) for g in ggufs}
    rows = [f"threads {threads}; read bandwidth {bandwidth:.1f} GB/s; load average {os.getloadavg()[0]:.2f}",
            "", "| system | ms per token (batch 1) | floor (ms) | / floor |"
            + "".join(f" ours / {p} |" for p in peers), "|---|---|---|---|" + "---|" * len(peers)]
    for n, r in ours.items():
        ms = r["step_ms"][1]
        floor = (r["read_bytes"] + r["kv_bytes"]) / (bandwidth * 1e9) * 1e3
        rows.append(f"| ours {n} ({r['format']}) | {ms:.2f} | {floor:.2f} | {ms / floor:.2f}x |"
                    + "".join(f" {ms / p['ms']:.2f}x |" for p in peers.values()))
    for p, r in peers.items():
        size = Path([g for g in ggufs if Path(g).name == p][0]).stat().st_size
        floor = size / (bandwidth * 1e9) * 1e3  # the file's bytes: its weights, each read once a token
        rows.append(f"| llama.cpp {p} (llama-bench tg128) | {r['ms']:.2f} | {floor:.2f} | {r['ms'] / floor:.2f}x |"
                    + " |" * len(peers))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--context", type=int, default=300, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default="default,exact,int8+bf16", help=f"any of {', '.join(FORMATS)}")
    p.add_argument("--model", default=None)
    p.add_argument("--attention", action="store_true", help="time decode attention alone over --contexts")
    p.add_argument("--contexts", default="64,256,1024,2048,4096,8192")
    p.add_argument("--profile", action="store_true", help="cProfile table of 50 decode steps")
    p.add_argument("--ops", action="store_true",
                   help="per-op times of the fused CPU layers: decode at --batches, and a 512-token prefill")
    p.add_argument("--sampling", choices=["greedy", "chat"], default="greedy",
                   help="with --ops: how the decode requests sample (chat: temperature 0.7, top_p 0.95, "
                        "frequency_penalty 0.4)")
    p.add_argument("--prefill-chunk", action="store_true",
                   help="time a 512-token prefill chunk after cached prefixes of --prefixes tokens")
    p.add_argument("--prefixes", default="0,1024,2048,4096,6000")
    p.add_argument("--quality", action="store_true",
                   help="each format's log-likelihood of a text against the exact format's")
    p.add_argument("--agreement", action="store_true",
                   help="with --quality: greedy answers to a fixed chat prompt set against exact's")
    p.add_argument("--answers", action="store_true", help="with --agreement: print every answer")
    p.add_argument("--gguf", default=None,
                   help="comma-separated GGUF files for --quality and --llama-bench (default for --llama-bench: the "
                        "Q4_0 and Q4_1 files of bench/build_llamacpp.sh --models)")
    p.add_argument("--llama-bench", action="store_true",
                   help="our batch-1 decode step against llama-bench tg128 on the --gguf files")
    p.add_argument("--cpu-isa", default=os.environ.get("CHATSERVE_CPU_ISA", "auto"),
                   help="instruction set of our CPU kernels (auto, avx512, avxvnni, avx2, portable)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.cpu_isa != "auto":
        for overrides in FORMATS.values():
            overrides["cpu_isa"] = a.cpu_isa
    ggufs = [g for g in (a.gguf or "").split(",") if g]
    torch.set_num_threads(a.threads)
    batches = [int(x) for x in a.batches.split(",") if x]
    if a.attention:
        print(f"threads {a.threads}; one layer's decode attention, median-free mean of repeated calls")
        print(attention_table([int(x) for x in a.contexts.split(",")], batches, a.threads))
        return 0
    names = [n for n in a.formats.split(",") if n]
    if a.prefill_chunk:
        print(f"threads {a.threads}; {names[0]} format; median of 3 chunks per prefix")
        print(prefill_chunk_table(a.model, FORMATS[names[0]], [int(x) for x in a.prefixes.split(",")]))
        return 0
    if a.quality and a.agreement:
        print(agreement_table(a.model, names, ggufs, a.threads, a.answers))
        return 0
    if a.quality:
        print(quality_table(a.model, names, ggufs))
        return 0
    if a.llama_bench:
        peers = ggufs or [str(g) for g in PEER_GGUFS if g.is_file()]
        print(llama_bench_table(a.model, names, peers, a.threads, a.steps))
        return 0
    if a.ops:
        print(ops_table(a.model, FORMATS[names[0]], batches, a.context, a.steps, sampling=a.sampling))
        return 0
    if a.profile:
        print(profile_table(a.model, FORMATS[names[0]], batches[0], a.context))
        return 0
    bandwidth = read_bandwidth_gbs(a.threads)
    results = {}
    for name in names:
        results[name] = time_format(a.model, FORMATS[name], batches, a.context, a.steps)
        print(f"[{name}: {results[name]['format']}] " + ", ".join(
            f"B={b}: {ms:.1f} ms" for b, ms in results[name]["step_ms"].items()), file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps({"read_bandwidth_gbs": bandwidth, "formats": results}))
    else:
        print(f"threads {a.threads}, context {a.context} tokens, median of {a.steps} decode steps; "
              f"read bandwidth {bandwidth:.1f} GB/s; load average {os.getloadavg()[0]:.2f}")
        for name in names:
            print(f"- {name}: {results[name]['format']}")
        print(format_table(results, batches, bandwidth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
