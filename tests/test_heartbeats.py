"""Flow-run heartbeats (flows/heartbeats.py): the loop that replaces Prefect's still sends the
engine's heartbeat events to the server (a zombie-flow automation reads them) and stops with
the flow. The time it saves is measured side by side, not here:
`python -m benchmarks.cached_rerun DIR --heartbeat-ab`."""
from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import run_cli
from test_schedule import ws  # noqa: F401  (ws: the fixture, a copy of the tiny run)


def test_the_flow_module_installs_our_loop_on_this_prefect():
    from prefect import flow_engine

    from flows import heartbeats, pipeline  # noqa: F401  (pipeline installs it on import)
    assert heartbeats.supported()
    assert flow_engine._send_heartbeats is heartbeats.send_heartbeats


def _heartbeats(api_url: str, flow_run_id: str, timeout: float = 60.0) -> list[dict]:
    """The server's heartbeat events of one flow run (events are persisted in batches)."""
    body = json.dumps({"filter": {"event": {"prefix": ["prefect.flow-run.heartbeat"]},
                                  "resource": {"id": [f"prefect.flow-run.{flow_run_id}"]}},
                       "limit": 50}).encode()
    deadline = time.monotonic() + timeout
    while True:
        req = urllib.request.Request(f"{api_url}/events/filter", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            events = json.loads(r.read())["events"]
        if events or time.monotonic() > deadline:
            return events
        time.sleep(1)


def _messages(client: object, flow_run_id: object, timeout: float = 30.0) -> list[str]:
    """The log messages of one flow run on the server (logs are sent in batches)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    deadline = time.monotonic() + timeout
    while True:
        logs = client.read_logs(log_filter=LogFilter(  # type: ignore[attr-defined]
            flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        if any(m.message.startswith("targets") for m in logs) or time.monotonic() > deadline:
            return [m.message for m in logs]
        time.sleep(1)


# a standalone Prefect server started and a run against it (~30 s)
@pytest.mark.slow
def test_a_run_sends_heartbeats_to_the_workspace_server_and_completes(ws: Path):  # noqa: F811
    """The user's path: `server start`, then `alignloop run` (a cached rerun of the tiny run):
    the flow run completes, and the server holds its heartbeat events."""
    from prefect.client.orchestration import SyncPrefectClient
    env = {"PREFECT_HOME": str(ws / ".alignloop" / "prefect")}    # the server's SQLite store
    run_cli("server", "start", "--workspace", str(ws), "--port", "4299", env=env)
    try:
        env["PREFECT_API_URL"] = json.loads(
            run_cli("server", "status", "--workspace", str(ws)).stdout)["api_url"]
        out = run_cli("run", "--workspace", str(ws), env=env).stdout
        assert "[cached] " in out and "[ran] " not in out
        with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
            runs = [r for r in client.read_flow_runs() if r.name.startswith("alignloop-")]
        assert len(runs) == 1 and runs[0].state is not None and runs[0].state.is_completed()
        events = _heartbeats(env["PREFECT_API_URL"], str(runs[0].id))
        assert events, "no heartbeat of the flow run reached the server"
        assert events[0]["resource"]["prefect.resource.name"] == runs[0].name
        # what a run decides is in its Prefect log: each stage's summary line (the stage
        # process printed it) and the targets block; up-to-date stages are named there only
        out = run_cli("rerun", "gate@2", "--workspace", str(ws), env=env).stdout
        assert "[cached] rollout@1" not in out
        with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
            rerun = max((r for r in client.read_flow_runs() if r.name.startswith("alignloop-")),
                        key=lambda r: r.created)
            messages = _messages(client, rerun.id)
        gate_line = next(line for line in out.splitlines() if line.startswith("gate@2: "))
        assert gate_line in messages and "[cached] rollout@1" in messages
        assert any(m.startswith("targets (iteration 2): ") for m in messages)
    finally:
        run_cli("server", "stop", "--workspace", str(ws), env=env, check=False)
