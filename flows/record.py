"""The record step: after an iteration's stages, its ledger as a transaction a crash at any
point cannot lose. The iteration's dvc.lock and params are committed to the workspace's git
(tag `iteration-k`), its stage runs logged to MLflow, its reward model and policy registered,
its gate applied and the champion moved, the registry record committed. Every step finds what
an earlier, killed run already did and does only the rest (flows/crashpoints.py names the
points a test kills it at).

dvc.lock is read once per iteration, after the stages and before the commit (committing does
not change it), and that one reading is passed to every step; so is the workspace's params.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows import crashpoints, dag, registry, registry_record, signals, targets, tracking
from flows.messages import say, warn
from flows.workspace import Workspace, git, git_bytes
from tasks.core import layout
from tasks.judging.judge_factory import judge_identity

Lock = dict[str, Any]


@dataclass(frozen=True)
class IterationRecord:
    """What the record step did for one iteration (what `alignloop run` prints and the flow
    returns). Versions and the gate are empty for iteration 0 (the set-up stages)."""
    iteration: int
    git_commit: str
    stages: tuple[dag.StageRun, ...]
    mlflow_run_id: str
    recorded: str                         # "now", or "already" (an earlier run logged it)
    pushed: str | None = None             # DVC push's count, once the data reached the remote
    policy_version: str = ""
    reward_model_version: str = ""
    gate: str = ""                        # "passed" | "failed" | "" (iteration 0)
    report: dict[str, str] | None = None  # the last iteration's: where the report went

    def ran(self) -> bool:
        """Some stage computed or restored its outputs (none was up to date)."""
        return any(r.outcome != "cached" for r in self.stages)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _uncommitted(root: Path, runs: Sequence[dag.StageRun], lock: Lock) -> list[str]:
    """The stage instances of `runs` whose dvc.lock entries differ from HEAD's: they ran now or
    in a run killed before their commit."""
    head = dag.read_lock(root, git_bytes(root, "show", "HEAD:dvc.lock") or b"")
    return [r.name for r in runs if lock.get(r.name) != head.get(r.name)]


def _commit(root: Path, title: str, runs: Sequence[dag.StageRun], new: list[str]) -> None:
    outcomes = {r.name: r.outcome for r in runs}
    body = ", ".join(f"{n} ({outcomes[n]})" for n in new) or "no stage ran"
    git(root, "commit", "-q", "-m", f"{title}\n\nStages: {body}")


def commit_iteration(root: Path, iteration: int, runs: Sequence[dag.StageRun], lock: Lock,
                     last: bool) -> str:
    """Commit what the iteration changed (dvc.lock, params, metrics); returns HEAD's sha.

    The iteration's results are uncommitted when its stages' dvc.lock entries differ from
    HEAD's, whether the stages ran now or in a run killed before its commit. A group with
    nothing uncommitted commits nothing (its other changes, say a params edit for a later
    iteration, go with the next commit), except the last one, which leaves a clean tree. The
    `iteration-k` tag marks the commit that holds iteration k's results.
    """
    new = _uncommitted(root, runs, lock)
    git(root, "add", "-A")
    if git(root, "status", "--porcelain") and (new or last):
        _commit(root, f"alignloop: iteration {iteration}" if new else
                "alignloop: declaration update", runs, new)
    sha = git(root, "rev-parse", "HEAD")
    tag = f"iteration-{iteration}"
    if iteration > 0 and (new or not git(root, "tag", "--list", tag)):
        git(root, "tag", "-f", tag, sha)
    return sha


def commit_final(root: Path, runs: Sequence[dag.StageRun]) -> bool:
    """Commit the final stages' dvc.lock entries (the report) when they differ from HEAD's, on
    a commit of their own after the last iteration's: a report that fails to build costs no
    iteration its record. True if it committed."""
    new = _uncommitted(root, runs, dag.read_lock(root))
    git(root, "add", "-A")
    if not (new and git(root, "status", "--porcelain")):
        return False
    _commit(root, "alignloop: report", runs, new)
    return True


def _assess(root: Path, lock: Lock) -> dict[str, Any] | None:
    """The targets' decision for the last iteration (it goes into the iteration's commit);
    a failure to assess is a warning and never costs the iteration its record."""
    loop = [s.name for s in dag.ordered_stages(root) if s.base not in layout.FINAL_STAGES]
    try:
        assessed = targets.assess(root, loop, lock)
    except (OSError, ValueError) as e:
        warn(f"targets: not assessed ({type(e).__name__}: {e})")
        return None
    if assessed is not None:
        targets.write(root, assessed)
    return assessed


@task(name="record-iteration", task_run_name="record-iteration-{iteration}",
      cache_policy=NO_CACHE)
def record_iteration(root: str, iteration: int, runs: list[dag.StageRun],
                     last: bool = False) -> IterationRecord:
    """The iteration's ledger: any run ends with one commit, one complete MLflow run, one
    reward-model and one policy version, and the champion on the latest iteration that passed
    its gate."""

    ws = Workspace(Path(root))
    signals.check()
    lock = dag.read_lock(ws.root)                        # once: the commit does not change it
    assessed = _assess(ws.root, lock) if last and iteration > 0 else None
    sha = commit_iteration(ws.root, iteration, runs, lock, last)
    crashpoints.reach("git_commit", iteration)
    fp = dag.fingerprint(lock, [r.name for r in runs])
    flow_run_id = str(flow_run.get_id() or "")
    client = registry.MlflowClient()
    run_id = tracking.iteration_run(client, iteration, fp)
    recorded = "already" if run_id else "now"
    if run_id is None:
        run_id = tracking.log_iteration(ws.root, iteration, runs, lock, sha, flow_run_id)
    if assessed is not None:
        for line in targets.lines(assessed):
            say(line, terminal=False)          # `alignloop run` prints them when it ends
        if recorded == "now":
            tracking.log_targets(run_id, assessed)
    record = IterationRecord(iteration, sha, tuple(runs), run_id, recorded,
                             pushed=client.get_run(run_id).data.tags.get(
                                 f"{tracking.TAG}pushed"))   # set once its data was pushed
    if iteration == 0:
        return record
    p = ws.params()
    common = {"git_commit": sha, "prefect_flow_run_id": flow_run_id,
              **judge_identity(p.judge, ws.root), "algo": p.update.algo,
              "reference": p.update.reference, "workspace": str(ws.root)}
    versions = registry.register_iteration(ws.root, iteration, lock, run_id, common, p)
    record = replace(record, **versions)
    record = replace(record, gate=apply_gate(ws.root, iteration, record.policy_version, lock))
    registry_record.sync(ws.root, f"alignloop: registry record, iteration {iteration}")
    return record


def apply_gate(root: Path, iteration: int, version: str, lock: Lock) -> str:
    """Record the iteration's gate decision on its version, then put `champion` on the
    latest iteration whose gate passed (re-running an older gate never moves it back)."""
    from flows import aliases

    decision = json.loads((root / layout.gate(iteration)).read_text())
    client = registry.MlflowClient()
    why = "; ".join(decision["reasons"])
    client.set_model_version_tag(registry.POLICY_MODEL, version, "gate",
                                 "passed" if decision["passed"] else f"failed: {why}")
    if not decision["passed"]:
        say(f"gate: iteration {iteration} (v{version}) not promoted: {why}")
    best = registry.latest_passing(client, lock)
    if best is not None:
        best_it, best_version = best
        moved = aliases.ensure(root, "champion", best_version,
                               f"gate passed at iteration {best_it}", "gate", best_it)
        if moved:
            say(f"gate: iteration {best_it} (v{best_version}) is the new champion")
    return "passed" if decision["passed"] else "failed"
