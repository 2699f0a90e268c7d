"""Engine throughput on the GPU: ``bench/engine_throughput.py`` on a random-weight
Llama-3-8B in bfloat16 (ours against transformers' ``generate``), turned into table rows.

The throughput script runs in its own process under a time limit; whatever it
does (missing, crash, timeout, output that is not JSON) this part writes rows,
so the table always says what happened.

    python3 -m bench.gpu.engine --rows ROWS.jsonl [--timeout-s 300] [--extra-args "--quick"]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu.table import Row, append_row

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "engine_throughput.py"
BASE_ARGS = ["--model-config", "llama3-8b", "--random-weights", "--device", "cuda", "--dtype", "bfloat16", "--json"]


def dig(obj: Any, path: str) -> Any:
    """``obj["a"]["b"]`` for path "a.b"; None when any step is missing."""
    for key in path.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def last_json_object(text: str) -> dict | None:
    """The last line of ``text`` that parses as a JSON object (the script's ``--json``
    output; anything it logged before is skipped), or None."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def _f(v: Any, fmt: str) -> str:
    """``v`` formatted, or "n/a" when it is not a number."""
    return format(v, fmt) if isinstance(v, (int, float)) else "n/a"


def rows_from_result(r: dict) -> list[Row]:
    """Table rows from the throughput script's JSON (fields named in issue 2), with the
    issue's targets: mixed output tokens/s >= 3x transformers; turn-8 TTFT with the
    cache <= 1.5x turn 1. Missing fields show as "n/a"."""
    ours = dig(r, "mixed.ours.output_tok_s")
    hf = dig(r, "mixed.transformers.output_tok_s")
    speedup = dig(r, "mixed.speedup")
    if speedup is None and isinstance(ours, (int, float)) and isinstance(hf, (int, float)) and hf > 0:
        speedup = ours / hf
    n = dig(r, "mixed.requests")
    rows = [
        Row("engine", f"mixed ({n} req): ours", rate=f"{_f(ours, '.0f')} tok/s",
            note=f"TTFT p50 {_f(dig(r, 'mixed.ours.ttft_ms_p50'), '.0f')} ms, "
                 f"TPOT p50 {_f(dig(r, 'mixed.ours.tpot_ms_p50'), '.1f')} ms"),
        Row("engine", "mixed: transformers generate", rate=f"{_f(hf, '.0f')} tok/s",
            note=f"TTFT p50 {_f(dig(r, 'mixed.transformers.ttft_ms_p50'), '.0f')} ms, "
                 f"static batches of {_f(dig(r, 'mixed.transformers.batch_size'), 'd')}"),
        Row("engine", "mixed: ours / transformers",
            check=("ok" if speedup >= 3 else "below target") if isinstance(speedup, (int, float)) else "n/a",
            rate=f"{_f(speedup, '.2f')}x", note="target >= 3x"),
    ]
    t1, t8 = dig(r, "multiturn.ttft_turn1_ms"), dig(r, "multiturn.ttft_turn8_ms_cache")
    t8_off = dig(r, "multiturn.ttft_turn8_ms_nocache")
    ratio = t8 / t1 if isinstance(t1, (int, float)) and isinstance(t8, (int, float)) and t1 > 0 else None
    rows.append(Row("engine", "multiturn: TTFT turn 8 / turn 1",
                    check=("ok" if ratio <= 1.5 else "above target") if ratio is not None else "n/a",
                    time=f"{_f(t8, '.0f')} ms", rate=f"{_f(ratio, '.2f')}x",
                    note=f"turn 1 {_f(t1, '.0f')} ms; turn 8 cache off {_f(t8_off, '.0f')} ms; "
                         f"hit ratio {_f(dig(r, 'multiturn.cache_hit_ratio'), '.3f')}; target <= 1.5x"))
    tpot = dig(r, "single.tpot_ms")
    wbytes = dig(r, "single.weight_bytes")
    numbers = isinstance(tpot, (int, float)) and tpot > 0 and isinstance(wbytes, (int, float))
    gbs = wbytes / (tpot * 1e-3) / 1e9 if numbers else None
    rows.append(Row("engine", "single stream decode", time=f"{_f(tpot, '.2f')} ms",
                    rate=f"{_f(dig(r, 'single.tok_s'), '.0f')} tok/s",
                    note=f"weights read at {_f(gbs, '.0f')} GB/s"))
    return rows


def run_script(script: Path, args: list[str], timeout_s: float) -> tuple[list[Row], str]:
    """Run the throughput script; returns its rows (or one error row) and its output."""
    if not script.exists():
        return [Row("engine", "engine_throughput.py", "missing", note=str(script))], ""
    cmd = [sys.executable, str(script), *args]
    print("engine:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=str(ROOT))
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return [Row("engine", "engine_throughput.py", "timeout", time=f"{timeout_s:.0f} s",
                    note=(err.strip().splitlines() or ["no output"])[-1][:120])], out + err
    wall = time.monotonic() - t0
    output = proc.stdout + proc.stderr
    result = last_json_object(proc.stdout)
    if proc.returncode != 0 or result is None:
        tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        return [Row("engine", "engine_throughput.py", f"error rc={proc.returncode}", time=f"{wall:.0f} s",
                    note=tail[:120])], output
    rows = rows_from_result(result)
    rows[0].time = f"{wall:.0f} s run"
    return rows, output


def main(argv: list[str] | None = None) -> int:
    """Run the engine benchmark and append its rows to ``--rows``; always returns 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", required=True)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--extra-args", default="", help="more arguments for engine_throughput.py (e.g. --quick)")
    p.add_argument("--script", default=str(SCRIPT), help="the throughput script (tests point it elsewhere)")
    p.add_argument("--log", default=None, help="file for the script's full output")
    a = p.parse_args(argv)
    rows, output = run_script(Path(a.script), BASE_ARGS + shlex.split(a.extra_args), a.timeout_s)
    if a.log:
        Path(a.log).write_text(output, encoding="utf-8")
    for row in rows:
        append_row(a.rows, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
