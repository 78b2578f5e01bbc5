"""flows/signals.py inside a Prefect flow run: a SIGTERM reaches the CLI's handler, so the run
knows it was stopped even when a library's clean-up replaces the exception the signal raised."""
from __future__ import annotations

import signal
import subprocess
import sys

from conftest import ROOT

# In a child process: the handler stops every child of the process it runs in.
SCRIPT = r"""
import os, signal, time
from prefect.utilities.engine import capture_sigterm   # what Prefect's flow engine wraps a run in
from flows import signals
signals.install()
try:
    with capture_sigterm():
        if REINSTALL:
            signals.reinstall()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:                        # DVC's rwlock release, failing on the file it cut short
            raise ValueError("a library's clean-up replaced the exception")
except ValueError:
    pass
print(signals.received())
"""


def _received(reinstall: bool) -> str:
    proc = subprocess.run([sys.executable, "-c", f"REINSTALL = {reinstall}\n{SCRIPT}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_a_sigterm_in_a_flow_run_is_received_though_a_clean_up_replaced_its_exception():
    assert _received(reinstall=True) == str(int(signal.SIGTERM))


def test_without_reinstall_prefects_handler_takes_it_and_the_run_would_not_know():
    """The failure the reinstall prevents: Prefect's handler raised, a clean-up replaced its
    exception, and the CLI's handler never ran (the run exited 1 as a failed stage)."""
    assert _received(reinstall=False) == "None"
