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
from collections.abc import Callable
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


def live_state(path: Path) -> dict[str, Any] | None:
    """A background server's state file (pid, URLs, log) if its process is alive; a stale
    file (the process is gone) is removed."""
    if not path.is_file():
        return None
    info = json.loads(path.read_text())
    try:
        os.kill(info["pid"], 0)
    except OSError:
        path.unlink(missing_ok=True)
        return None
    return info


def status(ws: Workspace) -> dict[str, Any] | None:
    """The running server's pid and API URL, or None."""
    info = live_state(_state_file(ws))
    if info is None:
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
    wait_healthy(proc, lambda: healthy(api_url), timeout, "prefect server", Path(info["log"]))
    _state_file(ws).write_text(json.dumps(info))
    return info


def wait_healthy(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float, what: str,
                 log: Path) -> None:
    """Poll `ready` until it holds; a process that exits first, or a timeout (its process group
    then stopped), raises one line naming the log (with its last lines when it exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] \
                if log.is_file() else []
            raise RuntimeError(f"{what} exited with {proc.returncode}: {' | '.join(tail)} "
                               f"(log: {log})")
        if ready():
            return
        time.sleep(0.5)
    stop_group(proc.pid, 10.0)
    raise RuntimeError(f"{what} not healthy after {timeout:.0f} s; see {log}")


def stop_group(pid: int, timeout: float) -> None:
    """SIGTERM the process group led by `pid`, wait up to `timeout`, then SIGKILL it."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def stop(ws: Workspace, timeout: float = 30.0) -> bool:
    info = status(ws)
    if info is None:
        return False
    stop_group(info["pid"], timeout)
    _state_file(ws).unlink(missing_ok=True)
    return True
