"""The whole loop through the CLI: two tiny iterations in a temp workspace, then a rerun."""
from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from tasks.core import layout

ITERATIONS = (1, 2)


def _lock(ws: Path) -> dict:
    return yaml.safe_load((ws / "dvc.lock").read_text())["stages"]


def test_every_stage_output_exists_with_its_md5_in_dvc_lock(tiny_run):
    ws, lock = tiny_run["ws"], _lock(tiny_run["ws"])
    expected = {"prompts", "prepare_model", "collect_offpolicy", "reference_samples"} | {
        f"{s}@{i}" for s in ("rollout", "judge", "train_rm", "update", "evaluate", "gate")
        for i in ITERATIONS} | {"report"}
    assert set(lock) == expected
    for name, entry in lock.items():
        assert entry["outs"], name
        for out in entry["outs"]:
            path = ws / out["path"]
            assert path.exists(), f"{name}: {out['path']} missing"
            if path.is_file():   # DVC 3 file md5 is the md5 of the bytes
                assert hashlib.md5(path.read_bytes()).hexdigest() == out["md5"], out["path"]
            else:
                assert out["md5"].endswith(".dir") and out["nfiles"] > 0


def test_progress_output_names_each_stage(tiny_run):
    out = tiny_run["first"].stdout
    for name in ("prompts", "rollout@1", "judge@2", "evaluate@2"):
        assert f"[ran] {name}" in out


def test_second_run_is_fully_cached_and_changes_nothing(tiny_run):
    out = tiny_run["second"].stdout
    assert "[ran]" not in out and "[restored]" not in out
    # one line per iteration found up to date (its stages go to the Prefect log), the report
    assert [line for line in out.splitlines() if line.startswith("[cached]")] == [
        "[cached] iteration 0: 4 stages up to date", "[cached] iteration 1: 6 stages up to date",
        "[cached] iteration 2: 6 stages up to date", "[cached] report"]
    assert tiny_run["head2"] == tiny_run["head"]
    assert tiny_run["after"] == tiny_run["before"]


def test_cached_rerun_still_counts_the_loop_minutes_it_recorded(tiny_run):
    import re

    def minutes(out: str) -> tuple[str, str, str]:
        value = re.search(r"\] iteration minutes \(longest iteration\) = ([0-9.]+)", out)
        each = re.search(r"minutes per iteration 1: ([0-9.]+), 2: ([0-9.]+); all ([0-9.]+)",
                         out)
        computed = re.search(r"this run computed (\d+) of (\d+)", out)
        assert value and each and computed, out[-800:]
        one, two, total = (float(x) for x in each.groups())
        assert abs(float(value.group(1)) - max(one, two)) <= 0.0051   # the longest (3 vs 2 dp)
        assert abs(one + two - total) < 0.011
        return value.group(1), each.group(0), f"{computed.group(1)}/{computed.group(2)}"

    first, second = minutes(tiny_run["first"].stdout), minutes(tiny_run["second"].stdout)
    assert float(first[0]) > 0 and first[:2] == second[:2]     # the same recorded stage times
    assert first[2] == "12/12" and second[2] == "0/12"


def test_status_reports_every_stage_up_to_date(tiny_run):
    proc = run_cli("status", "--workspace", str(tiny_run["ws"]), "--json")
    states = json.loads(proc.stdout)
    assert len(states) == 17
    assert {s["state"] for s in states} == {"up-to-date"}


def test_report_has_per_iteration_metrics(tiny_run):
    report = json.loads(run_cli("report", "--workspace", str(tiny_run["ws"]), "--json").stdout)
    for it in ITERATIONS:
        m = report[str(it)]
        for key in ("eval/win_rate", "eval/kl", "eval/rm_win_rate", "rm/accuracy",
                    "judge/n_pairs", "update/steps", "eval/review_rate", "eval/ref_review_rate"):
            assert key in m, (it, key)
        assert 0.0 <= m["eval/win_rate"] <= 1.0
        assert 0.0 <= m["eval/review_rate"] <= 1.0 and 0.0 <= m["eval/ref_review_rate"] <= 1.0


def test_one_git_commit_per_iteration(tiny_run):
    ws = tiny_run["ws"]
    log = subprocess.run(["git", "log", "--format=%s"], cwd=ws, capture_output=True,
                         text=True).stdout.splitlines()
    iterations = [m for m in log if m.startswith("alignloop: iteration")]
    assert iterations == ["alignloop: iteration 2", "alignloop: iteration 1",
                          "alignloop: iteration 0"]
    assert "alignloop: champion -> v2 (gate: gate passed at iteration 2)" in log
    assert not subprocess.run(["git", "status", "--porcelain"], cwd=ws, capture_output=True,
                              text=True).stdout.strip()


def test_data_pushed_to_the_dvc_remote(tiny_run):
    ws = tiny_run["ws"]
    remote = ws / ".alignloop" / "dvc-remote"
    for entry in _lock(ws).values():
        for out in entry["outs"]:
            if out["path"].startswith("metrics/"):
                continue                     # metrics are git-tracked (cache: false)
            md5 = out["md5"]
            assert (remote / "files" / "md5" / md5[:2] / md5[2:]).exists(), out["path"]


def test_policies_registered_with_lineage_tags(tiny_run):
    from mlflow.tracking import MlflowClient

    ws = tiny_run["ws"]
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    versions = sorted(client.search_model_versions("name = 'alignloop-policy'"),
                      key=lambda v: int(v.version))
    assert [str(v.version) for v in versions] == ["1", "2"]       # the rerun added none
    lock = _lock(ws)
    commits = subprocess.run(["git", "log", "--format=%H"], cwd=ws, capture_output=True,
                             text=True).stdout.split()
    for it, v in zip(ITERATIONS, versions):
        tags = v.tags
        entry = lock[f"update@{it}"]
        assert tags["dvc_stage"] == f"update@{it}"
        assert tags["git_commit"] in commits
        outs = {o["path"]: o["md5"] for o in entry["outs"]}
        assert tags["model_md5"] == outs[layout.policy(it)]
        for dep in entry["deps"]:
            if not dep["path"].startswith("tasks/"):
                assert tags[f"input:{dep['path']}"] == dep["md5"]
        from flows.lineage import stage_tree
        assert tags["params_md5"] == stage_tree(ws, lock, f"update@{it}", set())["params_md5"]
        assert tags["judge"] == "lexicon:vader-v1"
        assert tags["prefect_flow_run_id"]
        assert tags["parent_policy_version"] == ("initial" if it == 1 else "1")
        assert tags["reward_model_version"]
        assert Path(v.source) == ws / layout.policy(it)
    runs = client.search_runs([client.get_experiment_by_name("alignloop").experiment_id],
                              filter_string="tags.`alignloop.dvc_stage` = 'update@2'")
    assert len(runs) == 1
    parent = runs[0].data.tags["mlflow.parentRunId"]
    assert client.get_run(parent).data.tags["alignloop.iteration"] == "2"


def test_the_targets_decision_is_committed_and_logged(tiny_run):
    """What `run` printed as its targets block is in metrics/targets.json (in the last
    iteration's commit), on that iteration's MLflow run and in the Prefect flow run's log."""
    from mlflow.tracking import MlflowClient
    ws = tiny_run["ws"]
    result = json.loads((ws / layout.TARGETS).read_text())
    assert result["iteration"] == 2 and result["of"] == len(result["checks"]) > 5
    assert result["met"] == sum(c["met"] for c in result["checks"])
    printed = tiny_run["first"].stdout
    assert f"targets (iteration 2): {result['met']} of {result['of']} met" in printed
    for c in result["checks"]:
        assert f"[{'met' if c['met'] else 'MISSED'}] {c['name']} = {c['value']:.3f}" in printed
    tag = subprocess.run(["git", "show", f"iteration-2:{layout.TARGETS}"], cwd=ws,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(tag) == result
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("alignloop").experiment_id],
                               filter_string="tags.`alignloop.iteration` = '2' and "
                                             "attributes.run_name = 'iteration 2'")
    assert run.data.metrics["targets/met"] == result["met"]
    assert run.data.metrics["targets/of"] == result["of"]
    logged = client.download_artifacts(run.info.run_id, "targets.json")
    assert json.loads(Path(logged).read_text()) == result


def test_training_curves_are_logged_per_step(tiny_run):
    """Each update and reward-model stage run carries its optimiser steps as curves: one
    point per step, at step = the step's index, as its model directory's curve holds them."""
    from mlflow.tracking import MlflowClient
    ws = tiny_run["ws"]
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("alignloop").experiment_id
    for stage, model_dir, keys in (
            ("update@2", layout.policy(2), ("loss", "reward_margin", "logratio", "lr")),
            ("train_rm@2", layout.reward_model(2), ("loss", "lr"))):
        curve = json.loads((ws / model_dir / layout.TRAINING_CURVE).read_text())
        assert len(curve) > 1
        [run] = client.search_runs([exp], filter_string=f"tags.`alignloop.dvc_stage` = "
                                                        f"'{stage}'", max_results=1)
        for key in keys:
            history = client.get_metric_history(run.info.run_id, f"train/{key}")
            assert [m.step for m in history] == list(range(len(curve))), (stage, key)
            assert [m.value for m in history] == pytest.approx([r[key] for r in curve])


def test_the_registry_record_in_git_matches_the_store(tiny_run):
    """registry/versions.json, committed, holds every registered version's tags and aliases
    as the MLflow store does (no absolute path of the workspace in it)."""
    from mlflow.tracking import MlflowClient

    from flows import registry_record
    ws = tiny_run["ws"]
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    text = (ws / registry_record.RECORD).read_text()
    assert json.loads(text) == registry_record.snapshot(client, ws)
    assert str(ws) not in text
    committed = subprocess.run(["git", "show", f"HEAD:{registry_record.RECORD}"], cwd=ws,
                               capture_output=True, text=True, check=True).stdout
    assert committed == text
    record = json.loads(text)["models"]
    assert [v["version"] for v in record["alignloop-policy"]] == ["1", "2"]
    assert record["alignloop-policy"][1]["aliases"] == ["champion"]
    assert record["alignloop-policy"][1]["tags"]["gate"] == "passed"
