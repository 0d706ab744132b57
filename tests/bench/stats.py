"""Order statistics for benchmark samples (seconds in, milliseconds out)."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: a value that was actually observed."""
    ordered = sorted(samples)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil without floats drifting
    return ordered[int(rank) - 1]


def summary(samples_s: Sequence[float]) -> dict:
    return {
        "n": len(samples_s),
        "median_ms": percentile(samples_s, 50) * 1e3,
        "p99_ms": percentile(samples_s, 99) * 1e3,
        "max_ms": max(samples_s) * 1e3,
    }
