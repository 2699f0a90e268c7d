"""Prefill speed, side by side: how fast each system reads a long prompt.

    python bench/prefill.py [--systems ours,llamacpp,llamacpp-q4_1,hf] [--prompts 512,2048,6000]
                            [--repeats 2] [--no-llama-bench] [--json]

Each system (``serving_lib.systems``: ours = gateway + engine in its default format;
llama.cpp's llama-server with one 8192-token slot on its fastest CPU format, Q4_0 made
from the same weights by its own tools (``bench/build_llamacpp.sh --models``; the
package's Q4_1 file when that has not been run), and ``llamacpp-q4_1`` on the package's
Q4_1 file; transformers in bfloat16) is started alone and sent, one at a time, chat prompts of about N tokens of
fresh random words (a new text each time, so no prefix cache helps) with
``max_tokens`` 1. The time to the one token is the prefill (plus one sample and the
HTTP round trip); prefill tokens/s = the server's ``usage.prompt_tokens`` / that time,
median over ``--repeats``. Beside the servers, llama.cpp's own ``llama-bench -p N -n 0`` on each
of its files (raw prompt processing: no server, no HTTP, no tokenizing, no sampling) where it is
built and ``llamacpp`` is among the systems. Prints a table, with each system's ratio to ours.
llama.cpp's programs and files are those of ``$LLAMACPP_DIR`` (default
``~/.cache/chatserve/llama.cpp``; ``bench/llamacpp_paths.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from bench.llamacpp_paths import LLAMA_BENCH  # noqa: E402
from bench.serving_lib import systems as S  # noqa: E402
from bench.serving_lib.openai_client import stream_chat  # noqa: E402
from bench.serving_lib.workloads import TextMaker  # noqa: E402


def build(names: list[str], threads: int, model: Path | None = None) -> dict[str, S.System]:
    """The systems to measure (label -> System); llama.cpp only when its server is built.
    ``model``: an HF folder for ours (default: the bundled SmolLM2, which the peers run)."""
    out: dict[str, S.System] = {}
    for name in names:
        if name == "ours":
            out["ours"] = S.Ours("ours", model_dir=model, threads=threads, kv_cache_gib=1.0)
        elif name in ("llamacpp", "llamacpp-q4_1"):
            if not S.llama_server_available(S.LLAMA_SERVER_DEFAULT):
                print("skipping llama.cpp: run bench/build_llamacpp.sh", file=sys.stderr)
            elif name == "llamacpp" and S.PEER_Q4_0.is_file():
                out["llama.cpp Q4_0"] = S.LlamaCpp("llama.cpp Q4_0", threads=threads, slot_tokens=8192,
                                                   gguf=S.PEER_Q4_0)
            else:  # the package's Q4_1 file
                out["llama.cpp Q4_1"] = S.LlamaCpp("llama.cpp Q4_1", threads=threads, slot_tokens=8192)
        elif name == "hf":
            out["transformers"] = S.HFStatic("transformers", dtype="bfloat16", threads=threads)
        else:
            raise SystemExit(f"unknown system {name!r}")
    return out


async def measure(url: str, model: str, sizes: list[int], repeats: int, seed: int) -> dict[int, dict[str, float]]:
    """Per prompt size: median time to the single token (ms), prompt tokens, tokens/s."""
    tm = TextMaker(random.Random(seed))
    out: dict[int, dict[str, float]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        warm = {"model": model, "messages": [{"role": "user", "content": tm.text(64)}], "max_tokens": 1}
        await stream_chat(client, warm)
        for n in sizes:
            times, tokens = [], []
            for _ in range(repeats):
                body = {"model": model, "max_tokens": 1, "temperature": 0.0,
                        "messages": [{"role": "user", "content": tm.text(n)}]}
                r = await stream_chat(client, body)
                if not r.ok:
                    raise RuntimeError(f"{n}-token prompt failed: {r.error}")
                times.append(r.ttft_ms if r.chunk_ms else r.end_ms)
                tokens.append(r.prompt_tokens)
            ms, toks = statistics.median(times), statistics.median(tokens)
            out[n] = {"ms": ms, "prompt_tokens": toks, "tok_s": toks / (ms / 1000)}
    return out


def llama_bench_prefill(gguf: Path, threads: int, sizes: list[int], reps: int = 2) -> dict[int, dict[str, float]]:
    """llama-bench's raw prompt processing (``-p N -n 0``) of ``gguf`` per size: ms, tokens, tokens/s.

    Raises:
        RuntimeError: llama-bench failed (its message included).
    """
    import subprocess

    proc = subprocess.run([str(LLAMA_BENCH), "-m", str(gguf), "-t", str(threads), "-p", ",".join(map(str, sizes)),
                           "-n", "0", "-r", str(reps), "-o", "json"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {proc.stderr[-1000:]}")
    out: dict[int, dict[str, float]] = {}
    for row in json.loads(proc.stdout):
        n, tok_s = int(row["n_prompt"]), float(row["avg_ts"])
        out[n] = {"ms": n / tok_s * 1000, "prompt_tokens": n, "tok_s": tok_s}
    return out


def table(results: dict[str, dict[int, dict[str, float]]], sizes: list[int]) -> str:
    """Markdown: prefill tokens/s per system and prompt size, and each against ours."""
    names = list(results)
    head = "| prompt (tokens) | " + " | ".join(f"{n} tok/s" for n in names) + " |" + "".join(
        f" {n} / ours |" for n in names if n != "ours" and "ours" in results)
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for n in sizes:
        cells = [f"{results[s][n]['tok_s']:.0f} ({results[s][n]['ms']:.0f} ms)" for s in names]
        ratios = [f"{results[s][n]['tok_s'] / results['ours'][n]['tok_s']:.2f}x"
                  for s in names if s != "ours" and "ours" in results]
        rows.append(f"| {n} | " + " | ".join(cells) + " |" + "".join(f" {r} |" for r in ratios))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--systems", default="ours,llamacpp,llamacpp-q4_1,hf")
    p.add_argument("--prompts", default="512,2048,6000", help="prompt sizes in tokens (about)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="HF folder for ours (tests; the peers run the bundled model)")
    p.add_argument("--no-llama-bench", action="store_true", help="leave out llama-bench's raw figures")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.prompts.split(",") if x]
    load = os.getloadavg()[0]
    results: dict[str, dict[int, dict[str, float]]] = {}
    for label, system in build(a.systems.split(","), a.threads, Path(a.model) if a.model else None).items():
        try:
            url = system.start(1)
            results[label] = asyncio.run(measure(url, system.model_name, sizes, a.repeats, a.seed))
            print(f"[{label}] " + ", ".join(f"{n}: {r['tok_s']:.0f} tok/s" for n, r in results[label].items()),
                  file=sys.stderr, flush=True)
        finally:
            system.stop()
    # llama.cpp's raw figures go beside its servers (not beside ours alone)
    if not a.no_llama_bench and LLAMA_BENCH.is_file() and "llamacpp" in a.systems.split(","):
        for q, gguf in (("Q4_0", S.PEER_Q4_0), ("Q4_1", S.PEER_Q4_1)):
            if gguf.is_file():
                label = f"llama-bench {q} (raw)"
                results[label] = llama_bench_prefill(gguf, a.threads, sizes)
                print(f"[{label}] " + ", ".join(f"{n}: {r['tok_s']:.0f} tok/s" for n, r in results[label].items()),
                      file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps({"load_before": load, "results": results}))
    else:
        print(f"threads {a.threads}; median of {a.repeats} prompts per size; load average before {load:.2f}")
        print(table(results, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
