"""The efficacy bar a run is measured against (`targets:`): read by the flow only."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TargetParams:
    """The efficacy bar a run is measured against (printed after `alignloop run`; no stage
    reads it, so changing it reruns nothing)."""
    min_gold_win_rate: float = 0.8  # the final policy vs the reference by the gold evaluator, at
                                    #   least
    min_gold_win_rate_ci_low: float = 0.7  # and the lower end of its 95% interval, at least
    min_win_rate: float = 0.85      # by the loop's own judge, at least
    max_on_topic_drop: float = 0.05  # the policy's on-topic rate at most this far below the
                                    #   reference's
    max_review_rate_drop: float = 0.05  # the policy's review rate (gold's check) at most this far
                                    #   below the reference's
    max_length_drift: float = 0.3   # |mean length / reference mean length - 1| at most
    min_n: int = 200                # held-out prompts the final numbers stand on, at least
    max_minutes: float = 10.0       # wall time of each iteration (set-up stages excluded), at most
    min_rm_accuracy: float = 0.7    # the iteration's reward model: held-out pairwise accuracy, at
                                    #   least (0: no RM bars)
    min_rm_heldout_pairs: int = 200  # ... measured on at least this many pairs of held-out prompts
    min_rm_bon_gold_win_rate: float = 0.55  # its Best-of-N rerank of the reference's samples, by
                                    #   gold, at least (0: no bar)
