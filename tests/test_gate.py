"""The promotion gate's decision: every check named, with its value and threshold."""
from __future__ import annotations

from tasks.config.params import GateParams
from tasks.stages.gate import decide

GOOD = {"eval/win_rate": 0.8, "eval/win_rate_ci_low": 0.6, "eval/kl": 3.0,
        "eval/violation_rate_increase_ci_high": 0.0}
P = GateParams(min_win_rate=0.7, min_win_rate_ci_low=0.5, max_kl=5.0)


def test_passes_when_every_check_holds():
    d = decide(GOOD, P)
    assert d["passed"] and d["reasons"] == []
    assert all(c["ok"] for c in d["checks"].values())


def test_each_failing_check_is_a_reason():
    d = decide({**GOOD, "eval/win_rate": 0.65, "eval/kl": 9.0}, P)
    assert not d["passed"]
    assert len(d["reasons"]) == 2
    assert any("eval/win_rate = 0.65" in r for r in d["reasons"])
    assert any("eval/kl = 9.0" in r for r in d["reasons"])


def test_missing_or_nan_metric_fails():
    assert not decide({k: v for k, v in GOOD.items() if k != "eval/kl"}, P)["passed"]
    assert not decide({**GOOD, "eval/win_rate": float("nan")}, P)["passed"]


def test_hacking_flag_blocks_unless_disabled():
    flagged = {**GOOD, "eval/hacking_flag": 1.0}
    assert not decide(flagged, P)["passed"]
    assert decide(flagged, GateParams(min_win_rate=0.7, min_win_rate_ci_low=0.5, max_kl=5.0,
                                      block_on_hacking_flag=False))["passed"]


def test_gold_win_rate_checked_only_when_asked():
    gold = GateParams(min_win_rate=0.7, min_win_rate_ci_low=0.5, max_kl=5.0,
                      min_gold_win_rate=0.55)
    assert "eval/gold_win_rate >= min_gold_win_rate" not in decide(GOOD, P)["checks"]
    assert decide({**GOOD, "eval/gold_win_rate": 0.6}, gold)["passed"]
    d = decide({**GOOD, "eval/gold_win_rate": 0.5}, gold)
    assert not d["passed"] and any("eval/gold_win_rate = 0.5" in r for r in d["reasons"])
    assert not decide(GOOD, gold)["passed"]              # asked for, but not measured


def test_hacking_monitors_flag_length_drift_and_rm_disagreement():
    from tasks.config.params import MonitorParams
    from tasks.stages.evaluate import hacking_flags
    p = MonitorParams(max_length_drift=0.3, max_rm_disagreement_ratio=2.0)
    calm = hacking_flags({"eval/length_ratio": 1.2, "eval/rm_disagreement": 0.1,
                          "eval/rm_disagreement_ref": 0.08}, p)
    assert calm["eval/hacking_flag"] == 0.0 and abs(calm["eval/length_drift"] - 0.2) < 1e-12
    long = hacking_flags({"eval/length_ratio": 1.5, "eval/rm_disagreement": 0.1,
                          "eval/rm_disagreement_ref": 0.08}, p)
    assert long["eval/flag_length_drift"] == 1.0 and long["eval/hacking_flag"] == 1.0
    drift = hacking_flags({"eval/length_ratio": 1.0, "eval/rm_disagreement": 0.3,
                           "eval/rm_disagreement_ref": 0.1}, p)
    assert drift["eval/flag_rm_disagreement"] == 1.0
    assert abs(drift["eval/rm_disagreement_ratio"] - 3.0) < 1e-9
    single = hacking_flags({"eval/length_ratio": 1.0, "eval/rm_disagreement": 0.0,
                            "eval/rm_disagreement_ref": 0.0}, p)   # one RM: no spread to judge
    assert single["eval/hacking_flag"] == 0.0


VIOLATION_CHECK = "eval/violation_rate_increase_ci_high <= max_violation_increase"


def test_violation_check_passes_at_the_bound_and_fails_above_it():
    p = GateParams(min_win_rate=0.7, min_win_rate_ci_low=0.5, max_kl=5.0,
                   max_violation_increase=0.25)
    at = decide({**GOOD, "eval/violation_rate_increase_ci_high": 0.25}, p)
    assert at["passed"] and at["checks"][VIOLATION_CHECK] == {"value": 0.25, "threshold": 0.25,
                                                               "ok": True}
    above = decide({**GOOD, "eval/violation_rate_increase_ci_high": 0.375}, p)
    assert not above["passed"] and above["checks"][VIOLATION_CHECK]["ok"] is False
    assert above["reasons"] == ["eval/violation_rate_increase_ci_high = 0.375 fails "
                                "<= max_violation_increase (0.25)"]


def test_violation_check_fails_unmeasured_and_is_off_below_zero():
    unmeasured = {k: v for k, v in GOOD.items() if k != "eval/violation_rate_increase_ci_high"}
    assert not decide(unmeasured, P)["passed"]
    off = GateParams(min_win_rate=0.7, min_win_rate_ci_low=0.5, max_kl=5.0,
                     max_violation_increase=-1.0)
    d = decide(unmeasured, off)
    assert d["passed"] and VIOLATION_CHECK not in d["checks"]
