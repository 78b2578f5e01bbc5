"""Win rates from verdicts, ties counting half, with a bootstrap interval and the counts."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tasks.judging.judges import Verdict, verdict_rates

_POINTS = {"A": 1.0, "tie": 0.5, "B": 0.0}


def win_rate(verdicts: Sequence[Verdict], n_boot: int, seed: int) -> dict[str, float]:
    """Win rate of side A over valid verdicts; invalid ones are excluded and counted.

    Returns the rate, a percentile-bootstrap 95% interval, n, and the verdict counts/rates.
    """
    points = np.array([_POINTS[v] for v in verdicts if v != "invalid"])
    out = {k: v for k, v in verdict_rates(verdicts).items()}
    if points.size == 0:
        return {**out, "win_rate": float("nan"), "ci_low": float("nan"),
                "ci_high": float("nan")}
    rng = np.random.default_rng(seed)
    boots = rng.choice(points, size=(n_boot, points.size), replace=True).mean(axis=1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return {**out, "win_rate": float(points.mean()), "ci_low": float(lo), "ci_high": float(hi)}
