"""A local OpenAI-compatible judge server: `transformers serve` on loopback, pinned to one model.

`alignloop judge-server start --model DIR` runs it in its own session (it outlives the CLI),
with its pid, port and log under the workspace's `.alignloop/` (judge-server.json,
judge-server.log), and waits until /health answers. Point the http judge at it with
`export ALIGNLOOP_JUDGE_URL=http://127.0.0.1:PORT/v1`; with `judge.model: ""` the judge asks
/v1/models for the name. Needs the `serving` extra (fastapi, uvicorn, openai).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from flows.server import HOST, _free_port, live_state, stop_group, wait_healthy
from flows.server import healthy as server_healthy
from flows.workspace import QUIET_ENV, Workspace
from tasks.core import layout

SERVE = "from transformers.cli.transformers import main; main()"   # the `transformers` script


def _state_file(ws: Workspace) -> Path:
    return ws.state / "judge-server.json"


def healthy(base_url: str, timeout: float = 2.0) -> bool:
    """`transformers serve` answers /health beside /v1."""
    return server_healthy(base_url.removesuffix("/v1"), timeout)


def status(ws: Workspace) -> dict[str, Any] | None:
    """The running server's pid, URL, model and log, or None."""
    info = live_state(_state_file(ws))
    return None if info is None else {**info, "healthy": healthy(info["url"])}


def default_model(ws: Workspace) -> Path:
    """The workspace's initial policy: the model the loop starts from judges it."""
    return ws.root / layout.policy(0)


def start(ws: Workspace, model: Path | None = None, port: int = 8000,
          timeout: float = 300.0) -> dict[str, Any]:
    running = status(ws)
    if running and running["healthy"]:
        return running
    model = (model or default_model(ws)).expanduser().resolve()
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"{model}: not a saved transformers model directory (no "
                                "config.json); pass --model DIR")
    ws.state.mkdir(parents=True, exist_ok=True)
    port = _free_port(port)
    log_path = ws.state / "judge-server.log"
    env = {**os.environ, **QUIET_ENV}
    cmd = [sys.executable, "-c", SERVE, "serve", str(model), "--host", HOST, "--port",
           str(port), "--log-level", "info", "--device", "cpu"]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    url = f"http://{HOST}:{port}/v1"
    info = {"pid": proc.pid, "port": port, "url": url, "model": str(model),
            "log": str(log_path)}
    wait_healthy(proc, lambda: healthy(url), timeout, "transformers serve", log_path)
    _state_file(ws).write_text(json.dumps(info))
    return {**info, "healthy": True}


def stop(ws: Workspace, timeout: float = 30.0) -> bool:
    info = status(ws)
    if info is None:
        return False
    stop_group(info["pid"], timeout)
    _state_file(ws).unlink(missing_ok=True)
    return True
