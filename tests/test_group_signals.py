"""A run stopped the way terminals and service managers stop it: Ctrl-C in a pseudo-terminal
(SIGINT to the whole foreground process group) and `kill -TERM -PGID` (SIGTERM to the group)
while a stage runs. The run ends within seconds with 128 + N and one line naming the signal,
no traceback, no process left, and the workspace as the interrupted stage found it (what the
run recorded before it, iteration 0, is kept)."""
from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, TINY, run_cli, snapshot


def _read_until(fd: int, needle: str, timeout: float) -> str:
    out, deadline = "", time.monotonic() + timeout
    while needle not in out:
        assert time.monotonic() < deadline, f"no {needle!r} in time:\n{out[-2000:]}"
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                out += os.read(fd, 65536).decode(errors="replace")
            except OSError:             # the terminal's other end closed
                break
    return out


def _drain(fd: int, proc: subprocess.Popen, timeout: float) -> str:
    out, deadline = "", time.monotonic() + timeout
    while proc.poll() is None or select.select([fd], [], [], 0)[0]:
        assert time.monotonic() < deadline, f"still running after {timeout} s:\n{out[-2000:]}"
        if select.select([fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk.decode(errors="replace")
    proc.wait(timeout=max(deadline - time.monotonic(), 0.1))    # the terminal closed first
    return out


@pytest.mark.slow                  # a run from scratch to its first loop stage, twice
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_process_group_ends_the_run_at_once(tmp_path: Path, sig: int):
    ws = tmp_path / "ws"
    run_cli("init", str(ws), "--params", str(TINY))
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--workspace", str(ws)],
                            cwd=ROOT, stdin=secondary, stdout=secondary, stderr=secondary,
                            start_new_session=True)     # the group a terminal would signal
    os.close(secondary)
    try:
        _read_until(primary, "[run] rollout@1", timeout=300)
        # iteration 0 is recorded (committed, kept); what rollout@1 makes must not stay
        before = snapshot(ws, cache=False)            # the cache keeps objects of stages run
        time.sleep(1)                                  # a stage process is at work
        while select.select([primary], [], [], 0)[0]:     # its progress so far: not counted
            os.read(primary, 65536)
        family = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.monotonic()
        os.killpg(proc.pid, sig)
        out = _drain(primary, proc, timeout=60)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.close(primary)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, out[-2000:]
    assert seconds < 30, f"{seconds:.0f} s to stop"
    assert f"stopped by {name}" in out and "Traceback" not in out, out[-2000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and name in errors[0], out[-2000:]
    lines = [line for line in out.splitlines() if line.strip("\r\x1b[0m ")]
    assert len(lines) <= 3, out[-2000:]                 # its one line, not DVC's warnings
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert snapshot(ws, cache=False) == before         # every path the stage made removed
    status = subprocess.run(["git", "status", "--porcelain"], cwd=ws, capture_output=True,
                            text=True).stdout
    assert status == ""
