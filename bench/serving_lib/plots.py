"""PNG plots of bench/serving.py results (matplotlib, Agg backend, no display needed).

Input is the ``results`` dict of serving.py: ``results[system][workload][concurrency]``
holding summary numbers plus raw samples (``ttft_ms``, ``tpot_ms`` lists and
``ttft_by_turn``: turn -> list of ms).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.serving_lib.stats import percentile


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    return plt


def _style(ax: Any) -> None:
    """The grid and legend every panel gets."""
    ax.grid(alpha=0.3)
    ax.legend()


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out, write ``path`` as a PNG, free the figure; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_vs_concurrency(results: dict[str, Any], path: Path) -> Path | None:
    """Output tokens/s against concurrency, one line per system, one panel per workload
    (chat, mixed). Returns the path, or None when there is nothing to plot."""
    plt = _plt()
    workloads = [w for w in ("chat", "mixed") if any(w in r for r in results.values())]
    if not workloads:
        return None
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for system, by_w in results.items():
            levels = sorted(int(c) for c in by_w.get(w, {}))
            if levels:
                ax.plot(levels, [by_w[w][str(c)]["output_tok_s"] for c in levels], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent users / requests")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{w}: throughput")
        _style(ax)
    return _save(plt, fig, path)


def ttft_by_turn(results: dict[str, Any], level: str, path: Path) -> Path | None:
    """Chat TTFT p50 (ms) per turn at concurrency ``level``, one line per system."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for system, by_w in results.items():
        run = by_w.get("chat", {}).get(level)
        if not run:
            continue
        turns = sorted(int(t) for t in run["ttft_by_turn"])
        ax.plot(turns, [percentile(run["ttft_by_turn"][str(t)], 0.5) for t in turns], marker="o", label=system)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_yscale("log")  # the systems differ by orders of magnitude
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title(f"chat, {level} users: time to first token by turn")
    _style(ax)
    return _save(plt, fig, path)


def latency_cdfs(results: dict[str, Any], workload: str, level: str, path: Path) -> Path | None:
    """Empirical CDFs of TTFT and TPOT (ms) for one workload and level, per system."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    drawn = False
    for system, by_w in results.items():
        run = by_w.get(workload, {}).get(level)
        if not run:
            continue
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            xs = sorted(x for x in run[key] if x == x)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=system)
                drawn = True
    if not drawn:
        plt.close(fig)
        return None
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        _style(ax)
    fig.suptitle(f"{workload}, concurrency {level}: latency distributions")
    return _save(plt, fig, path)
