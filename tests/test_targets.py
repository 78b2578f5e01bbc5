"""The efficacy bar printed after a run: each target met or missed on canned metrics."""
from __future__ import annotations

from flows.targets import check, iteration_minutes
from tasks.params import TargetParams

GOOD = {"eval/gold_win_rate": 0.8, "eval/gold_win_rate_ci_low": 0.74, "eval/win_rate": 0.9,
        "eval/on_topic_rate": 0.6, "eval/ref_on_topic_rate": 0.62, "eval/length_ratio": 1.2,
        "eval/n": 200.0}


def test_all_met_then_each_missed() -> None:
    p = TargetParams()
    assert all(c.met for c in check(GOOD, p, 14.0))
    for key, bad in (("eval/gold_win_rate", 0.7), ("eval/gold_win_rate_ci_low", 0.5),
                     ("eval/win_rate", 0.8), ("eval/on_topic_rate", 0.5),
                     ("eval/length_ratio", 0.6), ("eval/n", 100.0)):
        missed = [c.name for c in check({**GOOD, key: bad}, p, 14.0) if not c.met]
        assert len(missed) == 1, (key, missed)
    assert [c.name for c in check(GOOD, p, 16.0) if not c.met] == ["iteration minutes"]
    assert len(check(GOOD, p, None)) == len(check(GOOD, p, 1.0)) - 1   # cached: untimed


def test_missing_metric_is_missed_not_met() -> None:
    assert not check({}, TargetParams(), None)[0].met


def test_iteration_minutes_excludes_setup() -> None:
    secs = {"prompts": 5.0, "prepare_model": 30.0, "collect_offpolicy": 60.0,
            "reference_samples": 60.0, "rollout@1": 60.0, "update@1": 120.0}
    assert iteration_minutes(secs) == 3.0
