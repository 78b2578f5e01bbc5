"""The efficacy bar printed after a run: each target met or missed on canned metrics."""
from __future__ import annotations

from flows.targets import check, iteration_minutes
from tasks.config.params import TargetParams

GOOD = {"eval/gold_win_rate": 0.8, "eval/gold_win_rate_ci_low": 0.74, "eval/win_rate": 0.9,
        "eval/on_topic_rate": 0.6, "eval/ref_on_topic_rate": 0.62, "eval/length_ratio": 1.2,
        "eval/review_rate": 0.86, "eval/ref_review_rate": 0.9, "eval/n": 200.0,
        "rm/accuracy": 0.72, "rm/n_heldout": 230.0, "eval/bon_gold_win_rate": 0.6}


def test_all_met_then_each_missed() -> None:
    p = TargetParams()
    assert all(c.met for c in check(GOOD, p, {"1": 9.0}))
    for key, bad in (("eval/gold_win_rate", 0.78), ("eval/gold_win_rate_ci_low", 0.7),
                     ("eval/win_rate", 0.8), ("eval/on_topic_rate", 0.5),
                     ("eval/review_rate", 0.84), ("eval/length_ratio", 0.6),
                     ("eval/n", 100.0), ("rm/accuracy", 0.69), ("rm/n_heldout", 199.0),
                     ("eval/bon_gold_win_rate", 0.54)):
        missed = [c.name for c in check({**GOOD, key: bad}, p, {"1": 9.0}) if not c.met]
        assert len(missed) == 1, (key, missed)
    # the bar holds per iteration: two of 6 minutes meet it (not their sum), one of 10.5
    # misses it (the longest, not the last)
    assert all(c.met for c in check(GOOD, p, {"1": 6.0, "2": 6.0}))
    slow = [c for c in check(GOOD, p, {"1": 10.5, "2": 4.0}) if not c.met]
    assert [(c.name, c.value) for c in slow] == [("iteration minutes (longest iteration)", 10.5)]
    assert len(check(GOOD, p, None)) == len(check(GOOD, p, {"1": 1.0})) - 1   # untimed


def test_missing_metric_is_missed_not_met() -> None:
    assert not check({}, TargetParams(), None)[0].met
    rm_only = {k: v for k, v in GOOD.items() if not k.startswith("eval/bon")}
    assert [c.name for c in check(rm_only, TargetParams(), None) if not c.met] == [
        "eval/bon_gold_win_rate (RM Best-of-N by gold)"]


def test_reward_model_bars_can_be_left_out() -> None:
    p = TargetParams(min_rm_accuracy=0.0, min_rm_bon_gold_win_rate=0.0)
    bare = {k: v for k, v in GOOD.items() if not k.startswith(("rm/", "eval/bon"))}
    assert all(c.met for c in check(bare, p, None))
    assert not any(c.name.startswith(("rm/", "eval/bon")) for c in check(GOOD, p, None))


def test_the_run_prints_each_target_with_its_own_figures(tiny_run) -> None:
    """The user's path: `alignloop run` ends with the targets block, and the reward model's
    lines carry the figures the run recorded (not a canned value), met or missed by the
    profile's bars."""
    import json
    ws, out = tiny_run["ws"], tiny_run["first"].stdout
    block = out[out.index("targets (iteration 2):"):].splitlines()
    rm = json.loads((ws / "metrics/iter_2/train_rm.json").read_text())
    ev = json.loads((ws / "metrics/iter_2/evaluate.json").read_text())
    from tasks.config.params import load_params
    p = load_params(ws / "params.yaml").targets          # the bars the run itself was given
    for name, value, bar in (("rm/accuracy (held-out pairs)", rm["rm/accuracy"],
                              p.min_rm_accuracy),
                             ("rm/n_heldout", rm["rm/n_heldout"], p.min_rm_heldout_pairs),
                             ("eval/bon_gold_win_rate (RM Best-of-N by gold)",
                              ev["eval/bon_gold_win_rate"], p.min_rm_bon_gold_win_rate)):
        tag = "met" if value >= bar else "MISSED"
        assert f"  [{tag}] {name} = {value:.3f} (>= {bar})" in block, (name, block)
    lines = [x for x in block[1:] if x.startswith("  [") and not x.startswith("  [untimed]")]
    met = sum(x.startswith("  [met]") for x in lines)
    assert block[0] == f"targets (iteration 2): {met} of {len(lines)} met"


def test_iteration_minutes_excludes_setup() -> None:
    secs = {"prompts": 5.0, "prepare_model": 30.0, "collect_offpolicy": 60.0,
            "reference_samples": 60.0, "rollout@1": 60.0, "update@1": 120.0}
    assert iteration_minutes(secs) == {"1": 3.0}
    secs |= {"rollout@2": 30.0, "evaluate@2": 90.0}
    assert iteration_minutes(secs) == {"1": 3.0, "2": 2.0}


def test_recorded_seconds_follow_the_lock_entry(tmp_path) -> None:
    from flows.dag import StageRun
    from flows.targets import record_seconds, recorded_seconds
    lock = {"rollout@1": {"outs": [{"md5": "a"}]}, "update@1": {"outs": [{"md5": "b"}]}}
    names = ["rollout@1", "update@1"]
    assert recorded_seconds(tmp_path, names, lock) == ({}, names)     # nothing recorded yet
    record_seconds(tmp_path, [StageRun("rollout@1", "ran", 40.0),
                              StageRun("update@1", "restored", 2.0)], lock)
    # a resumed run: rollout@1 is cached now, and its earlier time still counts
    record_seconds(tmp_path, [StageRun("rollout@1", "cached", 0.1)], lock)
    assert recorded_seconds(tmp_path, names, lock) == ({"rollout@1": 40.0}, ["update@1"])
    record_seconds(tmp_path, [StageRun("update@1", "ran", 80.0)], lock)
    timed, untimed = recorded_seconds(tmp_path, names, lock)
    assert timed == {"rollout@1": 40.0, "update@1": 80.0} and untimed == []
    assert iteration_minutes(timed) == {"1": 2.0}
    # outputs that changed since (restored from another run's cache): the timing is not theirs
    changed = {**lock, "update@1": {"outs": [{"md5": "c"}]}}
    assert recorded_seconds(tmp_path, names, changed) == ({"rollout@1": 40.0}, ["update@1"])


def test_unreadable_timings_file_means_untimed(tmp_path) -> None:
    from flows.targets import SECONDS_FILE, recorded_seconds
    from flows.workspace import STATE_DIR
    (tmp_path / STATE_DIR).mkdir()
    (tmp_path / STATE_DIR / SECONDS_FILE).write_text("{not json")
    assert recorded_seconds(tmp_path, ["rollout@1"], {"rollout@1": {}}) == ({}, ["rollout@1"])
