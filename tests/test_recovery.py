"""Operations that survive reality, through the CLI against real components: a run killed
with -9 at every phase of an iteration and resumed ends with one ledger (one commit, one MLflow
run, one policy and reward-model version per iteration, champion on the latest that passed)
and no debris; the processes of a killed CLI die with it; a second run changes nothing until
it holds the workspace lock; a failed run leaves the workspace byte-identical."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import ROOT, TINY, copy_workspace, run_cli, snapshot
from flows.crashpoints import ENV, POINTS
from flows.schedule import append_iteration


def _git(ws: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=ws, capture_output=True, text=True,
                          check=True).stdout.strip()


def _client(ws: Path):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")


def _ours(ws: Path) -> list[psutil.Process]:
    """Live processes started for this workspace: the CLI's stages and Prefect servers."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.status() == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            env = p.environ()
            if str(ws) in env.get("PREFECT_HOME", "") + env.get("ALIGNLOOP_LOG_FILE", ""):
                found.append(p)
    return found


def _wait_gone(ws: Path, timeout: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout
    while (alive := _ours(ws)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [" ".join(p.cmdline()) for p in alive]


def _stage_processes_gone(ws: Path, timeout: float = 5) -> bool:
    """No stage program, forked stage or fork server of this workspace's runs alive within
    `timeout` (the kernel ends them when the CLI ends: at once, not before it is reaped)."""
    deadline = time.monotonic() + timeout
    while [c for c in _ours(ws) if "tasks." in " ".join(c.cmdline())]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _start(ws: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--workspace", str(ws)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **env}, start_new_session=True)


def _temp_files(ws: Path) -> list[str]:
    return [str(p.relative_to(ws)) for top in ("data", "models", "metrics", "audit")
            for p in (ws / top).rglob(".*") if p.name.endswith(".tmp") or ".old-" in p.name]


@pytest.fixture()
def ws(tiny_run, tmp_path) -> Path:
    return copy_workspace(tiny_run["ws"], tmp_path / "ws")


@pytest.mark.slow      # a whole extra loop through the CLI: minutes
def test_kill_minus_9_at_every_phase_then_resume_converges_on_one_ledger(ws):
    params = ws / "params.yaml"
    params.write_text(append_iteration(params.read_text())[0])      # iteration 3 to run

    # 1. kill -9 of the CLI process alone, inside a stage: its stage and server die with it
    proc = _start(ws)
    cli, deadline, stage = psutil.Process(proc.pid), time.monotonic() + 180, None
    while stage is None and time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            stage = next((c for c in cli.children(recursive=True)
                          if "tasks.stages.rollout" in " ".join(c.cmdline())), None)
        time.sleep(0.05)
    assert stage is not None, proc.communicate()[0][-3000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _wait_gone(ws) == []

    # 2. a crash at each write of the record step, each run resuming the one before
    run_cli("server", "start", "--workspace", str(ws))     # ~2 s per run instead of ~8
    try:
        for point in POINTS:
            crashed = _start(ws, **{ENV: f"{point}@3"})
            out = crashed.communicate(timeout=600)[0]
            assert crashed.returncode == -signal.SIGKILL, f"{point}: {out[-3000:]}"
            assert _stage_processes_gone(ws), point
        final = run_cli("run", "--workspace", str(ws))
    finally:
        run_cli("server", "stop", "--workspace", str(ws), check=False)
    assert "iteration 3: policy v3, reward model v3" in final.stdout

    # 3. one ledger: commits, MLflow runs, versions, champion, lineage; no debris
    subjects = _git(ws, "log", "--format=%s").splitlines()
    assert subjects.count("alignloop: iteration 3") == 1, subjects
    assert _git(ws, "rev-parse", "iteration-3^{commit}") in _git(ws, "log", "--format=%H")
    assert _git(ws, "status", "--porcelain") == ""
    client = _client(ws)
    exp = client.get_experiment_by_name("alignloop")
    parents = [r for r in client.search_runs([exp.experiment_id])
               if "mlflow.parentRunId" not in r.data.tags and "alignloop.iteration" in r.data.tags]
    keys = [(r.data.tags["alignloop.iteration"], r.data.tags["alignloop.lock_fingerprint"])
            for r in parents]
    assert len(keys) == len(set(keys)), keys          # one run per iteration and set of bytes
    assert [k for k, _ in keys].count("3") == 1
    assert all(r.data.tags.get("alignloop.record") == "done" for r in parents)
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    for model, stage in (("alignloop-policy", "update"), ("alignloop-reward-model", "train_rm")):
        versions = client.search_model_versions(f"name = '{model}'")
        md5s = [v.tags["model_md5"] for v in versions]
        assert len(md5s) == len(set(md5s)), model     # never the same bytes twice
        held = {out["md5"] for k in (1, 2, 3) for out in lock[f"{stage}@{k}"]["outs"]
                if out["path"].startswith("models/")}
        assert held <= set(md5s), model               # every iteration's model registered
        assert [v.tags["iteration"] for v in versions].count("3") == 1, model
    passed = [k for k in (1, 2, 3) if json.loads(
        (ws / f"metrics/iter_{k}/gate_decision.json").read_text())["passed"]]
    champion = client.get_model_version_by_alias("alignloop-policy", "champion")
    assert champion.tags["iteration"] == str(max(passed))
    moves = [json.loads(x) for x in (ws / "registry/aliases.jsonl").read_text().splitlines()]
    moves = [(m["from"], m["to"]) for m in moves if m["alias"] == "champion"]
    assert len(moves) == len(set(moves)), moves                # no move recorded twice
    assert all(r.data.tags.get("alignloop.pushed") for r in parents)
    verify = run_cli("lineage", "models:/alignloop-policy@champion", "--verify",
                     "--workspace", str(ws))
    assert "verify: ok" in verify.stdout
    assert _temp_files(ws) == []
    assert _wait_gone(ws) == []


def test_an_output_a_killed_stage_finished_is_cleared_before_the_next_run_stages_anything(ws):
    """A stage may finish its write in the half second between the CLI's kill -9 and its own
    exit: its output is on disk, no dvc.lock entry vouches for it and no .gitignore names it.
    The next run clears it before its record step's `git add -A` could stage it into git (DVC
    then refuses the stage: "already tracked by SCM")."""
    from flows import workspace as wsmod
    params = ws / "params.yaml"
    params.write_text(append_iteration(params.read_text())[0])      # iteration 3 declared
    wsmod.prepare(ws, None)                                          # as the killed run synced it
    (ws / "data" / "iter_3").mkdir(parents=True)
    (ws / "data" / "iter_3" / "rollouts.jsonl").write_text('{"prompt": "x"}\n')
    (ws / "data" / "notes.txt").write_text("a person's own file, no stage's output\n")
    crashed = _start(ws, **{ENV: "git_commit@0"})       # killed right after the first `git add`
    out = crashed.communicate(timeout=300)[0]
    assert crashed.returncode == -signal.SIGKILL, out[-3000:]
    staged = _git(ws, "diff", "--cached", "--name-only").splitlines()
    assert "data/iter_3/rollouts.jsonl" not in staged, staged
    assert not (ws / "data" / "iter_3" / "rollouts.jsonl").exists()
    assert (ws / "data" / "notes.txt").read_text().startswith("a person's own file")
    assert _wait_gone(ws) == []


@pytest.mark.slow      # a whole extra loop through the CLI: minutes
def test_second_run_changes_nothing_until_it_holds_the_lock(ws, tmp_path):
    profiles = []
    for i, bootstrap in enumerate((300, 400)):
        data = yaml.safe_load(TINY.read_text())
        data["evaluate"]["bootstrap"] = bootstrap
        path = tmp_path / f"p{i}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        profiles.append(path)
    first = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--params",
                              str(profiles[0]), "--workspace", str(ws)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120             # the first run syncs its params, then
    while time.monotonic() < deadline and \
            yaml.safe_load((ws / "params.yaml").read_text())["evaluate"]["bootstrap"] != 300:
        time.sleep(0.05)                          # runs its stages: the second starts now
    second = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--params",
                               str(profiles[1]), "--workspace", str(ws)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out1 = first.communicate(timeout=600)[0]
    out2 = second.communicate(timeout=600)[0]
    assert first.returncode == 0 and second.returncode == 0, out1[-2000:] + out2[-2000:]
    commits = _git(ws, "log", "--format=%H %s").splitlines()
    ours = [c.split()[0] for c in commits if "iteration 2" in c][:2]     # newest first
    assert len(ours) == 2, commits
    seen = [yaml.safe_load(_git(ws, "show", f"{c}:params.yaml"))["evaluate"]["bootstrap"]
            for c in reversed(ours)]
    assert seen == [300, 400]                     # each run's commit holds its own params


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def _one_line_failure(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return errors[0]


def test_bad_audit_label_fails_in_one_line_and_leaves_the_workspace_byte_identical(ws):
    head = _git(ws, "rev-parse", "HEAD")
    labels = ws / "audit" / "labels.jsonl"
    labels.write_text('{"pair_id": "x", "verdict": "chosen_ok"}\n'
                      '{"pair_id": "y", "verdict": "maybe"}\n')
    before = snapshot(ws, cache=False)            # the person's edit is part of "before"
    line = _one_line_failure(run_cli("run", "--workspace", str(ws), check=False))
    assert "audit/labels.jsonl:2" in line and "verdict" in line, line
    assert "stage judge@1 failed" in line     # the first reader: judge/audit_agreement
    assert snapshot(ws, cache=False) == before
    assert _git(ws, "rev-parse", "HEAD") == head


def test_stores_are_private_and_nothing_in_the_workspace_is_world_writable(tiny_run):
    ws = tiny_run["ws"]
    assert (ws / ".alignloop").stat().st_mode & 0o777 == 0o700
    assert (ws / ".alignloop" / "mlflow.db").stat().st_mode & 0o077 == 0
    writable = [str(p) for p in [ws, *ws.rglob("*")]
                if not p.is_symlink() and p.stat().st_mode & 0o002]
    assert writable == []


def test_truncated_model_weights_fail_in_one_line_and_leave_the_workspace_byte_identical(
        ws, tmp_path, tmp_path_factory):
    from tasks.models.tiny_model import CACHE_ENV
    from tasks.models.tiny_model import tokenizer as smollm2_tokenizer
    from test_own_model import save_own_model
    tok = smollm2_tokenizer(Path(os.environ.get(CACHE_ENV)
                                 or tmp_path_factory.getbasetemp() / "tokenizer-cache"))
    src = tmp_path / "my-llama"
    save_own_model(src, tok)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])   # cut short
    profile = tmp_path / "own.yaml"
    profile.write_text(TINY.read_text().replace("  source: tiny\n", "  source: hf_dir\n", 1)
                       .replace('  path: ""', f'  path: "{src}"', 1))
    before, head = snapshot(ws, cache=False), _git(ws, "rev-parse", "HEAD")
    line = _one_line_failure(run_cli("run", "--params", str(profile), "--workspace", str(ws),
                                     check=False))
    assert "stage prepare_model failed" in line and f"{weights}: unreadable weights" in line
    assert snapshot(ws, cache=False) == before       # params.yaml is the old profile's again
    assert _git(ws, "rev-parse", "HEAD") == head


@pytest.mark.slow      # a tick: one whole extra iteration through the CLI
def test_a_tick_clears_an_output_a_killed_stage_finished_before_it_appends_its_iteration(ws):
    """The tick path clears what a killed run left, as `alignloop run` does: iteration 3's
    rollouts, written by a stage that outlived its CLI, neither reach git nor stop the tick."""
    (ws / "data" / "iter_3").mkdir(parents=True)
    (ws / "data" / "iter_3" / "rollouts.jsonl").write_text('{"prompt": "x"}\n')
    tick = run_cli("tick", "--workspace", str(ws))
    assert "[ran] rollout@3" in tick.stdout, tick.stdout[-3000:]
    assert "alignloop: iteration 3" in _git(ws, "log", "--format=%s").splitlines()
    assert _git(ws, "ls-files", "data/iter_3") == "data/iter_3/.gitignore"   # DVC's outputs
    assert _git(ws, "status", "--porcelain") == ""
