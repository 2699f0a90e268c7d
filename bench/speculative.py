"""Speculative decoding by prompt lookup: the engine with and without it, side by side.

    python bench/speculative.py [--workloads edit,quote,chat,chat16] [--max-tokens 256]
                                [--draft-tokens K] [--ngram MIN,MAX] [--repeats 3] [--model PATH] [--json]

Workloads (greedy, the bundled SmolLM2-135M-Instruct unless --model):
- edit: a ~300-token Python snippet and "rename X to Y everywhere and show the whole code";
- quote: a ~300-token passage and "quote the second paragraph word for word";
- chat: six questions answered in prose (little to copy), one after another, one stream;
- chat16: 16 different chat questions at once.
Each runs on one ``EngineCore`` stepped on this (main) thread, as ``engine serve`` steps,
with ``speculative="off"`` and with n-gram speculation, in one process, alternating
``--repeats`` times (the median of each is reported). Prints output tokens/s of each,
the ratio, the fraction of drafts accepted and the output tokens per decode step of a
request; the outputs of the two runs must be identical (speculation never changes
them), which the script checks.
"""

from __future__ import annotations

import argparse
import json
import os
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

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.outputs import GenerateRequest  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

CODE = '''import csv
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def load_items(path):
    items = []
    with open(path) as f:
        for row in csv.DictReader(f):
            items.append(Item(row["name"], float(row["price"]), int(row["quantity"])))
    return items


def compute_total(items, tax_rate=0.2, discount=0.0):
    subtotal = 0.0
    for item in items:
        subtotal += item.price * item.quantity
    subtotal -= subtotal * discount
    return round(subtotal * (1 + tax_rate), 2)


def report(path):
    items = load_items(path)
    total = compute_total(items)
    cheap = [i for i in items if i.price < 10]
    print(f"{len(items)} items, {len(cheap)} under 10, total {total}")
    return compute_total(cheap, tax_rate=0.1)
'''

PASSAGE = ("The lighthouse stood on a low rock at the mouth of the bay. For a hundred years its keepers "
           "climbed the spiral stair each evening, trimmed the wick and wound the clockwork that turned the "
           "great lens, and ships that had never seen the coast found the harbour by its slow white flash.\n\n"
           "In the winter of 1911 a storm tore the lantern glass from its frame. The keeper, a young man named "
           "Thomas Hale, held a storm lamp in the empty window for three nights while the wind screamed around "
           "the tower, and not one ship was lost on the rocks below.\n\n"
           "Today the light is automatic and the keepers' cottage is a small museum. Visitors can climb the "
           "same stair, stand beside the lens, and read the log in which Thomas Hale wrote, in a steady hand, "
           "that the night had been long but the light had never gone out.")

CHAT_QUESTIONS = [
    "Explain in a few sentences why the sky is blue.", "What are three tips for sleeping better?",
    "How does a refrigerator keep food cold?", "Write a short poem about autumn leaves.",
    "What is the difference between weather and climate?", "Give me a simple recipe for pancakes.",
    "Why do cats purr?", "How do airplanes stay in the air?", "What is photosynthesis?",
    "Suggest a name for a friendly robot and explain it.", "How can I learn to play the guitar?",
    "What causes the seasons on Earth?", "Describe the water cycle simply.", "What is a black hole?",
    "How do vaccines work?", "Why is exercise good for the brain?",
]


def workload(name: str) -> list[list[dict[str, str]]]:
    """The chat messages of each request of a workload."""
    if name == "edit":
        return [[{"role": "user", "content": f"```python\n{CODE}```\n\nRename the function `compute_total` to "
                                             "`order_total` everywhere and show the whole code."}]]
    if name == "quote":
        return [[{"role": "user", "content": f"{PASSAGE}\n\nQuote the second paragraph above word for word."}]]
    if name == "chat":
        return [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[:6]]
    if name == "chat16":
        return [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    raise SystemExit(f"unknown workload {name!r}")


def run(engine: AsyncEngine, messages: list[list[dict[str, str]]], max_tokens: int,
        together: bool = True) -> dict[str, Any]:
    """The requests on the core, stepped here: all at once (``together``) or one after
    another; output tokens/s (after each request's first token), the outputs, the
    speculation counters' change and a request's output tokens per decode step."""
    core = engine.core
    before = core.stats()
    outputs: dict[str, list[int]] = {}
    wall = 0.0
    deltas = 0  # outputs that carried decode tokens, one per request per step
    groups = [list(enumerate(messages))] if together else [[(i, m)] for i, m in enumerate(messages)]
    for group in groups:
        for i, msgs in group:
            ids, _ = engine.prompts.build(GenerateRequest(request_id=f"r{i}", messages=msgs))
            core.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        first = None
        seen: set[str] = set()
        while core.has_work():
            for out in core.step():
                if first is None:
                    first = time.perf_counter()
                if out.request_id in seen and out.token_ids:
                    deltas += 1
                seen.add(out.request_id)
                if out.finished:
                    outputs[out.request_id] = out.output_token_ids or []
        wall += time.perf_counter() - (first or time.perf_counter())
    after = core.stats()
    tokens = sum(len(v) for v in outputs.values())
    drafted = after["spec_drafted_total"] - before["spec_drafted_total"]
    accepted = after["spec_accepted_total"] - before["spec_accepted_total"]
    return {"tok_s": (tokens - len(outputs)) / wall, "tokens": tokens, "outputs": outputs,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_step": (tokens - len(outputs)) / max(1, deltas)}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 if speculation changed an output."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--workloads", default="edit,quote,chat,chat16")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--draft-tokens", type=int, default=None, help="drafts per step (default: the engine's)")
    p.add_argument("--ngram", default=None, help="min,max n-gram sizes (default: the engine's)")
    p.add_argument("--repeats", type=int, default=3, help="alternating off/on runs per workload (median)")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    engines = {}
    loaded = None
    for mode in ("off", "ngram"):
        ngram = {}
        if a.ngram:
            lo, hi = (int(x) for x in a.ngram.split(","))
            ngram = {"spec_ngram_min": lo, "spec_ngram_max": hi}
        drafts = {"num_draft_tokens": a.draft_tokens} if a.draft_tokens else {}
        cfg = EngineConfig(model=a.model, device="cpu", speculative=mode, num_blocks=2048, max_num_seqs=32,
                           **ngram, **drafts)
        loaded = loaded or load_model(cfg)
        engines[mode] = AsyncEngine.from_loaded(loaded, cfg, verbose=False)
    results: dict[str, Any] = {}
    for name in a.workloads.split(","):
        msgs = workload(name)
        together = name != "chat"
        run(engines["off"], msgs[:1], 8)  # warm-up
        offs, ons = [], []
        for _ in range(a.repeats):
            offs.append(run(engines["off"], msgs, a.max_tokens, together))
            ons.append(run(engines["ngram"], msgs, a.max_tokens, together))
        off_tok_s = statistics.median(r["tok_s"] for r in offs)
        on_tok_s = statistics.median(r["tok_s"] for r in ons)
        on = ons[-1]
        same = all(r["outputs"] == offs[0]["outputs"] for r in offs + ons)
        results[name] = {"off_tok_s": off_tok_s, "on_tok_s": on_tok_s, "speedup": on_tok_s / off_tok_s,
                         "acceptance": on["acceptance"], "tokens_per_step": on["tokens_per_step"],
                         "tokens": on["tokens"], "identical": same}
        print(f"[{name}] {results[name]}", file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(results))
    else:
        spec = engines["ngram"].core.spec
        grams = f"n-grams {spec.min_n}-{spec.max_n}" if spec is not None else ""
        drafts_n = spec.num_draft_tokens if spec is not None else 0
        print(f"threads {a.threads}, greedy, max_tokens {a.max_tokens}, {drafts_n} draft tokens, {grams}, "
              f"median of {a.repeats}; {engines['ngram'].info.format}; load average {os.getloadavg()[0]:.2f}")
        print("| workload | output tokens | off tok/s | n-gram tok/s | speedup | drafts accepted | tokens/step "
              "| outputs identical |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in results.items():
            print(f"| {name} | {r['tokens']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | {r['speedup']:.2f}x | "
                  f"{'-' if r['acceptance'] is None else format(r['acceptance'], '.0%')} | "
                  f"{r['tokens_per_step']:.2f} | {'yes' if r['identical'] else 'NO'} |")
    return 0 if all(r["identical"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
