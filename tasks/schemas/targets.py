"""The efficacy bar a run is measured against (`targets:`): read by the flow only."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TargetParams:
    """The efficacy bar a run is measured against (printed after `alignloop run`; no stage
    reads it, so changing it reruns nothing)."""
    min_gold_win_rate: float = 0.8
    min_gold_win_rate_ci_low: float = 0.7
    min_win_rate: float = 0.85
    max_on_topic_drop: float = 0.05
    max_review_rate_drop: float = 0.05   # the policy's review rate (gold's check) vs the ref's
    max_length_drift: float = 0.3
    min_n: int = 200
    max_minutes: float = 10.0
    min_rm_accuracy: float = 0.7         # the RM's held-out pairwise accuracy (0: no RM bars)
    min_rm_heldout_pairs: int = 200      # ... measured on at least this many held-out pairs
    min_rm_bon_gold_win_rate: float = 0.55   # the RM's Best-of-N rerank, by gold (0: no bar)
