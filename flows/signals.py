"""SIGTERM and SIGINT end a run for certain: its processes stopped, a non-zero exit.

The handler stops every process the CLI started (the running stage, the temporary Prefect
server), remembers the signal and raises `Terminated` in the main thread. Library code may
catch and swallow that exception (once, a SQLAlchemy callback did, and the run went on to
record the iteration and exit 0), so the flow calls `check()` before each stage and each
record step, and the CLI's exit code is taken from `received()` whatever the flow returned.

Prefect's flow engine puts its own SIGTERM handler in for each flow run: it raises an
exception and passes the signal on to the handler before it only when that exception comes
back out of the flow. A library's clean-up may replace it on the way (DVC, interrupted while
writing its rwlock file, failed to read it back in its `finally`, and the run ended as a
failed stage, exit 1); so the flow puts this handler back in first (`reinstall()`).
"""
from __future__ import annotations

import contextlib
import signal
from types import FrameType

_received: list[int] = []
_spared: set[int] = set()       # ended at exit instead (the run's Prefect server)
_installed: list[bool] = []     # install() ran in this process (the CLI's)


class Terminated(SystemExit):
    """The run was asked to stop by a signal; exit code 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def received() -> int | None:
    """The first signal received, if any."""
    return _received[0] if _received else None


def check() -> None:
    """Raise Terminated if a signal was received (even if its exception was swallowed)."""
    if _received:
        raise Terminated(_received[0])


def spare(pid: int) -> None:
    """Leave this child (and its children) running when a signal stops the others: the
    run's Prefect server must outlive the flow's last report to it, and is ended at exit."""
    _spared.add(pid)


def stop_children(timeout: float = 10.0) -> None:
    """Terminate every descendant process but the spared ones, then kill those still alive
    after `timeout`."""
    import psutil
    spared = set(_spared)
    for pid in _spared:
        with contextlib.suppress(psutil.Error):
            spared |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
    children = [c for c in psutil.Process().children(recursive=True) if c.pid not in spared]
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _handler(signum: int, frame: FrameType | None) -> None:
    first = not _received
    _received.append(signum)
    if first:                       # a second signal during clean-up must not cut it short
        stop_children()
        raise Terminated(signum)


def install() -> None:
    """End the run on SIGTERM (`kill PID`) and SIGINT (Ctrl-C) as described above."""
    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    _installed[:] = [True]


def reinstall() -> None:
    """Put the handler back in where the CLI installed it and something replaced it since
    (Prefect's flow engine, at each flow run's start); nothing elsewhere (a Prefect worker's
    flow run keeps Prefect's own), nor off the main thread, where signals cannot be set."""
    import threading
    if _installed and threading.current_thread() is threading.main_thread():
        install()
