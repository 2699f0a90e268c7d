"""Rows of the GPU benchmark and the table printed at the end of ``bench/gpu/run.sh``.

Each part of the benchmark (a separate process, which may crash or time out)
appends its rows as JSON lines to one file; ``python3 -m bench.gpu.table FILE``
prints them as a fixed-width table. A part that fails writes an error row
instead, so the table always has one line per part.

    python3 -m bench.gpu.table ROWS.jsonl [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

COLUMNS = (("part", 8), ("case", 34), ("check", 22), ("time", 11), ("rate", 14), ("of ceiling", 12), ("note", 0))


@dataclass
class Row:
    """One line of the table.

    Attributes:
        part: "device", "kernel", "engine" or "env".
        case: what was measured (shape, workload).
        check: correctness ("rel 3.1e-03 ok", "exact ok", "FAIL ...") or a value.
        time: formatted duration (e.g. "0.231 ms"), or "".
        rate: formatted throughput ("3.10 TB/s", "410 TFLOP/s", "2310 tok/s"), or "".
        of_ceiling: the rate as a fraction of the device's measured ceiling ("71%"), or "".
        note: anything else (tile choice, target, error text).
    """

    part: str
    case: str
    check: str = ""
    time: str = ""
    rate: str = ""
    of_ceiling: str = ""
    note: str = ""


def append_row(path: str | Path, row: Row) -> None:
    """Append ``row`` to the JSON-lines file ``path`` (created if absent) and echo it."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(asdict(row)) + "\n")
    print(f"[row] {row.part} | {row.case} | {row.check} | {row.time} | {row.rate} | {row.of_ceiling} | {row.note}",
          flush=True)


def read_rows(path: str | Path) -> list[Row]:
    """Rows of ``path``; a line that is not a row becomes an error row (never raises on content)."""
    rows: list[Row] = []
    p = Path(path)
    if not p.exists():
        return [Row("bench", "rows file", "missing", note=str(p))]
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(Row(**json.loads(line)))
        except (ValueError, TypeError) as e:
            rows.append(Row("bench", "unreadable row", "error", note=f"{e}: {line[:80]}"))
    return rows


def render(rows: list[Row], title: str = "") -> str:
    """The rows as a fixed-width text table (long cells are cut, the last column is not)."""
    def cell(text: str, width: int) -> str:
        text = str(text)
        if width == 0:
            return text
        return (text if len(text) <= width else text[: width - 1] + "~").ljust(width)

    header = " ".join(cell(name, w) for name, w in COLUMNS).rstrip()
    lines = [title] if title else []
    lines += [header, "-" * len(header)]
    for r in rows:
        values = (r.part, r.case, r.check, r.time, r.rate, r.of_ceiling, r.note)
        lines.append(" ".join(cell(v, w) for v, (_, w) in zip(values, COLUMNS)).rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table of a rows file; returns 0 (a missing file prints an error row)."""
    p = argparse.ArgumentParser(description="print the GPU benchmark table")
    p.add_argument("rows")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    print(render(read_rows(a.rows), a.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
