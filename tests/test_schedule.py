"""Recurring iterations: the tick, the workspace lock, the standalone server and a deployment."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, copy_workspace, run_cli
from flows.schedule import append_iteration, workspace_lock
from flows.workspace import Workspace
from tasks.params import iteration_numbers, parse_params


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture()
def ws(tiny_run, tmp_path) -> Path:
    return copy_workspace(tiny_run["ws"], tmp_path / "ws")


def _ticks(ws: Path) -> list[dict]:
    path = ws / ".alignloop" / "ticks.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_append_iteration_keeps_comments_and_numbering():
    text = (ROOT / "params" / "tiny.yaml").read_text()
    new, k = append_iteration(text)
    assert k == 3
    assert iteration_numbers(parse_params(new)) == [1, 2, 3]
    assert new.count("#") == text.count("#")
    assert '  "3": {prev: 2}\n' in new


def test_two_ticks_fired_at_once_never_interleave(ws):
    procs = [_cli("tick", "--workspace", str(ws), "--overlap", "wait") for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    ran = sorted((t for t in _ticks(ws) if t["outcome"] == "ran"), key=lambda t: t["start"])
    assert [t["iteration"] for t in ran] == [3, 4]
    assert ran[0]["end"] <= ran[1]["start"]                   # one after the other
    assert max(t["waited_s"] for t in ran) > 0                # the second one waited
    log = subprocess.run(["git", "log", "--format=%s"], cwd=ws, capture_output=True,
                         text=True).stdout.splitlines()
    its = [m for m in log if m.startswith("alignloop: iteration")]
    assert its[:2] == ["alignloop: iteration 4", "alignloop: iteration 3"]


def test_overlapping_tick_is_skipped_and_logged(ws):
    before = (ws / "params.yaml").read_text()
    with workspace_lock(Workspace(ws), "skip"):               # an iteration is running
        proc = run_cli("tick", "--workspace", str(ws), "--overlap", "skip")
    assert "tick: skipped" in proc.stdout
    assert _ticks(ws)[-1]["outcome"] == "skipped"
    assert (ws / "params.yaml").read_text() == before


def test_failed_tick_leaves_the_workspace_as_before(ws):
    from mlflow.tracking import MlflowClient
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ws, capture_output=True,
                          text=True).stdout.strip()
    params = (ws / "params.yaml").read_text()
    (ws / "tasks" / "judge.py").write_text("raise SystemExit('judge is broken')\n")
    proc = run_cli("tick", "--workspace", str(ws), check=False)
    assert proc.returncode != 0
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=ws, capture_output=True,
                          text=True).stdout.strip() == head
    assert not subprocess.run(["git", "status", "--porcelain"], cwd=ws, capture_output=True,
                              text=True).stdout.strip()
    assert (ws / "params.yaml").read_text() == params
    assert not (ws / "data" / "iter_3").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    assert len(client.search_model_versions("name = 'alignloop-policy'")) == 2
    assert _ticks(ws)[-1]["outcome"] == "failed"


def test_schedule_serves_a_cron_deployment_on_the_standalone_server(ws):
    up = run_cli("server", "start", "--workspace", str(ws), "--port", "4299")
    info = json.loads(run_cli("server", "status", "--workspace", str(ws)).stdout)
    assert info["api_url"] in up.stdout
    serving = _cli("schedule", "--cron", "0 3 * * 1", "--workspace", str(ws))
    try:
        deadline, found = time.monotonic() + 120, None
        while time.monotonic() < deadline and found is None:
            req = urllib.request.Request(f"{info['api_url']}/deployments/filter", data=b"{}",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                found = next((d for d in json.loads(r.read())
                              if d["name"] == f"alignloop-{ws.name}"), None)
            time.sleep(1)
        assert found is not None, "deployment never appeared"
        crons = [s["schedule"].get("cron") for s in found["schedules"]]
        assert crons == ["0 3 * * 1"]
        assert found["parameters"]["workspace"] == str(ws)
    finally:
        serving.terminate()
        serving.wait(timeout=60)
        run_cli("server", "stop", "--workspace", str(ws))
    assert run_cli("server", "status", "--workspace", str(ws), check=False).returncode == 1
