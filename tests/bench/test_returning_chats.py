"""bench/returning_chats.py: its report and its read-rate probe (the sequences themselves
need servers and run as a benchmark, docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from bench.returning_chats import Turn, read_rate, table, targets


def test_the_table_and_targets_show_each_system_and_the_ratios() -> None:
    t = lambda ms, cached, disk=0: Turn(ms, 1200, cached, {"pool": cached - disk, "disk": disk})  # noqa: E731
    results = {"ours": {"eviction": {"cold": t(1000, 0), "hot": t(50, 1200), "return": t(80, 1232, 1168)},
                        "restart": {"cold": t(1000, 0), "hot": t(60, 1200), "return": t(90, 1232, 1232)}},
               "llama.cpp": {"eviction": {"cold": t(2800, 0), "hot": t(100, 1208), "return": t(160, 1236)}}}
    text = table(results)
    assert "**80 ms, 1,232 cached (1,168 disk)**" in text and "| llama.cpp | eviction |" in text
    lines = targets(results)
    assert "ours return / ours hot = 1.60" in lines[0]
    assert "ours return / llama.cpp return = 0.50" in lines[1]
    assert "restart: ours return / ours hot = 1.50" in lines[2]


def test_read_rate_reads_and_checks_every_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert read_rate(8) == 0
    out = capsys.readouterr().out
    assert "over 8 pages (3 MB)" in out and "GB/s from the page cache" in out
