"""What a person who never opens a terminal sees of a run: read through MLflow's and Prefect's
APIs only, as their UIs do, on the session's tiny workspace."""
from __future__ import annotations

import json
import urllib.request

import yaml

from conftest import run_cli
from flows.dag import ordered_stages


def _client(ws):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")


def _runs(ws):
    client = _client(ws)
    exp = client.get_experiment_by_name("alignloop")
    return client, exp, client.search_runs([exp.experiment_id], max_results=1000)


def test_experiment_is_marked_for_model_training(tiny_run):
    _, exp, _ = _runs(tiny_run["ws"])
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


def test_every_stage_run_lists_its_inputs_as_datasets_with_dvc_md5_digests(tiny_run):
    ws = tiny_run["ws"]
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    _, _, runs = _runs(ws)
    stage_runs = {r.data.tags["alignloop.dvc_stage"]: r for r in runs
                  if "alignloop.dvc_stage" in r.data.tags}
    assert set(stage_runs) == set(lock)
    remote = (ws / ".alignloop" / "dvc-remote").as_uri()
    for name, run in stage_runs.items():
        want = {d["path"]: d["md5"] for d in lock[name]["deps"]
                if not d["path"].startswith("tasks/")}
        got = {d.dataset.name: d.dataset.digest for d in run.inputs.dataset_inputs}
        assert got == want, name
        for d in run.inputs.dataset_inputs:
            md5 = d.dataset.digest
            assert json.loads(d.dataset.source)["uri"] == \
                f"{remote}/files/md5/{md5[:2]}/{md5[2:]}", name
        assert len(run.data.tags["alignloop.code_md5"]) == 32
        assert not [k for k in run.data.tags if k.startswith("alignloop.dep:")]
        assert run.info.end_time - run.info.start_time > 0, name    # real stage times


def test_win_rate_curve_has_one_point_per_iteration(tiny_run):
    client, _, runs = _runs(tiny_run["ws"])
    loop = [r for r in runs if r.data.tags.get("alignloop.loop") == "true"]
    assert len(loop) == 1
    iterations = sorted({s.iteration for s in ordered_stages(tiny_run["ws"])} - {0})
    for key in ("eval/win_rate", "eval/gold_win_rate", "eval/kl", "rm/accuracy"):
        history = client.get_metric_history(loop[0].info.run_id, key)
        assert sorted(m.step for m in history) == iterations, key
    report = json.loads(run_cli("report", "--json", "--workspace", str(tiny_run["ws"])).stdout)
    history = client.get_metric_history(loop[0].info.run_id, "eval/win_rate")
    assert {str(m.step): m.value for m in history} == \
        {k: v["eval/win_rate"] for k, v in report.items() if k != "0"}


def test_policy_version_links_its_parent_and_reward_model(tiny_run):
    client = _client(tiny_run["ws"])
    v2 = client.get_model_version("alignloop-policy", "2")
    assert v2.tags["parent_policy_uri"] == "models:/alignloop-policy/1"
    parent = client.get_model_version("alignloop-policy", v2.tags["parent_policy_uri"][-1])
    assert parent.tags["iteration"] == "1"
    assert "(#/models/alignloop-policy/versions/1)" in v2.description
    rm = v2.tags["reward_model_uri"].rsplit("/", 1)[1]
    assert f"(#/models/alignloop-reward-model/versions/{rm})" in v2.description


def test_prefect_flow_run_logs_hold_every_stage_result_line(tiny_run):
    ws = tiny_run["ws"]
    _, _, runs = _runs(ws)
    flow_run = next(r.data.tags["alignloop.prefect_flow_run_id"] for r in runs
                    if r.data.tags.get("alignloop.iteration") == "2"
                    and "mlflow.parentRunId" not in r.data.tags)
    run_cli("server", "start", "--workspace", str(ws), "--port", "4298")
    try:
        api = json.loads(run_cli("server", "status", "--workspace", str(ws)).stdout)["api_url"]
        body = json.dumps({"logs": {"flow_run_id": {"any_": [flow_run]}}, "limit": 200})
        req = urllib.request.Request(f"{api}/logs/filter", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            messages = [x["message"] for x in json.loads(r.read())]
    finally:
        run_cli("server", "stop", "--workspace", str(ws), check=False)
    for stage in ordered_stages(ws):
        assert any(m.startswith(f"[ran] {stage.name} (") for m in messages), stage.name
    printed = tiny_run["first"].stdout.splitlines()     # each stage's summary, as it printed it
    for prefix in ("prompts: ", "train_rm@2: ", "update@2: ", "gate@2: ", "report: "):
        line = next(x for x in printed if x.startswith(prefix))
        assert line in messages, prefix
    assert any(m.startswith("targets (iteration 2): ") for m in messages)


def test_stage_runs_that_ran_torch_record_the_resolved_device(tiny_run):
    """`device: auto` in the params; the device it resolved to is a tag of each stage run
    that declares the param (cpu here: no CUDA), and of no other."""
    import torch
    ws = tiny_run["ws"]
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    _, _, runs = _runs(ws)
    want = "cuda" if torch.cuda.is_available() else "cpu"
    seen = set()
    for run in runs:
        name = run.data.tags.get("alignloop.dvc_stage")
        if name is None or run.data.tags.get("alignloop.outcome") != "ran":
            continue
        declares = "device" in lock[name].get("params", {}).get("params.yaml", {})  # report: none
        assert run.data.tags.get("alignloop.device") == (want if declares else None), name
        assert run.data.params.get("device") == ("auto" if declares else None), name
        seen.add(name.partition("@")[0])
    assert {"rollout", "update", "evaluate", "train_rm"} <= seen
