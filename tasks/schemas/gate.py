"""The promotion gate (`gate:`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GateParams:
    min_win_rate: float = 0.5
    min_win_rate_ci_low: float = 0.0
    min_gold_win_rate: float = 0.0
    max_kl: float = 1e9
    block_on_hacking_flag: bool = True
