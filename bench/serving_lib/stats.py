"""Summary statistics of latency samples (milliseconds in, milliseconds out)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(xs: Iterable[float], q: float) -> float:
    """The ``q``-quantile (``q`` in [0, 1]) of ``xs`` by linear interpolation between
    order statistics (NumPy's default, "type 7" of Hyndman & Fan 1996).

    Returns NaN for an empty sample.

    Raises:
        ValueError: ``q`` is outside [0, 1].
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    s = sorted(xs)
    if not s:
        return math.nan
    k = (len(s) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(xs: Sequence[float], qs: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[str, float]:
    """``{"n", "mean", "p50", "p90", "p99", "max"}`` of a sample (NaN entries for an
    empty one); the keys follow ``qs`` as ``p<100*q>``."""
    out: dict[str, float] = {"n": float(len(xs))}
    out["mean"] = sum(xs) / len(xs) if xs else math.nan
    for q in qs:
        out[f"p{q * 100:g}"] = percentile(xs, q)
    out["max"] = max(xs) if xs else math.nan
    return out


def fmt(x: float, digits: int = 1) -> str:
    """A number for a table: ``-`` for NaN/None, else fixed-point with ``digits``."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"
