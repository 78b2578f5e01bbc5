"""The thin edge every stage shares: argument parsing, params, threads, RNG, metrics files."""
from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks import atomic, layout
from tasks.device import resolve_device
from tasks.errors import InputError
from tasks.params import Params, load_params

THREADS_ENV = "ALIGNLOOP_THREADS"   # a machine setting, not an experiment param: not in params
CLI_PID_ENV = "ALIGNLOOP_CLI_PID"    # set by the CLI: a stage ends when that process is gone
ERROR_FILE_ENV = "ALIGNLOOP_ERROR_FILE"  # set by the CLI: where a stage's one-line error goes
LOG_FILE_ENV = "ALIGNLOOP_LOG_FILE"      # set by the CLI: where an unexpected traceback goes


@dataclass(frozen=True)
class StageArgs:
    params: Params
    root: Path
    it: int
    device: torch.device = torch.device("cpu")   # params.device resolved (tasks/device.py)


def parse(argv: list[str] | None, description: str) -> StageArgs:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--it", type=int, default=0, help="iteration number (0: set-up stages)")
    ap.add_argument("--root", default=".", help="workspace root (default: current directory)")
    ns = ap.parse_args(argv)
    root = Path(ns.root).resolve()
    params = load_params(root / layout.PARAMS_FILE)
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, os.cpu_count() or 1)))
    torch.manual_seed(params.seed)      # implicit inits (a new reward head) are reproducible
    return StageArgs(params, root, ns.it, resolve_device(params.device))


def generator(seed: int, *salt: int) -> torch.Generator:
    """A torch RNG derived from the run seed and a stage-specific salt."""
    s = seed
    for x in salt:
        s = (s * 1_000_003 + x) % (2**63 - 1)
    return torch.Generator().manual_seed(s)   # on the CPU on every device: the same draws


def write_metrics(root: Path, rel: str, metrics: dict[str, float]) -> None:
    atomic.write_json(root / rel, {k: float(v) for k, v in sorted(metrics.items())})


def _die_with_cli() -> None:
    """Exit when the CLI that started this stage is gone (killed with -9, say): an orphaned
    stage would go on training and writing into a workspace whose lock is released. Cheap:
    a daemon thread looks twice a second."""
    cli = os.environ.get(CLI_PID_ENV)
    if not cli:
        return
    import psutil
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            try:
                alive = psutil.Process(int(cli)).status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                alive = False
            if not alive or os.getppid() != parent:
                os._exit(137)
    threading.Thread(target=watch, name="die-with-cli", daemon=True).start()


def _fail(line: str, code: int) -> None:
    """One line for the person: to the CLI's error file when run by it, else to stderr."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line.replace("\n", " ") + "\n")
    else:
        print(line, file=sys.stderr)
    raise SystemExit(code)


def run_main(body: Callable[[], None]) -> None:
    """Run a stage body. User errors give one clear line and exit 2, without a traceback;
    under the CLI an unexpected error gives one line too, its traceback going to the run's
    log file (run by hand, e.g. `dvc repro`, it propagates as usual)."""
    _die_with_cli()
    _freeze_if_program()          # torch's and transformers' import-time objects
    try:
        body()
    except InputError as e:
        _fail(f"error: {e}", 2)
    except Exception as e:
        log = os.environ.get(LOG_FILE_ENV)
        if not log:
            raise
        with open(log, "a", encoding="utf-8") as f:
            traceback.print_exc(file=f)
        _fail(f"error: {type(e).__name__}: {e} (traceback in {log})", 1)
    finally:
        _freeze_if_program()      # and what the stage made, for the exit


def _freeze_if_program() -> None:
    """Run as a program (`python -m tasks.<stage>`, what DVC runs), move every object alive
    now out of the cyclic GC's reach: the ~370k objects torch and transformers leave at
    import live as long as the process, and the interpreter's exit ran cyclic GC over them,
    ~1 s a stage (exit 1.0 -> 0.16 s). atexit and log handlers, module teardown and
    refcount-freed objects run as before. Never in a caller's process (tests)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith("tasks."):
        gc.freeze()
