"""The temporary Prefect server of one CLI run, which cannot outlive it.

Prefect's own temporary server is a child process that nothing ends when the CLI is killed
with `kill -9`: it stayed listening. This one is the same server (uvicorn on loopback, the
workspace's SQLite store, no UI), started with a parent-death signal, so the kernel ends it
whenever the CLI process ends, however it ends, in a session of its own, so that a signal to
the CLI's process group (Ctrl-C, a service manager's stop) does not end it before the CLI has
finished with it. Runs with a PREFECT_API_URL of their own (a
team's server, or the workspace's standalone one from `alignloop server start`) use that.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:         # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class RunServer:
    """Start with `start()` (returns at once), `wait()` until healthy; stops at exit."""

    def __init__(self, log: Path):
        self.log = log
        self.port = _free_port()
        self.api_url = f"http://{HOST}:{self.port}/api"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RunServer:
        # not imported here: Prefect reads PREFECT_API_URL once, when it is first imported,
        # and the caller sets it to this server's URL before that
        spec = importlib.util.find_spec("prefect")
        assert spec is not None and spec.origin is not None
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1"}
        env.pop("PREFECT_API_URL", None)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--app-dir",
                 str(Path(spec.origin).parent.parent), "--factory",
                 "prefect.server.api.server:create_app", "--host", HOST, "--port",
                 str(self.port), "--log-level", "error", "--lifespan", "on"],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                preexec_fn=_die_with_parent,
                # a session of its own: Ctrl-C or a service manager's stop signals the CLI's
                # whole process group, and the server must outlive the flow's last report
                # (the CLI stops it at exit, the kernel when the CLI dies)
                start_new_session=True)
        atexit.register(self.stop)
        return self

    def wait(self, timeout: float = 120.0) -> str:
        """Block until the server answers /health; returns its API URL."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the run's Prefect server exited with "
                                   f"{self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self.api_url
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the run's Prefect server did not start in {timeout:.0f} s; "
                           f"see {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
