"""The tick deployed to a Prefect work pool and run by a worker: how iterations run on another
machine (here the same one, so the workspace and the code are at the deployed paths)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from flows.schedule import deployment_name
from flows.server import stop_group
from flows.workspace import Workspace
from test_schedule import _ticks, ws  # noqa: F401  (ws: the fixture, a copy of the tiny run)

POOL = "alignloop-test-pool"


def _worker(env: dict[str, str], log: Path) -> subprocess.Popen:
    """`prefect worker start --pool POOL` as a user starts it, in its own process group and
    away from the repository (it finds the code by the deployment's path)."""
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool",
                                 POOL], cwd=log.parent, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, stdin=subprocess.DEVNULL,
                                env={**os.environ, **env, "PREFECT_WORKER_QUERY_SECONDS": "2"})


def _wait_final(client: object, run_id: object, worker: subprocess.Popen,
                timeout: float) -> object:
    """The flow run once its state is final (or the worker died, or time ran out)."""
    deadline = time.monotonic() + timeout
    run = client.read_flow_run(run_id)
    while time.monotonic() < deadline and worker.poll() is None and not (
            run.state and run.state.is_final()):
        time.sleep(2)
        run = client.read_flow_run(run_id)
    return run


def test_work_pool_without_a_server_fails_in_one_line(tmp_path):
    """No PREFECT_API_URL and no server of the workspace's running, or a URL nothing answers:
    exit 2 with one line, and no server started behind the user's back."""
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    args = ("schedule", "--work-pool", POOL, "--cron", "0 3 * * 1", "--workspace", str(tmp_path))
    unset = run_cli(*args, check=False)
    dead = run_cli(*args, check=False, env={"PREFECT_API_URL": "http://127.0.0.1:9/api"})
    assert (unset.returncode, dead.returncode) == (2, 2)
    assert unset.stderr.splitlines() == ["error: a work pool needs a Prefect server (Prefect's "
                                         "temporary one cannot hand runs to a worker): run "
                                         "`alignloop server start` or export PREFECT_API_URL"]
    assert dead.stderr.splitlines() == ["error: no Prefect server answers at "
                                        "http://127.0.0.1:9/api (PREFECT_API_URL)"]
    assert not (tmp_path / ".alignloop" / "prefect-server.json").exists()


@pytest.mark.slow      # a whole extra iteration, run by a worker: minutes
def test_a_worker_runs_the_deployed_tick_and_commits_the_iteration(ws, tmp_path):  # noqa: F811
    """The user's path: `server start`, `schedule --work-pool` (a cron that will not fire
    here), `prefect worker start --pool`, one run of the deployment: the worker's flow run
    commits iteration 3 and registers its policy, under the deployment's one slot."""
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy, StateType
    env = {"PREFECT_HOME": str(ws / ".alignloop" / "prefect")}    # the server's SQLite store
    run_cli("server", "start", "--workspace", str(ws), "--port", "4297", env=env)
    env["PREFECT_API_URL"] = json.loads(
        run_cli("server", "status", "--workspace", str(ws)).stdout)["api_url"]
    worker, log = None, tmp_path / "worker.log"
    try:
        out = run_cli("schedule", "--work-pool", POOL, "--cron", "0 3 * * 1", "--workspace",
                      str(ws), env=env).stdout
        worker = _worker(env, log)
        with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
            dep = client.read_deployment_by_name(
                f"alignloop-tick/{deployment_name(Workspace(ws))}")
            pool = client.read_work_pool(POOL)
            run = _wait_final(client, client.create_flow_run_from_deployment(dep.id).id,
                              worker, timeout=600)
            versions = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}"
                                    ).search_model_versions("name = 'alignloop-policy'")
            v3 = next((v for v in versions if str(v.version) == "3"), None)
            subflow = v3 and client.read_flow_run(v3.tags["prefect_flow_run_id"])
            registered_by = subflow and client.read_task_run(subflow.parent_task_run_id
                                                             ).flow_run_id
    finally:
        if worker is not None:
            stop_group(worker.pid, 30.0)
        run_cli("server", "stop", "--workspace", str(ws), env=env)
    assert f"to work pool {POOL} (process)" in out and f"prefect worker start --pool {POOL}" \
        in out, out
    assert run.state_type == StateType.COMPLETED, (run.state, log.read_text()[-3000:])
    assert pool.type == "process" and dep.work_pool_name == POOL
    assert dep.global_concurrency_limit.limit == 1
    assert dep.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW
    assert dep.parameters == {"workspace": str(ws), "overlap": "skip", "max_runs_per_day": 0}
    assert [s.schedule.cron for s in dep.schedules] == ["0 3 * * 1"]
    log_lines = subprocess.run(["git", "log", "--format=%s"], cwd=ws, capture_output=True,
                               text=True).stdout.splitlines()
    assert "alignloop: iteration 3" in log_lines
    assert [t["outcome"] for t in _ticks(ws) if t.get("iteration") == 3] == ["ran"]
    assert v3 is not None and v3.tags["iteration"] == "3", versions
    assert registered_by == run.id          # by the pipeline subflow of the worker's run
