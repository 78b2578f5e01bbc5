"""Intervals on rates counted from yes/no outcomes: Wilson's score interval for one rate and
Newcombe's hybrid score interval for the difference of two independent rates.

Both stay inside [0, 1] (resp. [-1, 1]) and behave at zero counts, where the normal (Wald)
interval collapses to a point: 0 violations in 50 responses is not proof of a zero rate.
"""
from __future__ import annotations

import math
from statistics import NormalDist


def z_one_sided(confidence: float) -> float:
    """The standard normal quantile of a one-sided bound at `confidence` (0.95 -> 1.645)."""
    if not 0.5 < confidence < 1:
        raise ValueError(f"confidence must be in (0.5, 1), got {confidence}")
    return NormalDist().inv_cdf(confidence)


def wilson(k: int, n: int, z: float) -> tuple[float, float]:
    """Wilson score interval (low, high) of a rate seen k times in n (Wilson 1927), each end
    a one-sided bound at the confidence `z` stands for."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"wilson: need 0 <= k <= n and n > 0, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def difference_bounds(k1: int, n1: int, k2: int, n2: int, z: float) -> tuple[float, float]:
    """(low, high) of p1 - p2 by Newcombe's hybrid score method (Newcombe 1998, method 10):
    each end combines the two Wilson intervals' distances on the side that moves it."""
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson(k1, n1, z)
    l2, u2 = wilson(k2, n2, z)
    d = p1 - p2
    return (d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2),
            d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2))
