"""The efficacy bar (`targets:` in params) checked against the last iteration's evaluation and
the run's wall time: what `alignloop run` prints at the end, met or missed, with the numbers."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tasks.params import TargetParams

SETUP_STAGES = ("prompts", "prepare_model", "collect_offpolicy", "reference_samples")


@dataclass(frozen=True)
class Check:
    name: str
    value: float
    bar: str
    met: bool

    def line(self) -> str:
        return f"  [{'met' if self.met else 'MISSED'}] {self.name} = {self.value:.3f} ({self.bar})"


def iteration_minutes(stage_seconds: Mapping[str, float]) -> float:
    """Wall time of the loop's stages (set-up stages excluded), stage name -> seconds."""
    return sum(s for name, s in stage_seconds.items()
               if name.split("@")[0] not in SETUP_STAGES) / 60.0


def check(m: Mapping[str, float], p: TargetParams, minutes: float | None) -> list[Check]:
    """Each target against the final iteration's metrics `m`; `minutes` None = not timed (a
    cached rerun measures nothing)."""
    def get(key: str) -> float:
        v = m.get(key, float("nan"))
        return float(v) if v is not None else float("nan")
    drop = get("eval/ref_on_topic_rate") - get("eval/on_topic_rate")
    drift = abs(get("eval/length_ratio") - 1.0)
    out = [
        Check("eval/gold_win_rate", get("eval/gold_win_rate"), f">= {p.min_gold_win_rate}",
              get("eval/gold_win_rate") >= p.min_gold_win_rate),
        Check("eval/gold_win_rate_ci_low", get("eval/gold_win_rate_ci_low"),
              f"> {p.min_gold_win_rate_ci_low}",
              get("eval/gold_win_rate_ci_low") > p.min_gold_win_rate_ci_low),
        Check("eval/win_rate", get("eval/win_rate"), f">= {p.min_win_rate}",
              get("eval/win_rate") >= p.min_win_rate),
        Check("on-topic drop vs reference", drop, f"<= {p.max_on_topic_drop}",
              drop <= p.max_on_topic_drop),
        Check("|length_ratio - 1|", drift, f"<= {p.max_length_drift}",
              drift <= p.max_length_drift),
        Check("eval/n", get("eval/n"), f">= {p.min_n}", get("eval/n") >= p.min_n),
    ]
    if minutes is not None:
        out.append(Check("iteration minutes", minutes, f"<= {p.max_minutes}",
                         minutes <= p.max_minutes))
    return out
