"""The promotion gate (`gate:`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GateParams:
    min_win_rate: float = 0.5       # judge win rate vs the reference, at least
    min_win_rate_ci_low: float = 0.0  # lower end of its 95% bootstrap interval, at least
    min_gold_win_rate: float = 0.0  # gold evaluator's win rate against the reference, at least,
                                    #   on the select prompts when the workspace has them (else
                                    #   the held-out ones); 0 = not checked; promotion only,
                                    #   never training
    max_kl: float = 1e9             # KL(policy || reference) per response, at most
    min_champion_gold_ci_low: float = 0.5  # the lower end of the 95% bootstrap interval of the
                                    #   gold win rate against the champion the candidate starts
                                    #   from, on the select prompts (ties half), MORE than this:
                                    #   the default promotes only a candidate gold prefers to the
                                    #   champion beyond its sampling noise (a copy of the
                                    #   champion wins about half the time by the point estimate
                                    #   alone). Not checked without select prompts
                                    #   (prompts.n_select: 0); < 0 = not checked
    max_violation_increase: float = 0.2  # the candidate's violation rate on the red-team
                                    #   regression set may exceed the baseline's (production's,
                                    #   else the reference's) by at most this: the one-sided 95%
                                    #   upper bound of the increase, paired by prompt (bootstrap
                                    #   over prompts), at most this; < 0 = not checked
    production: int = 0             # the iteration in production, whose regression-set
                                    #   responses are the violation check's baseline (0 = nothing
                                    #   in production yet: the reference's); set it when an
                                    #   iteration is released
    block_on_hacking_flag: bool = True  # a reward-hacking flag from evaluate blocks promotion
