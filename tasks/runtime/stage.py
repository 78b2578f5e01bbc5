"""The thin edge every stage shares: its contract, argument parsing, params, threads, RNG,
metrics files.

Each stage module (tasks/stages/) declares one `Contract`: the params keys it reads, the data it
reads and what it writes, at the paths tasks/core/layout.py names. dvc.yaml is checked against the
contracts (tests/test_dvc_yaml.py), and `parse` hands the stage a view of the params that
answers the declared keys only: a key read but not declared fails at once, rather than going
stale in dvc.yaml (a change to it would not rerun the stage).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

# A process the CLI started (a stage, its workers) ends quietly with 130 on SIGINT: Ctrl-C
# reaches the terminal's whole process group and the CLI says the one line. Installed when this
# module is imported, which every stage does first, before its heavy imports (the CLI process
# itself keeps its own handler, flows/signals.py).
if os.environ.get("ALIGNLOOP_CLI_PID") not in (None, str(os.getpid())):
    import signal as _signal
    _signal.signal(_signal.SIGINT, lambda *_: os._exit(128 + _signal.SIGINT))

# prev_of: re-exported for the stages
from tasks.config.params import Params, load_params, prev_of  # noqa: E402,F401
from tasks.core import atomic, layout  # noqa: E402
from tasks.core.errors import InputError  # noqa: E402

if TYPE_CHECKING:                   # imported where a stage uses it: not by every stage
    import torch

THREADS_ENV = "ALIGNLOOP_THREADS"   # a machine setting, not an experiment param: not in params
CLI_PID_ENV = "ALIGNLOOP_CLI_PID"    # set by the CLI: a stage ends when that process is gone
ERROR_FILE_ENV = "ALIGNLOOP_ERROR_FILE"  # set by the CLI: where a stage's one-line error goes
LOG_FILE_ENV = "ALIGNLOOP_LOG_FILE"      # set by the CLI: where an unexpected traceback goes
SUMMARY_FILE_ENV = "ALIGNLOOP_STAGE_SUMMARY"  # set by the flow: where a stage's summary goes


Paths = Callable[[Any, Any], Sequence[str]]   # (iteration, its prev) -> workspace paths: ints,
                                              # or dvc.yaml's `${key}`, `${item.prev}` (a test)


def _none(it: Any, prev: Any) -> Sequence[str]:
    return ()


@dataclass(frozen=True)
class Contract:
    """What one stage reads and writes. `params`: the params.yaml keys it reads, as DVC names
    them (a section, or `section.key`: DVC reruns the stage when one of them changes). The rest
    are paths in the workspace for an iteration `it` and the iteration `prev` it starts from
    (loop stages; set-up stages ignore both), through tasks/core/layout.py: `deps` the data it
    reads (its sources are found from its imports), `outs` what it writes, `metrics` its
    metrics files (git-tracked, not cached). `name`: the stage's, as dvc.yaml names it.
    `when`: deps read under some params only, by condition (tasks/config/conditions.py): dvc.yaml
    marks them `# if: NAME`, and the stage calls `conditions.check` before it reads."""
    name: str
    params: tuple[str, ...]
    deps: Paths = _none
    outs: Paths = _none
    metrics: Paths = _none
    when: Mapping[str, Paths] = field(default_factory=dict)
    keys: frozenset[tuple[str, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", frozenset(tuple(k.split(".")) for k in self.params))

    def declares(self, key: str) -> bool:
        """Whether `key` (dotted) is declared, itself or by a section above it."""
        path = tuple(key.split("."))
        return any(path[:len(k)] == k for k in self.keys)


class UndeclaredParam(RuntimeError):
    """A stage read a params key its contract does not declare: a bug in the stage module (its
    dvc.yaml entry would not rerun it when that key changes), not in the user's params."""


class Declared:
    """A read-only view of a params object (Params, or a section of it) that answers only the
    keys `contract` declares: a declared key, or a section under a declared one, is the params'
    own value; a section some of whose keys are declared is a view again; anything else raises
    UndeclaredParam naming the stage and the key. `iterations` is always answered: it is the
    DAG's shape (dvc.yaml's foreach), which names the stage's inputs, not a setting it reads."""
    __slots__ = ("_value", "_contract", "_path")

    def __init__(self, value: object, contract: Contract, path: tuple[str, ...] = ()) -> None:
        self._value, self._contract, self._path = value, contract, path

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._value, name)
        path = self._path + (name,)
        if path == ("iterations",) or self._contract.declares(".".join(path)):
            return value
        if any(k[:len(path)] == path for k in self._contract.keys):
            return Declared(value, self._contract, path)
        raise UndeclaredParam(
            f"stage {self._contract.name} reads params key {'.'.join(path)}, which its contract "
            f"does not declare: add it to CONTRACT.params in tasks/stages/{self._contract.name}.py "
            "and to the stage's params in dvc.yaml")

    def __repr__(self) -> str:
        return f"Declared({'.'.join(self._path) or 'params'} of stage {self._contract.name})"


@dataclass(frozen=True)
class StageArgs:
    params: Params                   # a `Declared` view: the contract's keys only
    root: Path
    it: int
    device: Any = None    # params.device resolved (tasks/runtime/device.py); the CPU for a stage
                          # that uses torch without declaring it; None for one without torch

    @property
    def prev(self) -> int:
        """The iteration whose policy (and pair pool) this one starts from."""
        return prev_of(self.params, self.it)


def parse(argv: list[str] | None, description: str, contract: Contract) -> StageArgs:
    """The stage's arguments and its params, as the view `Declared` by its contract; the run
    seed and the device are set from them only where the contract declares them."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--it", type=int, default=0, help="iteration number (0: set-up stages)")
    ap.add_argument("--root", default=".", help="workspace root (default: current directory)")
    ns = ap.parse_args(argv)
    root = Path(ns.root).resolve()
    params = load_params(root / layout.PARAMS_FILE)
    torch = sys.modules.get("torch")   # imported by the stage's own modules, or not needed: the
    device = None                      # gate and the report start in 0.1 s, not 1.5 s
    if torch is not None:
        torch.set_num_threads(int(os.environ.get(THREADS_ENV, os.cpu_count() or 1)))
        if contract.declares("seed"):
            torch.manual_seed(params.seed)  # implicit inits (a new reward head) are reproducible
        device = torch.device("cpu")
    if contract.declares("device"):
        from tasks.runtime.device import resolve_device
        device = resolve_device(params.device)
    return StageArgs(cast(Params, Declared(params, contract)), root, ns.it, device)


def generator(seed: int, *salt: int) -> torch.Generator:
    """A torch RNG derived from the run seed and a stage-specific salt."""
    import torch
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


def say(line: str) -> None:
    """The stage's summary line: printed, and appended to the file the flow names (it goes on
    to the Prefect flow run's log)."""
    print(line, flush=True)
    path = os.environ.get(SUMMARY_FILE_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


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
    """Run as a program (`python -m tasks.stages.<stage>`, what DVC runs), move every object alive
    now out of the cyclic GC's reach: the ~370k objects torch and transformers leave at
    import live as long as the process, and the interpreter's exit ran cyclic GC over them,
    ~1 s a stage (exit 1.0 -> 0.16 s). atexit and log handlers, module teardown and
    refcount-freed objects run as before. Never in a caller's process (tests)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith("tasks."):
        gc.freeze()
