"""First replies: how often the default sampling makes the default model loop.

    python bench/first_replies.py [--quick] [--json] [--seeds 1] [--model PATH]

Twenty typical first questions (a short story, explain X, a list, code, a poem, ...)
go to the real engine in-process (the default model, SmolLM2-135M-Instruct, unless
``--model``), each as a new chat would send it: the gateway's default system prompt,
then the question. Every candidate sampling configuration runs all of them (submitted
together, as continuous batching serves them; a fixed seed per prompt so the candidates
are compared on the same random draws). A reply *loops* when it ends at ``max_tokens``
and its tail is a repetition (``tail_repeats``). The table gives, per configuration:
loops, replies cut at max_tokens without a loop, completion tokens (mean, max) and the
wall time of the batch.

This is a quality measurement, not a timing one: times are for orientation only.
``--quick`` runs no model: it checks the loop detector on crafted text and prints the
prompts and configurations (used by tests/bench/test_first_replies.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gateway.config import Defaults  # noqa: E402

PROMPTS: tuple[str, ...] = (
    "Write a short story about a cat who learns to fly.",
    "Explain how photosynthesis works.",
    "Give me a list of 10 healthy breakfast ideas.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a poem about the sea.",
    "What is the capital of France?",
    "Explain the difference between a list and a tuple in Python.",
    "How do I make a cup of tea?",
    "Summarize the plot of Romeo and Juliet.",
    "What are the benefits of regular exercise?",
    "Tell me a joke.",
    "Explain what machine learning is to a ten-year-old.",
    "Write an email to my boss asking for a day off.",
    "List five tips for learning a new language.",
    "What causes the seasons on Earth?",
    "Write a haiku about autumn.",
    "How does a computer store numbers?",
    "Give me three ideas for a birthday party.",
    "Write a JavaScript function that reverses an array.",
    "Why is the sky blue?",
)


@dataclass(frozen=True)
class Candidate:
    """One sampling configuration: a name and the engine ``params`` it sends."""

    name: str
    params: dict[str, Any]


def candidates(defaults: Defaults) -> list[Candidate]:
    """The configurations compared: the project's earlier defaults (no penalty), a
    frequency and a repetition penalty, and a longer ``max_tokens``. The gateway's
    defaults are marked, or added when they are none of these."""
    base = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 512}
    cands = [
        Candidate("no penalty (the old defaults)", dict(base)),
        Candidate("frequency_penalty 0.3", {**base, "frequency_penalty": 0.3}),
        Candidate("frequency_penalty 0.4", {**base, "frequency_penalty": 0.4}),
        Candidate("frequency_penalty 0.5", {**base, "frequency_penalty": 0.5}),
        Candidate("repetition_penalty 1.1", {**base, "repetition_penalty": 1.1}),
        Candidate("frequency_penalty 0.3, max_tokens 1024", {**base, "frequency_penalty": 0.3, "max_tokens": 1024}),
    ]
    now = defaults.sampling()
    for i, c in enumerate(cands):
        if c.params == now:
            cands[i] = Candidate(c.name + " = gateway defaults", c.params)
            return cands
    return cands + [Candidate("gateway defaults", now)]


def tail_repeats(text: str, tail_chars: int = 300, window: int = 20, min_share: float = 0.5) -> bool:
    """True when the end of ``text`` is a repetition loop.

    Over the last ``tail_chars`` characters (whitespace runs collapsed), count the
    positions whose following ``window`` characters already occurred earlier in the
    text; a loop is when they are at least ``min_share`` of the positions. A sentence,
    line or phrase written over and over (with or without spaces, so code, formulas and
    lists too) makes almost every window a repeat; ordinary prose, lists and code
    repeat a few short phrases at most. Texts shorter than ``4 * window`` characters
    never count as loops.

    Args:
        text: the reply.
        tail_chars, window: sizes in characters.
        min_share: in (0, 1].
    """
    flat = " ".join(text.split())
    start = max(0, len(flat) - tail_chars)
    n = len(flat) - window + 1 - start
    if len(flat) - start < 4 * window or n <= 0:
        return False
    repeats = 0
    for i in range(start, start + n):
        # an earlier occurrence may overlap this one (a period shorter than the window)
        if flat.find(flat[i:i + window], 0, i + window - 1) != -1:
            repeats += 1
    return repeats / n >= min_share


@dataclass
class Reply:
    """One reply of the bench: its text, token count (tokens), finish reason and time (s)."""

    prompt: str
    text: str
    completion_tokens: int
    finish_reason: str
    seconds: float

    @property
    def loops(self) -> bool:
        """Cut at max_tokens with a repeating tail."""
        return self.finish_reason == "length" and tail_repeats(self.text)


@dataclass
class Result:
    """A configuration's replies and the wall time of their batch (s)."""

    candidate: Candidate
    replies: list[Reply] = field(default_factory=list)
    wall_s: float = 0.0

    def row(self) -> dict[str, Any]:
        """The table row: counts, tokens (mean, max) and times (s)."""
        toks = [r.completion_tokens for r in self.replies]
        return {"config": self.candidate.name, "params": self.candidate.params, "replies": len(self.replies),
                "loops": sum(r.loops for r in self.replies),
                "cut_without_loop": sum(r.finish_reason == "length" and not r.loops for r in self.replies),
                "mean_tokens": statistics.mean(toks) if toks else 0.0, "max_tokens_seen": max(toks, default=0),
                "mean_reply_s": statistics.mean(r.seconds for r in self.replies) if self.replies else 0.0,
                "wall_s": self.wall_s,
                "looping_prompts": [r.prompt for r in self.replies if r.loops]}


async def run_candidate(engine: Any, cand: Candidate, system_prompt: str, seeds: int) -> Result:
    """Send every prompt (``seeds`` times, seeds 0..seeds-1 offset by the prompt's index)
    at once with ``cand``'s params; collect the replies."""
    from engine.outputs import GenerateRequest
    from engine.sampling_params import SamplingParams

    async def one(i: int, prompt: str, seed: int) -> Reply:
        params = SamplingParams.from_dict({**cand.params, "seed": 1000 * seed + i})
        msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
        msgs.append({"role": "user", "content": prompt})
        req = GenerateRequest(request_id=f"{cand.name}-{seed}-{i}", messages=msgs, params=params,
                              clamp_max_tokens=True)
        t0 = time.perf_counter()
        final = None
        async for out in engine.generate(req):
            if out.finished:
                final = out
        assert final is not None
        return Reply(prompt, final.output_text or "", len(final.output_token_ids or []),
                     final.finish_reason or "", time.perf_counter() - t0)

    t0 = time.perf_counter()
    replies = await asyncio.gather(*(one(i, p, s) for s in range(seeds) for i, p in enumerate(PROMPTS)))
    return Result(cand, list(replies), time.perf_counter() - t0)


async def run_all(engine: Any, cands: list[Candidate], system_prompt: str, seeds: int) -> list[Result]:
    """Run the candidates one after another (one event loop for the engine's streams)."""
    return [await run_candidate(engine, c, system_prompt, seeds) for c in cands]


def save_results(path: Path, results: list[Result]) -> None:
    """Write every configuration's replies as JSON (for ``--rescore``)."""
    path.write_text(json.dumps([{"name": r.candidate.name, "params": r.candidate.params, "wall_s": r.wall_s,
                                 "replies": [vars(x) for x in r.replies]} for r in results], indent=1))


def load_results(path: Path) -> list[Result]:
    """Read what ``save_results`` wrote."""
    return [Result(Candidate(d["name"], d["params"]), [Reply(**x) for x in d["replies"]], d["wall_s"])
            for d in json.loads(path.read_text())]


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of the rows."""
    out = ["| configuration | replies | loops | cut at max_tokens, no loop | tokens mean / max | "
           "reply s (mean) | batch wall s |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['config']} | {r['replies']} | {r['loops']} | {r['cut_without_loop']} | "
                   f"{r['mean_tokens']:.0f} / {r['max_tokens_seen']} | {r['mean_reply_s']:.1f} | {r['wall_s']:.1f} |")
    return "\n".join(out)


def self_check() -> None:
    """The loop detector on crafted text (the ``--quick`` run).

    Raises:
        AssertionError: the detector misjudges one of the examples.
    """
    story = ("Once upon a time, a small cat named Milo lived in a lighthouse by the sea. Every evening "
             "he watched the gulls circle the lamp and wondered what the world looked like from above. "
             "One stormy night a gull fell onto the balcony with a hurt wing, and Milo kept it warm "
             "until morning. In return the gull taught him to ride the wind on the lighthouse kite, "
             "and from then on the keeper often found the two of them drifting over the harbour at dusk.")
    looped = story[:200] + " And then the cat was happy." * 40
    code_loop = "def f(x):\n" + "    return x + 1\n" * 50
    listing = "\n".join(f"{i}. {idea}" for i, idea in enumerate(
        ["Oatmeal with berries", "Greek yogurt and honey", "Eggs on wholegrain toast", "A banana smoothie",
         "Avocado toast with tomato", "Chia pudding", "Cottage cheese and pineapple", "Muesli with milk",
         "A veggie omelette", "Peanut butter on rye"], 1))
    fly = story + ' She said, "I have to fly. I have to fly. I\'ve got to fly.' + " I've got to fly." * 14
    formula = "Photosynthesis: 6 CO2 + 6 H2O -> C6H12O6 + 6 O2, and then " + "3607NADPH + " * 30
    assert tail_repeats(fly), "a short sentence repeated over the tail is a loop"
    assert tail_repeats(formula), "a repeated term is a loop"
    assert not tail_repeats(story), "ordinary prose is not a loop"
    assert not tail_repeats(listing), "a list of different items is not a loop"
    assert tail_repeats(looped), "a sentence repeated over the tail is a loop"
    assert tail_repeats(code_loop), "a repeated code line is a loop"
    assert not tail_repeats("ok ok ok"), "too short to judge"
    assert Reply("p", looped, 512, "length", 1.0).loops
    assert not Reply("p", looped, 40, "stop", 1.0).loops, "a reply that ended by itself is not counted"


def main(argv: list[str] | None = None) -> int:
    """Run the bench; print the Markdown table (or ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="check the loop detector only; no model")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--seeds", type=int, default=1, help="runs of each prompt per configuration")
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: the bundled SmolLM2)")
    ap.add_argument("--show", action="store_true", help="print the tails of the replies cut at max_tokens")
    ap.add_argument("--only", default=None, help="run only the configurations whose name contains this text")
    ap.add_argument("--save", default=None, help="write every reply (text, tokens, finish reason) to this JSON file")
    ap.add_argument("--rescore", default=None,
                    help="no model: judge the replies saved by --save again (e.g. after changing the detector)")
    a = ap.parse_args(argv)
    defaults = Defaults()
    if a.quick:
        self_check()
        print(f"loop detector ok; {len(PROMPTS)} prompts; configurations:")
        for c in candidates(defaults):
            print(f"  {c.name}: {json.dumps(c.params)}")
        return 0

    if a.rescore:
        results = load_results(Path(a.rescore))
    else:
        from engine.async_engine import AsyncEngine
        from engine.config import EngineConfig

        engine = AsyncEngine.from_config(EngineConfig(model=a.model), verbose=False)
        engine.start()
        try:
            cands = [c for c in candidates(defaults) if a.only is None or a.only in c.name]
            results = asyncio.run(run_all(engine, cands, defaults.system_prompt, a.seeds))
        finally:
            engine.shutdown()
    if a.save:
        save_results(Path(a.save), results)
    rows = [r.row() for r in results]
    if a.json:
        print(json.dumps({"prompts": len(PROMPTS), "seeds": a.seeds, "rows": rows}, indent=1))
    else:
        print(table(rows))
        for r in rows:
            if r["looping_prompts"]:
                print(f"\n{r['config']}: loops on {r['looping_prompts']}")
    if a.show:
        for res in results:
            for rep in res.replies:
                if rep.finish_reason == "length":
                    what = "LOOP" if rep.loops else "cut, no loop"
                    print(f"\n--- {what}: {res.candidate.name} / {rep.prompt}\n...{rep.text[-300:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
