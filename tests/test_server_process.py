"""The background servers' process handling (flows/server.py), shared by the Prefect server
and the judge server: real child processes in their own sessions."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.server import stop_group, wait_healthy


def _spawn(code: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_stop_group_ends_the_leader_and_its_children(tmp_path: Path) -> None:
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)")
    proc = _spawn(code, tmp_path / "log")
    deadline = time.monotonic() + 20
    while "up" not in (tmp_path / "log").read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    stop_group(proc.pid, 5.0)
    assert proc.wait(timeout=5) != 0
    ps = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True)
    assert ps.stdout.strip() == ""                     # no member of its group is left
    stop_group(proc.pid, 1.0)                          # already gone: a no-op


def test_wait_healthy_names_the_log_of_a_server_that_exits(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = _spawn("import sys; print('port in use'); sys.exit(3)", log)
    with pytest.raises(RuntimeError, match=r"demo exited with 3: port in use \(log: .*server.log\)"):
        wait_healthy(proc, lambda: False, 20.0, "demo", log)


def test_wait_healthy_times_out_and_stops_the_server(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = _spawn("import time; time.sleep(60)", log)
    with pytest.raises(RuntimeError, match="demo not healthy after 1 s"):
        wait_healthy(proc, lambda: False, 1.0, "demo", log)
    assert proc.wait(timeout=5) != 0
