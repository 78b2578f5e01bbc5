"""What users do every week, against real components: rerun from cached artifacts, promote,
deploy and roll back, and audit lineage back to the bytes (with tampering caught)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import copy_workspace, ran_stages, run_cli, set_params, snapshot


@pytest.fixture()
def ws(tiny_run, tmp_path) -> Path:
    return copy_workspace(tiny_run["ws"], tmp_path / "ws")


def _set_param(ws: Path, section: str, key: str, value: object) -> None:
    set_params(ws / "params.yaml", **{f"{section}__{key}": value})


def _run(ws: Path) -> subprocess.CompletedProcess:
    return run_cli("run", "--workspace", str(ws))      # keeps the workspace's params.yaml


def _changed(ws: Path) -> dict[str, list[str]]:
    """`alignloop status --json`: the stage instances that are not up to date, and why."""
    status = json.loads(run_cli("status", "--workspace", str(ws), "--json", check=False).stdout)
    return {s["stage"]: s["reasons"] for s in status if s["state"] != "up-to-date"}


# a whole rerun of both evaluations: the fast suite checks which stages a param edit reruns
# by `dvc status` (tests/test_stage_contract.py)
@pytest.mark.slow
def test_evaluate_param_reruns_only_evaluation(ws):
    _set_param(ws, "evaluate", "bootstrap", 300)
    changed = _changed(ws)
    # and the gates, whose violation check bootstraps its paired increase with that count
    assert set(changed) == {"evaluate@1", "evaluate@2", "gate@1", "gate@2"}
    assert changed["evaluate@1"] == ["param evaluate.bootstrap: 500 -> 300"]   # old -> new
    assert changed["gate@1"] == ["param evaluate.bootstrap: 500 -> 300"]
    moves = (ws / "registry" / "aliases.jsonl").read_text()
    ran = ran_stages(_run(ws).stdout)
    assert {s for s in ran if not s.startswith("gate@")} == {"evaluate@1", "evaluate@2",
                                                             "report"}   # what it shows changed
    # gate@1 and gate@2 reran: champion stays on the latest passing iteration, never moving
    # back to v1 and forward again (two moves, two commits, v1 left if stopped between them)
    assert (ws / "registry" / "aliases.jsonl").read_text() == moves


def test_status_names_an_rm_param_change_on_rm_training_only(ws):
    _set_param(ws, "train_rm", "lr", 0.002)
    changed = _changed(ws)
    assert changed == {"train_rm@1": ["param train_rm.lr: 0.001 -> 0.002"],
                       "train_rm@2": ["param train_rm.lr: 0.001 -> 0.002"]}


@pytest.mark.slow      # reruns 12 of the 16 stage instances: a whole extra loop, nearly
def test_rm_param_reruns_rm_training_and_what_follows_only(ws):
    _set_param(ws, "train_rm", "lr", 0.002)
    ran = ran_stages(_run(ws).stdout)
    assert "train_rm@1" in ran and "train_rm@2" in ran
    upstream = {"prompts", "prepare_model", "collect_offpolicy", "reference_samples",
                "rollout@1", "judge@1"}
    assert not upstream & set(ran)
    # DPO on the judge's pairs never reads the RM: the updates stay (tasks/config/conditions.py)
    assert "evaluate@1" in ran and not [s for s in ran if s.startswith("update@")]


def test_deleted_output_is_restored_from_the_cache_without_recomputing(ws):
    path = ws / "data" / "iter_1" / "rollouts.jsonl"
    data = path.read_bytes()
    path.unlink()
    out = _run(ws).stdout
    assert "[restored] rollout@1" in out and "[ran]" not in out
    assert path.read_bytes() == data


def test_rerun_one_stage_and_downstream(ws):
    out = run_cli("rerun", "train_rm@2", "--workspace", str(ws)).stdout
    # same bytes again: no model or data downstream moves; the report does, since the targets
    # it shows (metrics/targets.json) hold the loop's minutes, and train_rm@2 took new ones
    assert ran_stages(out) == ["train_rm@2", "report"]
    out = run_cli("rerun", "update@2", "--downstream", "--workspace", str(ws)).stdout
    assert ran_stages(out) == ["update@2", "evaluate@2", "gate@2", "report"]
    bad = run_cli("rerun", "nope@9", "--workspace", str(ws), check=False)
    assert bad.returncode == 2 and "nope@9: no such stage instance" in bad.stderr


def test_gate_deploy_rollback_are_recorded(ws):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    champion = client.get_model_version_by_alias("alignloop-policy", "champion")
    assert champion.tags["gate"] == "passed"
    run_cli("deploy", "--workspace", str(ws), "--reason", "first")     # the champion
    run_cli("deploy", "1", "--workspace", str(ws), "--reason", "try v1")
    assert client.get_model_version_by_alias("alignloop-policy", "production").version \
        in (1, "1")
    run_cli("rollback", "--workspace", str(ws), "--reason", "v1 regressed")
    prod = client.get_model_version_by_alias("alignloop-policy", "production")
    assert str(prod.version) == str(champion.version)
    ledger = [json.loads(x) for x in (ws / "registry" / "aliases.jsonl").read_text().splitlines()]
    moves = [(e["action"], e["from"], e["to"], e["why"]) for e in ledger
             if e["alias"] == "production"]
    assert moves == [("deploy", None, str(champion.version), "first"),
                     ("deploy", str(champion.version), "1", "try v1"),
                     ("rollback", "1", str(champion.version), "v1 regressed")]
    assert all(e["who"] and e["time"] for e in ledger)
    log = subprocess.run(["git", "log", "--format=%s", "-3"], cwd=ws, capture_output=True,
                         text=True).stdout
    assert "production -> v" in log
    tree = json.loads(run_cli("lineage", "models:/alignloop-policy@production", "--workspace",
                              str(ws), "--json").stdout)
    assert "v1 regressed" in tree["alias_history"]["alias.production.last_set"]
    again = run_cli("rollback", "--workspace", str(ws), check=False)   # one version left
    assert again.returncode == 2 and "nothing to roll back" in again.stderr


def _walk_stages(node: dict) -> set[str]:
    names = {node["stage"]}
    for i in node["inputs"]:
        if isinstance(i["produced_by"], dict) and "inputs" in i["produced_by"]:
            names |= _walk_stages(i["produced_by"])
    return names


def test_lineage_reaches_initial_model_and_first_data(ws):
    tree = json.loads(run_cli("lineage", "models:/alignloop-policy/2", "--workspace", str(ws),
                              "--json").stdout)
    assert tree["dvc_stage"] == "update@2" and tree["git_commit"]
    stages = _walk_stages(tree["produced_by"])
    assert {"prepare_model", "collect_offpolicy", "prompts", "judge@1", "rollout@1"} <= stages
    assert tree["parent_policy"]["version"] == "1"
    assert tree["parent_policy"]["parent_policy"] == "initial"
    assert tree["reward_model"]["dvc_stage"] == "train_rm@2"
    pairs = next(i for i in tree["produced_by"]["inputs"] if i["path"] == "data/iter_2/pairs.jsonl")
    assert pairs["rows"] > 0 and pairs["size"] > 0 and len(pairs["md5"]) == 32
    assert tree["produced_by"]["params"]["update"]["algo"] == "dpo"


def test_verify_passes_then_names_a_tampered_dataset(ws):
    ok = run_cli("lineage", "models:/alignloop-policy@champion", "--workspace", str(ws),
                 "--verify")
    assert "verify: ok" in ok.stdout
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    md5 = next(o["md5"] for o in lock["judge@1"]["outs"] if o["path"] == "data/iter_1/pairs.jsonl")
    obj = ws / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
    obj.chmod(0o644)
    data = bytearray(obj.read_bytes())
    data[10] ^= 0x01                                   # one byte
    obj.write_bytes(bytes(data))
    bad = run_cli("lineage", "models:/alignloop-policy@champion", "--workspace", str(ws),
                  "--verify", check=False)
    assert bad.returncode == 1
    assert "data/iter_1/pairs.jsonl" in bad.stderr and "in cache: altered" in bad.stderr


def test_a_clone_audits_the_champion_with_the_source_workspace_gone(tiny_run, tmp_path):
    """A colleague's clone on another directory: git clone, the team's remote named as theirs
    (the default remote lives inside each workspace), dvc pull; then the source workspace is
    removed. `lineage` traces the champion back to the data bytes from the registry's record in
    git (no MLflow store travels, none is created), and --verify re-hashes every artifact."""
    import shutil
    src = copy_workspace(tiny_run["ws"], tmp_path / "src")
    remote = tmp_path / "team-remote"
    shutil.move(src / ".alignloop" / "dvc-remote", remote)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(src), str(clone)], check=True)
    assert "url = ../.alignloop/dvc-remote\n" in (clone / ".dvc" / "config").read_text()
    dvc = [sys.executable, "-m", "dvc"]
    subprocess.run([*dvc, "remote", "add", "--local", "-d", "origin", str(remote)], cwd=clone,
                   check=True)
    subprocess.run([*dvc, "pull", "-q"], cwd=clone, check=True)
    assert snapshot(clone)["data/iter_2/pairs.jsonl"] == snapshot(src)["data/iter_2/pairs.jsonl"]
    in_src = json.loads(run_cli("lineage", "models:/alignloop-policy@champion", "--workspace",
                                str(src), "--json").stdout)
    shutil.rmtree(src)
    out = run_cli("lineage", "models:/alignloop-policy@champion", "--workspace", str(clone),
                  "--verify")
    assert "lineage: from the registry record registry/versions.json at commit " in out.stderr
    head = out.stdout.splitlines()[0]
    assert head.startswith(f"alignloop-policy v{in_src['version']} ['champion'] md5 "
                           f"{in_src['model_md5']}")
    assert "input data/iter_2/pairs.jsonl md5 " in out.stdout          # back to the data bytes
    assert f"re-hashed from the cache ({clone}/.dvc/cache/files/md5) and remote 'origin' " \
           f"({remote})" in out.stdout and "verify: ok" in out.stdout
    tree = json.loads(run_cli("lineage", "models:/alignloop-policy@champion", "--workspace",
                              str(clone), "--json").stdout)
    same = ("version", "model_md5", "git_commit", "dvc_stage", "judge", "produced_by",
            "reward_model")
    assert {k: tree[k] for k in same} == {k: in_src[k] for k in same}
    assert tree["parent_policy"]["version"] == in_src["parent_policy"]["version"]
    assert not (clone / ".alignloop" / "mlflow.db").exists()
    bad = run_cli("lineage", "models:/alignloop-policy@production", "--workspace", str(clone),
                  check=False)
    assert bad.returncode == 2 and "alignloop-policy has no alias production (aliases: " \
        f"champion -> v{in_src['version']})" in bad.stderr and "Traceback" not in bad.stderr


def test_verify_fails_naming_a_remote_it_cannot_reach_unless_skipped(ws):
    """The default remote deleted: --verify exits 1 naming it, never "ok" for a store it did
    not check; --skip-remote checks the cache and git only and says so."""
    import shutil
    shutil.rmtree(ws / ".alignloop" / "dvc-remote")
    bad = run_cli("lineage", "models:/alignloop-policy@champion", "--workspace", str(ws),
                  "--verify", check=False)
    assert bad.returncode == 1
    assert f"verify: FAILED remote 'local' at {ws}/.alignloop/dvc-remote: unreachable (no " \
           "such directory)\n" in bad.stderr
    assert "verify: FAILED: " in bad.stdout and "verify: ok" not in bad.stdout
    skipped = run_cli("lineage", "models:/alignloop-policy@champion", "--workspace", str(ws),
                      "--verify", "--skip-remote")
    assert "verify: ok: " in skipped.stdout and "the remote skipped (--skip-remote)" in \
        skipped.stdout and "remote 'local'" not in skipped.stdout


@pytest.mark.slow      # a whole extra loop through the CLI in the copy
def test_a_copy_of_an_old_workspace_takes_its_own_remote(ws, tmp_path):
    """A workspace made when the default remote was named by absolute path: its copy, at its
    next run, names its own remote again (relative), and pushes nothing into the original's."""
    config = ws / ".dvc" / "config"
    original = tmp_path / "original"
    config.write_text(config.read_text().replace(
        "url = ../.alignloop/dvc-remote", f"url = {original}/.alignloop/dvc-remote"))
    _set_param(ws, "evaluate", "bootstrap", 300)
    _run(ws)
    assert "url = ../.alignloop/dvc-remote\n" in config.read_text()
    assert not original.exists()


@pytest.mark.parametrize("uri, line", [
    ("models:/alignloop-policy@production",
     "alignloop-policy has no alias production (aliases: champion -> v2)"),
    ("models:/alignloop-policy/9", "alignloop-policy has no such version (versions: 1, 2)"),
    ("models:/alignloop-polcy@champion", "no registered model alignloop-polcy (registered: "
                                         "alignloop-policy, alignloop-reward-model)")])
def test_lineage_of_what_is_not_registered_is_one_line_naming_what_is(ws, uri, line):
    out = run_cli("lineage", uri, "--workspace", str(ws), check=False)
    assert out.returncode == 2 and out.stderr == f"error: {uri}: {line}\n"


