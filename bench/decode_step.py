"""Decode step time by weight format: float32, bfloat16, and int8 weights with
bfloat16 activations, at several batch sizes, through ``EngineCore.step``.

    python bench/decode_step.py [--batches 1,4,8,12,16,32] [--context 300] [--steps 20]
                                [--threads 2] [--model PATH] [--step-thread main|other] [--json]

Each format loads the model (default: the bundled SmolLM2-135M-Instruct), admits B
requests with the same ``--context``-token prompt, prefills them, then times
``--steps`` pure decode steps (median ms per step; one step = schedule, forward over the
B rows, sample, detokenize). Also prints each format's weight bytes held and read per
batch-1 step, and the bandwidth a batch-1 step implies (bytes read / step time; the
KV read is small beside it at this context). The float32 column is the peer: ratios are against it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.loader import load_model, model_weight_bytes  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

FORMATS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None), "int8+bf16": ("bfloat16", "int8")}


def batch1_read_bytes(model: torch.nn.Module) -> int:
    """Weight bytes a batch-1 decode step reads: every weight once, int8 weights as their
    int8 tensor and scales (their bfloat16 copy serves only batches above 8 rows)."""
    from engine.models.quant import Int8Weight

    # modules() and parameters() visit a tied (shared) weight once
    total = sum(m.read_bytes() for m in model.modules() if isinstance(m, Int8Weight))
    return total + sum(p.numel() * p.element_size() for p in model.parameters())


def time_format(model: str | None, dtype: str, quantization: str | None, batches: list[int], context: int,
                steps: int, step_thread: str = "main") -> dict:
    """Median decode-step ms for each batch size, and the weight bytes, of one format.
    ``step_thread`` "other": the steps run on a second thread while the main one waits
    (as ``AsyncEngine.start()`` runs them), instead of on the main thread."""
    cfg = EngineConfig(model=model, device="cpu", dtype=dtype, quantization=quantization, block_size=16,
                       num_blocks=max(batches) * (context + steps + 64) // 16 + 64,
                       max_num_batched_tokens=2048, max_num_seqs=max(batches))
    engine = AsyncEngine.from_loaded(load_model(cfg), cfg, verbose=False)
    core = engine.core
    prompt = [100 + (i * 37) % 20000 for i in range(context)]
    weights = core.runner.model
    out = {"weight_bytes": model_weight_bytes(weights), "read_bytes": batch1_read_bytes(weights), "step_ms": {}}
    for b in batches:
        for i in range(b):
            core.add_request(f"{b}.{i}", prompt, SamplingParams(max_tokens=steps + 8, temperature=0.0,
                                                                ignore_eos=True))
        while any(r.num_computed_tokens < context for r in core.scheduler.running) or core.scheduler.waiting:
            core.step()  # prefill (the prefix cache makes all but the first cheap)
        core.step()
        times: list[float] = []

        def timed_steps(times: list[float] = times) -> None:
            for _ in range(steps):
                t0 = time.perf_counter()
                core.step()
                times.append((time.perf_counter() - t0) * 1e3)

        if step_thread == "other":
            worker = threading.Thread(target=timed_steps)
            worker.start()
            worker.join()
        else:
            timed_steps()
        out["step_ms"][b] = statistics.median(times)
        for i in range(b):
            core.abort(f"{b}.{i}")
        core.step()
    return out


def table(results: dict, batches: list[int]) -> str:
    """Markdown: one row per batch size, ms per step and the ratio to float32."""
    names = list(results)
    head = "| batch | " + " | ".join(f"{n} ms/step" for n in names) + " | " + " | ".join(
        f"{n} vs float32" for n in names[1:]) + " |"
    rows = [head, "|" + "---|" * (1 + 2 * len(names) - 1)]
    for b in batches:
        base = results["float32"]["step_ms"][b] if "float32" in results else float("nan")
        cells = [f"{results[n]['step_ms'][b]:.1f}" for n in names]
        ratios = [f"{base / results[n]['step_ms'][b]:.2f}x" for n in names[1:]]
        rows.append(f"| {b} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    rows.append("| weight MiB held | " + " | ".join(f"{results[n]['weight_bytes'] / 2**20:.0f}" for n in names)
                + " |" + " |" * (len(names) - 1))
    rows.append("| weight MiB read per batch-1 step | " + " | ".join(
        f"{results[n]['read_bytes'] / 2**20:.0f}" for n in names) + " |" + " |" * (len(names) - 1))
    bw = [results[n]["read_bytes"] / (results[n]["step_ms"][batches[0]] / 1e3) / 1e9 for n in names]
    rows.append(f"| GB/s implied at batch {batches[0]} | " + " | ".join(f"{x:.1f}" for x in bw) + " |"
                + " |" * (len(names) - 1))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,8,12,16,32")
    p.add_argument("--context", type=int, default=300, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--model", default=None)
    p.add_argument("--step-thread", choices=["main", "other"], default="main",
                   help="run the timed steps on the main thread (as `engine serve` does) or a second one")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    batches = [int(x) for x in a.batches.split(",") if x]
    results = {}
    for name in a.formats.split(","):
        dtype, quant = FORMATS[name]
        results[name] = time_format(a.model, dtype, quant, batches, a.context, a.steps, a.step_thread)
        print(f"[{name}] " + ", ".join(f"B={b}: {ms:.1f} ms" for b, ms in results[name]["step_ms"].items()),
              file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(results))
    else:
        print(f"threads {a.threads}, context {a.context} tokens, median of {a.steps} decode steps, "
              f"stepping on the {a.step_thread} thread")
        print(table(results, batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
