"""Recurring iterations: the tick, the workspace lock, the standalone server, a deployment and
its fires."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, copy_workspace, run_cli
from flows.schedule import append_iteration, deployment_name, workspace_lock
from flows.workspace import Workspace
from tasks.config.params import iteration_numbers, parse_params


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
    assert new.count("#") == text.count("#") + 1
    assert '  "3": {prev: 2}   # the champion\'s\n' in new
    new, k = append_iteration(new, prev=1)            # 3 was not promoted: 4 builds on 1
    assert parse_params(new).iterations["4"].prev == 1


@pytest.mark.slow      # two whole extra iterations through the CLI: minutes
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
        t0 = time.monotonic()
        proc = run_cli("tick", "--workspace", str(ws), "--overlap", "skip")
        seconds = time.monotonic() - t0
    assert "tick: skipped" in proc.stdout
    assert seconds < 12, f"a skipped tick took {seconds:.1f} s"   # no flow run, no pipeline
    assert _ticks(ws)[-1]["outcome"] == "skipped"
    assert (ws / "params.yaml").read_text() == before


def test_failed_tick_leaves_the_workspace_as_before(ws):
    from mlflow.tracking import MlflowClient
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ws, capture_output=True,
                          text=True).stdout.strip()
    params = (ws / "params.yaml").read_text()
    (ws / "tasks" / "stages" / "judge.py").write_text("raise SystemExit('judge is broken')\n")
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


PICKLED_TICK = """
import sys, cloudpickle
from prefect.exceptions import ParameterTypeError
tick = cloudpickle.loads(sys.stdin.buffer.read())
print(tick.validate_parameters({"workspace": "/w", "overlap": "skip"}))
try:
    tick.validate_parameters({"workspace": "/w", "overlap": "sometimes"})
except ParameterTypeError:
    print("rejected")
print(sorted({"flows.pipeline", "mlflow", "dvc", "torch"} & set(sys.modules)))
"""


def test_tick_parameters_validate_in_a_fresh_process_as_a_served_fire_does():
    """A served fire runs the flow from a cloudpickled copy in a new interpreter and validates
    its parameters there: string annotations that need the module's globals fail there (every
    fire FAILED), and the copy must not drag in the pipeline's imports (a skip stays cheap)."""
    import cloudpickle

    from flows.schedule import tick
    proc = subprocess.run([sys.executable, "-c", PICKLED_TICK], input=cloudpickle.dumps(tick),
                          capture_output=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    out = proc.stdout.decode().splitlines()
    assert out == ["{'workspace': '/w', 'overlap': 'skip', 'max_runs_per_day': 0}",
                   "rejected", "[]"]


class Served:
    """`alignloop schedule ...` in its own process group, and the Prefect API it serves on."""

    def __init__(self, ws: Path, api_url: str, env: dict[str, str], log: Path, *args: str):
        self.ws, self.api_url, self.log = ws, api_url, log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flows.cli", "schedule", *args, "--workspace", str(ws)],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **env, "PREFECT_RUNNER_POLL_FREQUENCY": "2"})

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient
        return SyncPrefectClient(self.api_url)

    def deployment(self, until=lambda d: True, timeout: float = 90):
        """The served deployment, once it exists and `until(it)` holds."""
        from prefect.exceptions import ObjectNotFound
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    dep = client.read_deployment_by_name(
                        f"alignloop-tick/{deployment_name(Workspace(self.ws))}")
                    if until(dep):
                        return dep
                except ObjectNotFound:
                    pass
                time.sleep(1)
        raise AssertionError(f"no deployment (serving exited {self.proc.poll()})\n{self.tail()}")

    def flow_runs(self, deployment_id: object) -> list:
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
        with self.client() as client:
            return client.read_flow_runs(deployment_filter=DeploymentFilter(
                id=DeploymentFilterId(any_=[deployment_id])))

    def states(self, flow_run_id: object) -> list:
        with self.client() as client:
            return client.read_flow_run_states(flow_run_id)

    def parent_flow_run(self, flow_run_id: str) -> object:
        """The flow run a subflow run was called from."""
        with self.client() as client:
            task_run = client.read_flow_run(flow_run_id).parent_task_run_id
            return task_run and client.read_task_run(task_run).flow_run_id

    def wait_for_runs_to_exit(self, timeout: float = 60) -> None:
        """Until no flow-run process of the runner is left (it cancels those still running
        when it stops, even a run whose flow already returned)."""
        import psutil
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                kids = psutil.Process(self.proc.pid).children(recursive=True)
                if not any("spawn_main" in " ".join(k.cmdline()) for k in kids):
                    return
            except psutil.Error:
                return
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)

    def tail(self) -> str:
        return self.log.read_text()[-3000:]


@pytest.mark.slow      # a whole extra loop through the CLI: minutes
def test_served_fires_run_a_tick_and_cancel_the_overlapping_one(ws, tmp_path):
    """The user's path: `server start`, then `schedule --interval 10` (overlap skip) against it.
    The first fire runs iteration 3 to the end (commit, policy v3 registered by that flow run);
    fires while it runs are CANCELLED by the deployment's concurrency limit, none FAILED. Then
    `schedule --cron ... --overlap wait` puts the cron schedule and the ENQUEUE limit on it."""
    from mlflow.tracking import MlflowClient
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy, StateType
    env = {"PREFECT_HOME": str(ws / ".alignloop" / "prefect")}    # the server's SQLite store
    up = run_cli("server", "start", "--workspace", str(ws), "--port", "4298", env=env)
    api_url = json.loads(run_cli("server", "status", "--workspace", str(ws)).stdout)["api_url"]
    assert api_url in up.stdout
    served = Served(ws, api_url, env, tmp_path / "interval.log", "--interval", "10",
                    "--overlap", "skip")
    try:
        dep = served.deployment()
        deadline, types, paused = time.monotonic() + 420, set(), False
        while time.monotonic() < deadline and served.proc.poll() is None and not (
                {StateType.FAILED, StateType.CRASHED} & types
                or {StateType.COMPLETED, StateType.CANCELLED} <= types):
            time.sleep(2)
            types = {r.state_type for r in served.flow_runs(dep.id)}
            if StateType.CANCELLED in types and not paused:   # two fires seen: no third
                with served.client() as client:
                    client.pause_deployment(dep.id)           # (deletes the runs scheduled)
                paused = True
        served.wait_for_runs_to_exit()
        served.stop()
        runs = served.flow_runs(dep.id)
        versions = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}"
                                ).search_model_versions("name = 'alignloop-policy'")
        v3 = next((v for v in versions if str(v.version) == "3"), None)
        registered_by = v3 and served.parent_flow_run(v3.tags["prefect_flow_run_id"])
        took_slot = min((s.timestamp for r in runs if r.state_type == StateType.COMPLETED
                         for s in served.states(r.id) if s.type == StateType.PENDING),
                        default=None)
        served = Served(ws, api_url, env, tmp_path / "cron.log", "--cron", "0 3 * * 1",
                        "--overlap", "wait")
        cron = served.deployment(until=lambda d: [getattr(s.schedule, "cron", None)
                                                  for s in d.schedules]
                                 == ["0 3 * * 1"])
    finally:
        served.stop()
        run_cli("server", "stop", "--workspace", str(ws), env=env)
    assert run_cli("server", "status", "--workspace", str(ws), check=False).returncode == 1
    assert (ws / ".alignloop" / "prefect" / "prefect.db").is_file()
    out = (tmp_path / "interval.log").read_text()[-3000:]
    states = [(r.name, r.state_name, r.state and r.state.message) for r in runs]
    assert not [r for r in runs if r.state_type in (StateType.FAILED, StateType.CRASHED)], \
        (states, out)
    ran = [r for r in runs if r.state_type == StateType.COMPLETED]
    cancelled = [r for r in runs if r.state_type == StateType.CANCELLED]
    assert len(ran) == 1 and cancelled, (states, out)
    first = ran[0]
    assert first.state_name == "Completed", states
    # the fire that found the slot taken: after the first run took it (PENDING, which comes
    # before its RUNNING by a process start and the flow's imports) and before it ended
    assert any(took_slot < r.state.timestamp < first.end_time for r in cancelled), \
        (took_slot, first.end_time, [r.state.timestamp for r in cancelled])
    assert {r.state.message for r in cancelled} == {"Deployment concurrency limit reached."}
    assert dep.global_concurrency_limit.limit == 1
    assert dep.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW
    assert cron.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.ENQUEUE
    assert cron.parameters == {"workspace": str(ws), "overlap": "wait", "max_runs_per_day": 0}
    assert not cron.paused                  # serving again resumes a paused schedule
    log = subprocess.run(["git", "log", "--format=%s"], cwd=ws, capture_output=True,
                         text=True).stdout.splitlines()
    assert "alignloop: iteration 3" in log
    assert [t["outcome"] for t in _ticks(ws) if t.get("iteration") == 3] == ["ran"]
    assert v3 is not None and v3.tags["iteration"] == "3", versions
    assert registered_by == first.id        # by the pipeline subflow of that served tick

