"""One run of the loop from the CLI: under the workspace lock, with its own logs and Prefect
server, and, when it fails, the workspace restored and one line to show for it.

Everything that touches the workspace happens under its lock: the sync of params and
declaration, the stages, the record step. A failure (an error, a signal) restores the
workspace as the run found it (flows/recovery.py); `RunFailed` then carries the one line and
the exit code (2 bad input, 1 other, 128 + N after signal N). Prefect's console output and
every traceback go to `.alignloop/logs/run-*.log`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from flows import shipped, signals
from flows import workspace as wsmod

if TYPE_CHECKING:
    from flows.record import IterationRecord
from tasks.core.errors import InputError
from tasks.runtime import forkserver


class RunFailed(RuntimeError):
    """A run that failed after the workspace was restored; the message is the one line."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.code = code


def run_loop(root: Path, params_file: Path | None,
             force: list[str]) -> tuple[list[dict], float]:
    """Everything that touches the workspace happens under its lock: the sync of params and
    declaration, the stages, the record step. A failure (an error, a signal) restores the
    workspace as the run found it (flows/recovery.py) before the one-line error is printed."""
    from flows import recovery
    ws = wsmod.Workspace(root)
    root.mkdir(parents=True, exist_ok=True)
    wsmod.apply_environment(ws)               # creates .alignloop/ (0700) for the lock
    t0 = time.perf_counter()
    logs = run_logs(ws)
    forkserver.enable(logs["log"])            # stage programs start from its imports
    server = _prefect_api(ws, logs["server"])  # starts while this run may wait for the lock
    with wsmod.workspace_lock(ws, "wait"):    # never interleaved with another run or a tick
        checkpoint = recovery.take(root)
        recovery.sweep(root)                  # debris of a run killed before this one
        try:
            if checkpoint.head is not None and not shipped.is_source_tree(root):
                cleared = recovery.clear_killed_outputs(root)   # of a run killed with -9
                if cleared:
                    _log(logs["log"], ["outputs of a killed run, cleared:", *cleared])
            ws, changed = wsmod.prepare(root, params_file)
            print(f"workspace {ws.root}" + (f" (synced {len(changed)} files)" if changed else ""))
            summaries = _flow(ws, force, server, logs)
            signals.check()                   # a signal whose exception a library swallowed
        except BaseException as e:
            # a new workspace has nothing to go back to; the project's own repository (a
            # developer's `--workspace .`) is never reset
            restorable = checkpoint.head is not None and not shipped.is_source_tree(root)
            if restorable:
                fixed = recovery.restore(root, checkpoint)
                _log(logs["log"], ["restored after the failure:", *fixed])
            raise failure(e, logs, restored=restorable) from e
        finally:
            wsmod.secure_state(ws)            # the MLflow store this run may have created
    return summaries, time.perf_counter() - t0


def run_logs(ws: wsmod.Workspace) -> dict[str, Path]:
    """This run's log files under .alignloop/logs/ (Prefect's log and tracebacks, the stages'
    one-line errors, the temporary Prefect server's output)."""
    logs = ws.state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stem = time.strftime("run-%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"
    out = {"log": logs / f"{stem}.log", "errors": logs / f"{stem}.errors",
           "server": logs / f"{stem}.prefect-server.log"}
    os.environ.update({"ALIGNLOOP_CLI_PID": str(os.getpid()),
                       "ALIGNLOOP_ERROR_FILE": str(out["errors"]),
                       "ALIGNLOOP_LOG_FILE": str(out["log"])})
    return out


def _log(path: Path, lines: list[str]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _prefect_api(ws: wsmod.Workspace, log: Path) -> object | None:
    """PREFECT_API_URL as the user set it, else the workspace's standalone server when it runs,
    else a temporary server of this run's own that dies with it (flows/run_server.py). Set
    before Prefect is imported, which reads it once."""
    from flows import server as standalone
    if os.environ.get("PREFECT_API_URL"):
        return None
    info = standalone.status(ws)
    if info and info.get("healthy", True):
        os.environ["PREFECT_API_URL"] = info["api_url"]
        return None
    from flows.run_server import RunServer
    temp = RunServer(log).start()
    assert temp.proc is not None
    signals.spare(temp.proc.pid)              # stopped at exit, after the flow's last report
    os.environ["PREFECT_API_URL"] = temp.api_url
    return temp


def _flow(ws: wsmod.Workspace, force: list[str], server: object | None,
          logs: dict[str, Path]) -> list[IterationRecord]:
    # done while the server starts (PREFECT_API_URL is set already): the imports, the MLflow
    # store and the parse of the DAG take seconds of one core, the server's start the other's
    from flows.pipeline import alignloop, warm_up  # imports MLflow, which sets up its
    logging.captureWarnings(True)             # logger: quieted after it; library warnings go
    quiet_prefect(logs["log"])               # to the log file too
    warm_up(ws.root)
    if server is not None:
        server.wait()                         # type: ignore[attr-defined]
    return alignloop(str(ws.root), force=force)


def failure(e: BaseException, logs: dict[str, Path], restored: bool) -> RunFailed:
    """The one line a failed run ends with, and its exit code: 2 for bad input (a stage that
    exited 2 read bad input), 128 + N for signal N, else 1. The stage's own message, when it
    wrote one, replaces DVC's account of the failure; tracebacks go to the log file only."""
    import re
    import traceback

    from flows.dag import StageFailed
    where = ("the workspace is as it was before the run; " if restored else "") + \
        f"log {_short(logs['log'])}"
    if signals.received() is not None or isinstance(e, (signals.Terminated, KeyboardInterrupt)):
        sig = signals.received() or signal.SIGINT
        return RunFailed(f"stopped by {signal.Signals(sig).name} ({where})", 128 + sig)
    if isinstance(e, StageFailed) and (sig := _stopping_signal(e.detail)):
        # Ctrl-C or a service manager's stop reached the stage with the CLI's process group,
        # while DVC, running it, ignored the signal in this process
        return RunFailed(f"stopped by {signal.Signals(sig).name} ({where})", 128 + sig)
    if isinstance(e, StageFailed):
        own = _stage_errors(logs["errors"])
        detail = own[-1].removeprefix("error: ") if own else e.detail
        m = re.search(r"exited with (\d+)", e.detail)
        code = 2 if m and m.group(1) == "2" else 1
        return RunFailed(f"stage {e.name} failed: {detail} ({where})", code)
    if isinstance(e, (InputError, FileNotFoundError)):
        return RunFailed(f"{e} ({where})", 2)
    _log(logs["log"], ["".join(traceback.format_exception(e))])
    return RunFailed(f"{type(e).__name__}: {e} ({where})", 1)


def _stopping_signal(detail: str) -> int | None:
    """The signal that ended a stage process, when it is one a person or a service manager
    stops a run with (killed by it: `exited with -N`; or exited 128 + N on it)."""
    import re
    m = re.search(r"exited with (-?\d+)", detail)
    if not m:
        return None
    code = int(m.group(1))
    sig = -code if code < 0 else code - 128
    return sig if sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) else None


def _stage_errors(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.is_file() else []


def _short(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


def quiet_prefect(log: Path | None = None) -> None:
    """Prefect's console output goes to the run's log file, not the terminal: its tracebacks
    of a failed task and flow (the CLI prints one line instead), the CancelledError noise of
    a server shutting down. INFO reaches the Prefect API, so the UI's flow-run page shows the
    stage lines. Without a log file (serving a schedule, a tick), Prefect's own console shows
    warnings and errors as before; either way the noisy loggers are quieted."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if log else "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    for name in ("uvicorn", "uvicorn.error", "prefect.server", "asyncio", "httpx", "mlflow",
                 "alembic"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if log is None:                           # `schedule`, `tick`: Prefect's warnings show
        return
    from prefect.logging.configuration import ensure_logging_setup
    ensure_logging_setup()
    target = logging.FileHandler(log)
    target.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in
                                       list(logging.root.manager.loggerDict)]
    for lg in loggers:
        for h in list(lg.handlers):
            if type(h) is logging.StreamHandler or \
                    type(h).__name__ in ("PrefectConsoleHandler", "_SafeStreamHandler"):
                lg.removeHandler(h)
                lg.addHandler(target)
