"""Engine throughput and multi-turn latency, ours against transformers, in one run.

    python bench/engine_throughput.py [--quick] [--json] [--dtype float32|bfloat16]
                                      [--ours-dtype auto] [--quantization auto]
    python bench/engine_throughput.py --model-config llama3-8b --random-weights --device cuda --dtype bfloat16

Workloads (all ignore EOS so every system generates the same number of tokens):
- mixed: N independent requests, prompts of 32-512 tokens, outputs of 16-256, all
  submitted at once: ours (continuous batching) against transformers' ``generate``
  in static batches (sorted by prompt length, left-padded);
- single: one stream, for decode speed against the memory-bandwidth bound;
- multiturn: 8 chats x 8 turns sharing a system prompt, the gateway's way
  (messages + exact ids of earlier turns): TTFT of turn 1 and turn 8, cache on and off,
  and the hit ratio (cached / prompt tokens over turns 2-8);
- KV memory: tokens stored against block capacity in use, sampled during mixed.
Prints a table; ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.outputs import GenerateRequest  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of xs by linear interpolation; 0.0 for an empty list."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def build_engine(a: argparse.Namespace, prefix_cache: bool = True) -> AsyncEngine:
    """Our engine in ``--ours-dtype`` / ``--quantization`` (default: the engine's "auto"
    format), or in ``--dtype`` with random weights."""
    dtype, quant = (a.dtype, "none") if a.random_weights else (a.ours_dtype, a.quantization)
    cfg = EngineConfig(model=a.model, dtype=dtype, quantization=quant, device=a.device, block_size=16,
                       num_blocks=a.num_blocks, max_num_batched_tokens=a.max_batched_tokens,
                       max_num_seqs=a.max_seqs, enable_prefix_cache=prefix_cache,
                       attention_backend=a.attention_backend, threads=a.threads)
    if a.random_weights:
        from bench.random_model import random_loaded_model

        loaded = random_loaded_model(a.model_config, cfg.torch_dtype, cfg.resolved_device())
        return AsyncEngine.from_loaded(loaded, cfg, verbose=False)
    return AsyncEngine.from_config(cfg, verbose=False)


def hf_model(a: argparse.Namespace, engine: AsyncEngine):
    from engine.config import DTYPES

    dev = engine.core.device
    if a.random_weights:
        from bench.random_model import random_hf_model

        return random_hf_model(a.model_config, DTYPES[a.dtype], dev)
    from transformers import AutoModelForCausalLM

    from engine.loader import ensure_default_model

    path = a.model or ensure_default_model()
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[a.dtype]).to(dev).eval()


def mixed_requests(n: int, rng: random.Random, vocab: int, max_prompt: int, max_out: int):
    return [([rng.randrange(100, vocab - 1) for _ in range(rng.randrange(min(32, max_prompt), max_prompt + 1))],
             rng.randrange(min(16, max_out), max_out + 1)) for _ in range(n)]


async def run_ours(engine: AsyncEngine, reqs, tag: str) -> dict:
    """All requests at once; returns throughput and latency percentiles, plus KV waste samples."""
    finals, waste = [], []

    async def one(i, ids, n):
        async for out in engine.generate(GenerateRequest(f"{tag}{i}", ids, params=SamplingParams(
                max_tokens=n, temperature=0.0, ignore_eos=True))):
            if out.finished:
                finals.append(out)

    def kv_sample(core):
        reqs_ = core.scheduler.running
        if not reqs_:
            return None
        cap = sum(len(r.block_table) for r in reqs_) * core.config.block_size
        toks = sum(r.num_tokens for r in reqs_)
        return (cap - toks) / len(reqs_)

    async def sampler():
        while len(finals) < len(reqs):
            w = await engine.call(kv_sample)
            if w is not None:
                waste.append(w)
            await asyncio.sleep(0.2)

    t0 = time.perf_counter()
    samp = asyncio.create_task(sampler())
    await asyncio.gather(*(one(i, ids, n) for i, (ids, n) in enumerate(reqs)))
    wall = time.perf_counter() - t0
    samp.cancel()
    out_tokens = sum(f.usage.completion_tokens for f in finals if f.usage is not None)
    return {"output_tok_s": out_tokens / wall, "wall_s": wall, "output_tokens": out_tokens,
            "ttft_ms_p50": pct([f.timings.ttft_ms for f in finals], 0.5),
            "ttft_ms_p99": pct([f.timings.ttft_ms for f in finals], 0.99),
            "tpot_ms_p50": pct([f.timings.tpot_ms for f in finals if f.usage.completion_tokens > 1], 0.5),
            "kv_waste_tokens_per_request_max": max(waste) if waste else 0.0,
            "kv_waste_tokens_per_request_mean": statistics.fmean(waste) if waste else 0.0}


class _Clock:
    """transformers streamer that notes when the first new token of a batch appears."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_transformers(model, reqs, batch_size: int, device) -> dict:
    """Static batching: sorted by prompt length, left-padded, each batch runs to its longest output."""
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i][0]))
    t0 = time.perf_counter()
    ttfts, useful = [], 0
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        width = max(len(reqs[i][0]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):
            p = reqs[i][0]
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        n = max(reqs[i][1] for i in idx)
        clock = _Clock()
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0, streamer=clock)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ttfts += [((clock.first or time.perf_counter()) - t0) * 1000] * len(idx)
        useful += sum(reqs[i][1] for i in idx)
    wall = time.perf_counter() - t0
    return {"output_tok_s": useful / wall, "wall_s": wall, "output_tokens": useful,
            "ttft_ms_p50": pct(ttfts, 0.5), "batch_size": batch_size}


async def run_single(engine: AsyncEngine, vocab: int, n: int) -> dict:
    rng = random.Random(11)
    ids = [rng.randrange(100, vocab - 1) for _ in range(32)]
    final = None
    async for out in engine.generate(GenerateRequest("single", ids, params=SamplingParams(
            max_tokens=n, temperature=0.0, ignore_eos=True))):
        final = out
    from bench.decode_step import batch1_read_bytes

    weights = batch1_read_bytes(engine.core.runner.model)  # int8 weights as their bytes, each tensor once
    return {"tpot_ms": final.timings.tpot_ms, "tok_s": 1000.0 / max(final.timings.tpot_ms, 1e-9),
            "weight_bytes": weights}


async def run_multiturn(engine: AsyncEngine, chats: int, turns: int, rng: random.Random, vocab: int,
                        out_tokens: int, tag: str) -> dict:
    """Chats in parallel, turns in sequence, exact ids of earlier turns sent along (as the gateway does)."""
    words = ("lighthouse harbour signal keeper storm rocks beacon coast night ship lantern tide "
             "wave island fog horn north stone tower light").split()
    system = "You are a helpful assistant. " + " ".join(rng.choice(words) for _ in range(150))
    ttft = [[0.0] * turns for _ in range(chats)]
    prompt_tok = [[0] * turns for _ in range(chats)]
    cached_tok = [[0] * turns for _ in range(chats)]
    use_chat = engine.prompts.tokenizer.chat_template is not None

    async def chat(c: int):
        r = random.Random(c)
        msgs = [{"role": "system", "content": system}]
        hist: list[int] = []
        ids_prompt: list[int] = [r.randrange(100, vocab - 1) for _ in range(300)]
        for t in range(turns):
            user = " ".join(r.choice(words) for _ in range(r.randrange(20, 60)))
            params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
            if use_chat:
                msgs.append({"role": "user", "content": user})
                req = GenerateRequest(f"{tag}{c}.{t}", messages=list(msgs), prefix_token_ids=hist or None,
                                      params=params)
            else:
                ids_prompt = ids_prompt + [r.randrange(100, vocab - 1) for _ in range(40)]
                req = GenerateRequest(f"{tag}{c}.{t}", prompt_token_ids=list(ids_prompt), params=params)
            final = None
            async for out in engine.generate(req):
                final = out
            ttft[c][t] = final.timings.ttft_ms
            prompt_tok[c][t] = final.usage.prompt_tokens
            cached_tok[c][t] = final.usage.cached_tokens
            if use_chat:
                msgs.append({"role": "assistant", "content": final.output_text})
                hist = final.prompt_token_ids + final.output_token_ids
            else:
                ids_prompt = final.prompt_token_ids + final.output_token_ids

    await asyncio.gather(*(chat(c) for c in range(chats)))
    later = [(p, k) for c in range(chats) for t, (p, k) in enumerate(zip(prompt_tok[c], cached_tok[c])) if t > 0]
    return {"ttft_turn1_ms": statistics.median(ttft[c][0] for c in range(chats)),
            "ttft_turnN_ms": statistics.median(ttft[c][-1] for c in range(chats)),
            "prompt_tokens_turnN": statistics.median(prompt_tok[c][-1] for c in range(chats)),
            "cache_hit_ratio": sum(k for _, k in later) / max(1, sum(p for p, _ in later))}


async def main_async(a: argparse.Namespace) -> dict:
    rng = random.Random(0)
    eng = build_engine(a)  # sets torch's thread count when --threads is given
    res: dict = {"dtype": a.dtype, "ours_format": eng.info.format, "threads": torch.get_num_threads(),
                 "device": a.device,
                 "model": a.model_config if a.random_weights else (a.model or "SmolLM2-135M-Instruct")}
    eng.start()
    vocab = eng.core.model_config.vocab_size
    try:
        reqs = mixed_requests(a.mixed_requests, rng, vocab, a.max_prompt, a.max_out)
        await run_ours(eng, reqs[:2], "warm")
        res["single"] = await run_single(eng, vocab, a.single_tokens)
        ours = await run_ours(eng, reqs, "m")
        res["mixed"] = {"ours": ours, "requests": len(reqs)}
        res["kv"] = {"waste_tokens_per_request_max": ours.pop("kv_waste_tokens_per_request_max"),
                     "waste_tokens_per_request_mean": ours.pop("kv_waste_tokens_per_request_mean"),
                     "block_size": 16}
        mt = await run_multiturn(eng, a.chats, a.turns, random.Random(1), vocab, a.turn_tokens, "c")
    finally:
        eng.shutdown()
    off = build_engine(a, prefix_cache=False)
    off.start()
    try:
        mt_off = await run_multiturn(off, a.chats, a.turns, random.Random(1), vocab, a.turn_tokens, "o")
    finally:
        off.shutdown()
    res["multiturn"] = {"chats": a.chats, "turns": a.turns, "ttft_turn1_ms": mt["ttft_turn1_ms"],
                        "ttft_turn8_ms_cache": mt["ttft_turnN_ms"], "ttft_turn8_ms_nocache": mt_off["ttft_turnN_ms"],
                        "prompt_tokens_last_turn": mt["prompt_tokens_turnN"],
                        "cache_hit_ratio": mt["cache_hit_ratio"]}
    if not a.skip_transformers:
        model = hf_model(a, eng)
        res["mixed"]["transformers"] = run_transformers(model, reqs, a.hf_batch, eng.core.device)
        res["mixed"]["speedup"] = ours["output_tok_s"] / res["mixed"]["transformers"]["output_tok_s"]
    return res


def table(r: dict) -> str:
    m, mt, s = r["mixed"], r["multiturn"], r["single"]
    lines = [f"engine_throughput: {r['model']} on {r['device']}, {r['threads']} threads; ours: {r['ours_format']}; "
             f"transformers: {r['dtype']}",
             f"{'metric':44s} {'ours':>12s} {'transformers':>14s} {'ratio':>8s}"]
    hf = m.get("transformers")
    label = f"mixed: output tokens/s ({m['requests']} requests)"
    lines.append(f"{label:44s} {m['ours']['output_tok_s']:12.1f} "
                 f"{(hf['output_tok_s'] if hf else float('nan')):14.1f} {m.get('speedup', float('nan')):8.2f}")
    lines.append(f"{'mixed: TTFT p50 (ms)':44s} {m['ours']['ttft_ms_p50']:12.0f} "
                 f"{(hf['ttft_ms_p50'] if hf else float('nan')):14.0f}")
    lines.append(f"{'mixed: TPOT p50 (ms)':44s} {m['ours']['tpot_ms_p50']:12.1f}")
    lines.append(f"{'single stream: TPOT (ms) / tokens/s':44s} {s['tpot_ms']:12.1f} {s['tok_s']:14.1f}")
    lines.append(f"{'single stream: weight bytes read per token':44s} {s['weight_bytes'] / 1e6:11.0f}M")
    lines.append(f"{'multiturn: TTFT turn 1 (ms)':44s} {mt['ttft_turn1_ms']:12.0f}")
    lines.append(f"{'multiturn: TTFT turn 8, cache on / off (ms)':44s} {mt['ttft_turn8_ms_cache']:12.0f} "
                 f"{mt['ttft_turn8_ms_nocache']:14.0f} "
                 f"{mt['ttft_turn8_ms_nocache'] / max(mt['ttft_turn8_ms_cache'], 1e-9):8.2f}")
    lines.append(f"{'multiturn: cache hit ratio, turns 2-8':44s} {mt['cache_hit_ratio']:12.3f}")
    lines.append(f"{'KV waste, tokens per running request (max)':44s} {r['kv']['waste_tokens_per_request_max']:12.1f}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: bundled SmolLM2)")
    p.add_argument("--model-config", default="llama3-8b", help="shapes for --random-weights")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="transformers' dtype (and ours with --random-weights)")
    p.add_argument("--ours-dtype", default="auto", help="our activations (auto: the engine's default format)")
    p.add_argument("--quantization", default="auto", help="our weights: auto, int8 or none")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="a smaller run, under two minutes")
    p.add_argument("--smoke", action="store_true", help="a tiny run that only checks the script works (CI)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    full = dict(mixed_requests=64, max_prompt=512, max_out=256, single_tokens=128, chats=8, turns=8, turn_tokens=48)
    quick = dict(mixed_requests=16, max_prompt=256, max_out=64, single_tokens=32, chats=4, turns=8, turn_tokens=16)
    smoke = dict(mixed_requests=4, max_prompt=64, max_out=8, single_tokens=4, chats=2, turns=3, turn_tokens=4)
    for k, v in (smoke if a.smoke else quick if a.quick else full).items():
        setattr(a, k, v)
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    r = asyncio.run(main_async(a))
    print(json.dumps(r) if a.json else table(r))


if __name__ == "__main__":
    main()
