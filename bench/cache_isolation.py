"""Cross-user cache isolation, timed: does another user's private prompt come back faster?

    python bench/cache_isolation.py [--reps 5] [--model PATH] [--json]

Starts ``python -m gateway`` with its own local engine (the bundled SmolLM2-135M-Instruct
unless ``--model``) on the Redis at ``REDIS_URL`` (a fresh key prefix), and three users
(cookies). Each repetition makes a private prompt P (a system prompt of about 250 tokens
that opens with a "salary" figure, one nobody declared shared, then a question) and,
through ``POST /v1/chat/completions`` with streaming (one token, greedy):

1. user A sends P (it is now in A's part of the prefix cache);
2. a new user B sends the very same P: the probe of the attack (with isolation: no hit);
3. a new user C sends a fresh prompt F of the same shape and length (nothing to hit);
4. user A sends P again: its own repeat (the cache hit isolation keeps).

(New users each time, and prompts that differ from their first page on, so that no
step finds pages its own user cached in an earlier repetition.)

It reports each step's median time to the first token (client side: request sent to the
first content chunk) and cached tokens over the repetitions, and B's ratio to the fresh
prompt. Isolation holds when step 2 hits 0 tokens and its time is within noise of step 3,
while step 4 hits. Run it on a quiet machine (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving_lib.procs import start_child  # noqa: E402

FILLER = ("The payroll office keeps the records of every keeper of the Example Point light, with their "
          "shifts, their leave and the notes their supervisors wrote about them over the years. ")


def private_prompt(secret: int, topic: str) -> list[dict[str, str]]:
    """A private chat: a long system prompt holding ``secret``, then a question."""
    system = f"Salary {secret}: that is what Ada earns, and you are her personal assistant. " + FILLER * 6
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"Is that salary fair for a {topic}? Answer in one word."}]


def timed(client: httpx.Client, cookie: str, messages: list[dict[str, str]]) -> tuple[float, int, int]:
    """One streamed request of the user ``cookie``: (seconds to the first content chunk,
    cached tokens, prompt tokens)."""
    body = {"messages": messages, "stream": True, "max_tokens": 1, "temperature": 0,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"Cookie": f"chat_uid={cookie}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and "content" in chunk["choices"][0]["delta"] \
                    and chunk["choices"][0]["delta"].get("role") is None:
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert first is not None and usage, "no content or usage came back"
    return first, int(usage["prompt_tokens_details"]["cached_tokens"]), int(usage["prompt_tokens"])


def main(argv: list[str] | None = None) -> int:
    """Run the measurement; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--model", default=None, help="model folder for the local engine (default: bundled SmolLM2)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    data_dir = tempfile.TemporaryDirectory(prefix="chatserve-iso-")
    env = {"HF_HUB_OFFLINE": "1", "KEY_PREFIX": f"bench-iso-{uuid.uuid4().hex[:8]}:", "DATA_DIR": data_dir.name}
    cmd = [sys.executable, "-m", "gateway", "--port", "0", "--log-level", "warning"]
    if a.model:
        cmd += ["--model", a.model]
    gw = start_child(cmd, r"Chat is ready at (http://\S+)", timeout_s=600, env=env, cwd=str(ROOT))
    steps = ("A sends P", "B sends A's P", "C sends a fresh F", "A sends P again")
    rows: dict[str, list[tuple[float, int, int]]] = {s: [] for s in steps}
    try:
        base = gw.match.group(1)
        with httpx.Client(base_url=base, timeout=300) as client:
            def new_user() -> str:
                return str(httpx.get(f"{base}/api/config", timeout=60).cookies["chat_uid"])

            a_user = new_user()
            timed(client, a_user, private_prompt(1, "warm-up"))  # first request: kernels, allocations
            for i in range(a.reps):
                secret = [734215, 512907, 98314, 260775, 843126][i % 5] + 1_000_000 * (i // 5)
                topic = ["lighthouse keeper", "harbour pilot", "ferry captain", "lock keeper", "coast guard"][i % 5]
                mine, fresh = private_prompt(secret, topic), private_prompt(secret + 100_003, topic)
                rows[steps[0]].append(timed(client, a_user, mine))
                rows[steps[1]].append(timed(client, new_user(), mine))
                rows[steps[2]].append(timed(client, new_user(), fresh))
                rows[steps[3]].append(timed(client, a_user, mine))
    finally:
        gw.stop()
        data_dir.cleanup()
    load = os.getloadavg()
    out = {"reps": a.reps, "load_avg": [round(x, 2) for x in load], "steps": {
        s: {"ttft_ms_median": round(1000 * statistics.median(r[0] for r in v), 1),
            "ttft_ms_all": [round(1000 * r[0], 1) for r in v],
            "cached_tokens": sorted({r[1] for r in v}), "prompt_tokens": sorted({r[2] for r in v})}
        for s, v in rows.items()}}
    b, f = out["steps"][steps[1]]["ttft_ms_median"], out["steps"][steps[2]]["ttft_ms_median"]
    out["b_over_fresh"] = round(b / f, 3) if f else None  # B's copy over C's fresh prompt
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print("| step | TTFT median (ms) | all (ms) | cached tokens | prompt tokens |\n|---|---|---|---|---|")
        for s, v in out["steps"].items():
            print(f"| {s} | {v['ttft_ms_median']} | {v['ttft_ms_all']} | {v['cached_tokens']} | {v['prompt_tokens']} |")
        print(f"\nB on A's prompt / C on a fresh prompt: {out['b_over_fresh']}x; load average {out['load_avg']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
