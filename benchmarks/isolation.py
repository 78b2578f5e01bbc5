"""Environment isolation for every process the benchmarks start (as tests/conftest.py does):
Prefect home, MLflow store and DVC site cache in the benchmark's own temp dirs, offline and
quiet, so that a benchmark never touches the user's ~/.prefect, MLflow server or DVC state."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
THREADS = "2"          # what the stages use on this 2-core machine (ALIGNLOOP_THREADS)

# a user's servers and profiles must not leak into a benchmark process
DROP = ("PREFECT_API_URL", "PREFECT_PROFILE", "MLFLOW_TRACKING_URI", "PREFECT_HOME",
        "DVC_SITE_CACHE_DIR", "ALIGNLOOP_FORKSERVER")   # a stage program here starts fresh


def isolated_env(base: Path, **extra: str) -> dict[str, str]:
    """A full environment for a child process whose state stores live under `base`."""
    for d in ("prefect", "dvc-site"):
        (base / d).mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in DROP}
    env.update({
        "PREFECT_HOME": str(base / "prefect"), "DVC_SITE_CACHE_DIR": str(base / "dvc-site"),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
        "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1",
        "TOKENIZERS_PARALLELISM": "false", "ALIGNLOOP_THREADS": THREADS,
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    env.update(extra)
    return env


def apply_in_process(base: Path) -> None:
    """The same isolation for this process (in-process stages and profiling)."""
    for k in DROP:
        os.environ.pop(k, None)
    os.environ.update({k: v for k, v in isolated_env(base).items() if k != "PYTHONPATH"})


HEAP_CHOICES = ("stage", "stock")
HEAP_HELP = ("glibc's malloc settings for this process and the ones it starts, every side "
             "alike: the stage processes' (tasks/core/heap.py) or glibc's defaults")


def restart_with_heap(choice: str) -> None:
    """Run this program under `choice`'s malloc settings: glibc reads them only when a process
    starts, so when the environment does not hold them yet, exec this program again with them
    (the same interpreter and command line: `sys.orig_argv`, so that `python -m benchmarks.run
    ...` runs again as a module, not as the script path `sys.argv[0]` names). On another C
    library: nothing."""
    import sys

    from tasks.core import heap
    tunables = heap.TUNABLES if choice == "stage" else ""
    if heap.is_glibc() and (os.environ.get(heap.ENV) or "") != tunables:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
                  {**os.environ, heap.ENV: tunables})
