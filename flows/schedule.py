"""Recurring iterations: each tick appends the next iteration to the workspace's params and
runs the DAG (new iterations sample a fresh window of the train prompts).

Never two iterations interleaved in one workspace. A served schedule runs at most one tick at
a time by Prefect's deployment concurrency limit: an overlapping fire is cancelled before any
process starts (`overlap="skip"`) or queued until the running tick ends (`"wait"`), and the
flow run's state says so. Inside, a tick holds an exclusive lock on the workspace for its whole
run (manual `run`, `rerun` and `tick` take it too); when it is held the tick waits or is
skipped, before the pipeline (MLflow, DVC) is even imported. Every tick that starts is logged
to `.alignloop/ticks.jsonl`, with why when it was skipped, refused or failed. A failed tick puts
the workspace back as it was before it.

A budget of runs: with `max_runs_per_day` N > 0 a tick is refused (state Refused, type
COMPLETED; the CLI exits 0) when N ticks started an iteration (ran or failed) in the 24 hours
before it.

The tick is served from this process (`serve`) or deployed to a Prefect work pool
(`deploy_to_pool`) for a worker to run, maybe on another machine: the deployment points at this
repository's directory and the workspace by path, so the worker must see both at those paths.

No `from __future__ import annotations` here: a served fire runs the flow in a fresh process
from a cloudpickled copy and Prefect validates its parameters against the signature there. A
string annotation ("Overlap") no longer resolves in that copy, and every fire failed.
"""
import contextlib
import json
import re
import time
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.states import Completed, State

from flows import shipped
from flows.workspace import Busy, Workspace, apply_environment, git, workspace_lock
from tasks.config.params import iteration_numbers, parse_params
from tasks.core import layout

Overlap = Literal["wait", "skip"]
ENTRYPOINT = "flows/schedule.py:tick"   # relative to shipped.code_root(), where a worker loads it
TICKS = "ticks.jsonl"          # in .alignloop/: when each tick started and ended, and why
DAY_S = 24 * 3600.0
STARTED = ("ran", "failed")    # the outcomes of ticks that ran an iteration: they count
# what Prefect does with a fire while the deployment's one slot is taken
COLLISION = {"skip": ConcurrencyLimitStrategy.CANCEL_NEW, "wait": ConcurrencyLimitStrategy.ENQUEUE}


def champion_iteration(root: Path) -> int:
    """The iteration of the registered policy the `champion` alias names, from the registry's
    record in git (registry/versions.json, which follows every alias move); 0 (the initial
    model) when there is none."""
    from flows.registry import POLICY_MODEL
    from flows.registry_record import RECORD
    path = root / RECORD
    if not path.is_file():
        return 0
    versions = json.loads(path.read_text()).get("models", {}).get(POLICY_MODEL, [])
    for v in versions:
        if "champion" in v.get("aliases", []):
            return int(v["tags"].get("iteration", 0))
    return 0


def append_iteration(text: str, prev: int | None = None) -> tuple[str, int]:
    """The params text with one more item under `iterations:`, starting from iteration `prev`
    (the champion's; default: the last one); comments are kept."""
    params = parse_params(text)
    k = max(iteration_numbers(params)) + 1
    prev = k - 1 if prev is None else prev
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if re.match(r"^iterations:", line))
    end = start + 1
    while end < len(lines) and (lines[end].startswith((" ", "\t")) or not lines[end].strip()):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    indent = re.match(r"^(\s*)", lines[start + 1]).group(1) if end > start + 1 else "  "
    why = "the champion's" if prev else "the initial model: no champion yet"
    lines.insert(end, f'{indent}"{k}": {{prev: {prev}}}   # {why}\n')
    new = "".join(lines)
    assert max(iteration_numbers(parse_params(new))) == k
    return new, k


def _log_tick(ws: Workspace, record: dict[str, object]) -> None:
    ws.state.mkdir(parents=True, exist_ok=True)
    with (ws.state / TICKS).open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def read_ticks(ws: Workspace) -> list[dict[str, Any]]:
    """The tick log; a line a killed tick left half-written is skipped."""
    path = ws.state / TICKS
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return [r for r in out if isinstance(r, dict)]


def over_daily_budget(ws: Workspace, max_runs: int, now: float) -> str | None:
    """Why a tick at `now` is refused by `max_runs` a day (0 = no limit), or None."""
    if max_runs <= 0:
        return None
    since = now - DAY_S
    starts = sorted(t["start"] for t in read_ticks(ws) if t.get("outcome") in STARTED
                    and isinstance(t.get("start"), (int, float)) and t["start"] > since)
    if len(starts) < max_runs:
        return None
    free = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(starts[-max_runs] + DAY_S))
    return (f"{len(starts)} runs in the last 24 h, --max-runs-per-day {max_runs}; the next "
            f"may run from {free}")


def refuse_if_over_budget(ws: Workspace, max_runs: int) -> bool:
    """True (and the refusal logged) when the daily budget is spent: checked before a flow
    run starts, as `skip_if_busy`; the tick checks again under the workspace lock."""
    why = over_daily_budget(ws, max_runs, time.time())
    if why is None:
        return False
    _not_run(ws, time.time(), "refused", why)
    return True


def _restore(ws: Workspace, head: str, iteration: int) -> None:
    """Back to the commit before the tick: tracked files, the new iteration's artifacts
    removed, every other DVC output checked out as dvc.lock records it."""
    import shutil

    from dvc.repo import Repo
    git(ws.root, "reset", "-q", "--hard", head)
    for rel in layout.iteration_dirs(iteration):
        shutil.rmtree(ws.root / rel, ignore_errors=True)
    from flows.dvc_quiet import quiet_dvc
    with contextlib.chdir(ws.root), Repo(str(ws.root)) as repo, quiet_dvc():
        repo.checkout(force=True)


def _not_run(ws: Workspace, t0: float, outcome: str, why: str) -> str:
    """Log a tick that did not run, `skipped` (the workspace busy) or `refused` (the daily
    budget spent): ticks.jsonl, terminal, Prefect log at WARNING so the UI shows it at the
    CLI's quiet level; returns the line."""
    _log_tick(ws, {"start": t0, "end": time.time(), "outcome": outcome, "why": why})
    line = f"tick: {outcome} ({why})"
    print(line, flush=True)
    with contextlib.suppress(Exception):      # outside a flow run (the CLI's pre-check)
        get_run_logger().warning(line)
    return line


def skip_if_busy(ws: Workspace, overlap: Overlap) -> bool:
    """With overlap "skip", True (and the skip logged) when another iteration holds the
    workspace: checked in a second, before a flow run, the pipeline and its imports start."""
    if overlap != "skip":
        return False
    try:
        with workspace_lock(ws, "skip"):
            return False
    except Busy as e:
        _not_run(ws, time.time(), "skipped", str(e))
        return True


def _next_iteration(ws: Workspace, waited_s: float) -> dict[str, object]:
    """Append the next iteration to params.yaml and run the DAG; called under the lock."""
    import os

    from flows import pipeline, recovery, shipped  # MLflow, DVC: only for a tick that runs
    from flows.messages import say
    from tasks.runtime.stage import ERROR_FILE_ENV
    started = time.time()
    if not shipped.is_source_tree(ws.root):     # what a run or tick killed with -9 left, as
        recovery.sweep(ws.root)                  # `alignloop run` clears it (flows/run.py)
        recovery.clear_killed_outputs(ws.root)
    head = git(ws.root, "rev-parse", "HEAD")
    path = ws.root / layout.PARAMS_FILE
    new, k = append_iteration(path.read_text(), champion_iteration(ws.root))
    path.write_text(new)
    (ws.state / "logs").mkdir(parents=True, exist_ok=True)   # a stage's one-line error:
    errors = Path(os.environ.setdefault(           # the CLI's file, or the tick's own
        ERROR_FILE_ENV, str(ws.state / "logs" / f"tick-{k}-{int(started)}.errors")))
    try:
        records = pipeline.alignloop(str(ws.root))
    except BaseException as e:
        _restore(ws, head, k)
        why = failure_line(e, errors)
        _log_tick(ws, {"iteration": k, "start": started, "end": time.time(),
                       "outcome": "failed", "why": why})
        say(f"tick: iteration {k} failed ({why}); workspace restored to {head[:10]}")
        raise
    _log_tick(ws, {"iteration": k, "start": started, "end": time.time(), "outcome": "ran",
                   "waited_s": round(waited_s, 3)})
    say(f"tick: iteration {k} done")
    return {"iteration": k, "outcome": "ran", "records": [r.as_dict() for r in records]}


def failure_line(e: BaseException, errors: Path) -> str:
    """Why a tick failed, in one line: the failed stage's own message when it wrote one."""
    lines = errors.read_text(encoding="utf-8").splitlines() if errors.is_file() else []
    if lines:
        return lines[-1].removeprefix("error: ")
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


@flow(name="alignloop-tick", flow_run_name="tick-{workspace}")
def tick(workspace: str, overlap: Overlap = "wait", max_runs_per_day: int = 0
         ) -> dict[str, object] | State[dict[str, object]]:
    """One scheduled iteration: append it to params.yaml, run the DAG, record it. A tick that
    finds the workspace busy with overlap "skip" ends in state Skipped, one beyond
    `max_runs_per_day` (0 = no limit) in state Refused (both of type COMPLETED)."""
    ws = Workspace(Path(workspace))
    if not (ws.root / layout.PARAMS_FILE).is_file():
        raise FileNotFoundError(f"{ws.root}: no alignloop workspace at this path here; a "
                                "worker needs it at the path it was deployed with")
    apply_environment(ws)        # a worker's flow run starts without the CLI's environment
    t0 = time.time()
    try:
        with workspace_lock(ws, overlap):
            why = over_daily_budget(ws, max_runs_per_day, time.time())
            if why is not None:
                return Completed(name="Refused", message=_not_run(ws, t0, "refused", why),
                                 data={"outcome": "refused"})
            return _next_iteration(ws, time.time() - t0)
    except Busy as e:
        return Completed(name="Skipped", message=_not_run(ws, t0, "skipped", str(e)),
                         data={"outcome": "skipped"})


def deployment_name(ws: Workspace) -> str:
    return f"alignloop-{ws.root.name}"


def serve(ws: Workspace, cron: str | None, overlap: Overlap,
          interval: float | None = None, max_runs_per_day: int = 0) -> None:
    """Serve the tick as a Prefect deployment on `cron` or every `interval` seconds (blocks;
    Ctrl-C stops). Its concurrency limit of 1 (visible in the UI) makes Prefect cancel an
    overlapping fire ("skip", state Cancelled: "Deployment concurrency limit reached.") or
    hold it as AwaitingConcurrencySlot until the running tick ends ("wait")."""
    if (cron is None) == (interval is None):
        raise ValueError("serve: give exactly one of cron and interval")
    tick.serve(name=deployment_name(ws), cron=cron, interval=interval,
               parameters={"workspace": str(ws.root), "overlap": overlap,
                           "max_runs_per_day": max_runs_per_day},
               global_limit=_concurrency(overlap),
               description=f"alignloop iterations in {ws.root} (overlapping ticks: {overlap})")


def _concurrency(overlap: Overlap) -> ConcurrencyLimitConfig:
    """One slot per workspace's deployment; what a fire that finds it taken does."""
    return ConcurrencyLimitConfig(limit=1, collision_strategy=COLLISION[overlap])


def ensure_pool(name: str) -> str:
    """The work pool's type; a missing pool is created as a `process` pool (a worker runs each
    flow run as a subprocess on its machine: no image, no registry)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker
    with get_client(sync_client=True) as client:
        try:
            return client.read_work_pool(name).type
        except ObjectNotFound:
            template = ProcessWorker.get_default_base_job_template()
            return client.create_work_pool(WorkPoolCreate(
                name=name, type="process", base_job_template=template)).type


def deploy_to_pool(ws: Workspace, pool: str, cron: str | None, overlap: Overlap,
                   interval: float | None = None, max_runs_per_day: int = 0) -> str:
    """Deploy the tick to work pool `pool` (created if missing) with serve's name, parameters,
    schedule and concurrency limit, and return the pool's type. The code is this repository's
    directory, loaded by path (no image built or pushed): a worker needs it, and the workspace,
    at the same paths."""
    if (cron is None) == (interval is None):
        raise ValueError("deploy_to_pool: give exactly one of cron and interval")
    kind = ensure_pool(pool)
    loaded = tick.from_source(source=str(shipped.code_root()), entrypoint=ENTRYPOINT)
    deployment = loaded.to_deployment(   # .deploy() would do the same, with a console table
        name=deployment_name(ws), work_pool_name=pool, cron=cron, interval=interval,
        parameters={"workspace": str(ws.root), "overlap": overlap,
                    "max_runs_per_day": max_runs_per_day},
        concurrency_limit=_concurrency(overlap), paused=False,
        description=f"alignloop iterations in {ws.root} (overlapping ticks: {overlap}; "
                    "a worker needs this path)")
    deployment.apply(work_pool_name=pool)
    return kind
