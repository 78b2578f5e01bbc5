"""Work spread over Ray workers: rollouts and evaluate's samples (`rollout.workers`,
`evaluate.workers` > 1, see `tasks.models.generation`) and judging (`judge.workers` > 1, see
`tasks.judging.labelling`). Imported only then: nothing else in `tasks/` imports Ray.

The cluster: the user's when `RAY_ADDRESS` is set (`ray start --head`, a KubeRay head, ...),
else a local one that this process starts and stops (all the machine's CPUs, no dashboard, no
usage stats, its logs in a temp dir). Workers read the policy or judge from the same
DVC-tracked paths the stage reads (a shared filesystem on a multi-node cluster); weights are
never pickled and shipped.

Determinism: the stage cuts the work into the pieces it would compute itself (sampling: the
shards of `sampling.plan`, the same uniforms from the same generator, the same rows per shard
and torch thread count, since a row's log-prob bits move with both; judging: whole prompts,
on the stage's thread count) and puts the results back in order, so 1 worker and N workers
write byte-identical outputs (on machines with the same CPU kernels: one machine, or alike
nodes).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import tasks
from tasks.core.errors import InputError

ADDRESS_ENV = "RAY_ADDRESS"
# passed on to the workers (a local cluster inherits them anyway; a user's cluster does not)
PASS_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "DO_NOT_TRACK")
T = TypeVar("T")
R = TypeVar("R")


def _runtime_env() -> dict[str, Any]:
    """Workers import this process's `tasks` (the workspace's copy), offline like the stage."""
    code_root = str(Path(tasks.__file__).resolve().parent.parent)   # holds the `tasks` package
    path = os.pathsep.join(p for p in (code_root, os.environ.get("PYTHONPATH", "")) if p)
    env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    return {"env_vars": {**env, "PYTHONPATH": path}}


@contextmanager
def cluster(min_cpus: int = 1) -> Iterator[None]:
    """Ray for the block: the cluster at RAY_ADDRESS, else a local one with at least
    `min_cpus` CPUs (so that that many one-CPU workers fit) started here and shut down after.
    A Ray session this process already holds (a test's) is used as it is."""
    import ray
    if ray.is_initialized():
        yield
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = os.environ.get(ADDRESS_ENV) or None
    temp = None if address else tempfile.mkdtemp(prefix="alignloop-ray-")
    local = {} if address else {"num_cpus": max(os.cpu_count() or 1, min_cpus),
                                "include_dashboard": False, "_temp_dir": temp}
    where = f"the Ray cluster at {ADDRESS_ENV}={address}" if address else "a local Ray cluster"
    t0 = time.monotonic()
    try:
        ray.init(address=address or "local", log_to_driver=False, logging_level=logging.ERROR,
                 runtime_env=_runtime_env(), **local)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise InputError(f"{where}: Ray did not start: {str(e).splitlines()[0]}") from None
    print(f"ray: {'connected to' if address else 'started'} {where} in "
          f"{time.monotonic() - t0:.1f} s", flush=True)
    try:
        yield
    finally:
        ray.shutdown()
        if temp:
            shutil.rmtree(temp, ignore_errors=True)


def _unwrap(e: Exception) -> Exception:
    """The worker's own exception (an InputError stays one line), not Ray's wrapper."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, Exception) else RuntimeError(str(e).splitlines()[0])


def map_actors(cls: type, kwargs: dict[str, Any], items: Sequence[T], workers: int
               ) -> Iterator[R]:
    """`cls(**kwargs).run(item)` for every item on `workers` Ray actors (one CPU each, built
    once: a model replica each), items handed to whichever actor is free; results in item
    order, as they come."""
    import ray
    from ray.util import ActorPool
    with cluster(workers):
        actor = ray.remote(num_cpus=1)(cls)
        pool = ActorPool([actor.remote(**kwargs)
                          for _ in range(max(1, min(workers, len(items))))])
        try:
            yield from pool.map(lambda a, item: a.run.remote(item), items)
        except ray.exceptions.RayError as e:
            raise _unwrap(e) from None


def map_shards(fn: Callable[..., R], args: tuple[Any, ...], items: Sequence[T],
               workers: int) -> list[R]:
    """`fn(*args, shard)` for `workers` contiguous shards of items, as Ray tasks (one CPU
    each); results in shard order. fn: a module-level function."""
    import ray
    n = max(1, min(workers, len(items)))
    bounds = [len(items) * i // n for i in range(n + 1)]
    with cluster(workers):
        task = ray.remote(num_cpus=1)(fn)
        refs = [task.remote(*args, list(items[lo:hi])) for lo, hi in zip(bounds, bounds[1:])]
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as e:
            raise _unwrap(e) from None
