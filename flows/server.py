"""A standalone Prefect server for a workspace: loopback only, SQLite store in the workspace.

Schedules need one (Prefect's temporary server refuses them). Teams that set PREFECT_API_URL
use their own server instead and never start this one.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from flows.workspace import Workspace, environment

HOST = "127.0.0.1"


def _state_file(ws: Workspace) -> Path:
    return ws.state / "prefect-server.json"


def _free_port(preferred: int) -> int:
    with socket.socket() as s:
        if s.connect_ex((HOST, preferred)) != 0:
            return preferred
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def status(ws: Workspace) -> dict[str, Any] | None:
    """The running server's pid and API URL, or None."""
    path = _state_file(ws)
    if not path.is_file():
        return None
    info = json.loads(path.read_text())
    try:
        os.kill(info["pid"], 0)
    except OSError:
        path.unlink(missing_ok=True)
        return None
    return info if healthy(info["api_url"]) else {**info, "healthy": False}


def start(ws: Workspace, port: int = 4200, timeout: float = 120.0) -> dict[str, Any]:
    """Start the server in its own session (it outlives this process) and wait until healthy."""
    running = status(ws)
    if running and running.get("healthy", True):
        return running
    ws.state.mkdir(parents=True, exist_ok=True)
    port = _free_port(port)
    env = {**os.environ, **environment(ws), "PREFECT_SERVER_API_HOST": HOST,
           "PREFECT_SERVER_API_PORT": str(port), "PREFECT_UI_ENABLED": "true"}
    env.pop("PREFECT_API_URL", None)
    log = (ws.state / "prefect-server.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", HOST,
                             "--port", str(port)], env=env, stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    api_url = f"http://{HOST}:{port}/api"
    info = {"pid": proc.pid, "port": port, "api_url": api_url,
            "ui_url": f"http://{HOST}:{port}", "log": str(ws.state / "prefect-server.log")}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}; see {info['log']}")
        if healthy(api_url):
            _state_file(ws).write_text(json.dumps(info))
            return info
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"prefect server not healthy after {timeout:.0f} s; see {info['log']}")


def stop(ws: Workspace, timeout: float = 30.0) -> bool:
    info = status(ws)
    if info is None:
        return False
    try:
        os.killpg(info["pid"], signal.SIGTERM)
    except OSError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(info["pid"], 0)
        except OSError:
            break
        time.sleep(0.2)
    else:
        os.killpg(info["pid"], signal.SIGKILL)
    _state_file(ws).unlink(missing_ok=True)
    return True
