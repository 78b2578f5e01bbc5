"""The alignment loop as a Prefect flow: DVC's stage instances in order, one task each, then
per iteration a record step: commit dvc.lock and params to git, log to MLflow, register the
iteration's models, push data to the DVC remote.

Prefect result caching stays off: DVC alone decides what is up to date.
"""
from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict
from itertools import groupby
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows import dag, registry
from flows.workspace import git
from tasks import layout
from tasks.params import load_params

Summary = dict[str, Any]


def say(msg: str) -> None:
    """Progress line for the terminal (and the Prefect log)."""
    print(msg, flush=True)
    try:
        get_run_logger().info(msg)
    except Exception:   # outside a run context (tests calling helpers directly)
        pass


@task(name="stage", task_run_name="{name}", cache_policy=NO_CACHE)
def run_stage(root: str, name: str, force: bool = False) -> dag.StageRun:
    say(f"[{'rerun' if force else 'run'}] {name} ...")
    result = dag.reproduce(Path(root), name, force=force)
    say(f"[{result.outcome}] {name} ({result.seconds:.1f} s)")
    return result


@task(name="dvc-push", retries=3, retry_delay_seconds=[1, 4, 16], cache_policy=NO_CACHE)
def push_data(root: str) -> int:
    """Push every cached output to the DVC remote (I/O: may flake, so retried)."""
    import contextlib

    from dvc.repo import Repo
    with contextlib.chdir(root), Repo(root) as repo:
        return int(repo.push())


def commit_iteration(root: Path, iteration: int, runs: list[dag.StageRun],
                     last: bool) -> str:
    """Commit what the iteration changed (dvc.lock, params, metrics); returns HEAD's sha.

    A group whose stages were all cached commits nothing (its changes, say a params edit for a
    later iteration, go with the next commit), except the last one, which leaves a clean tree.
    """
    ran = [r for r in runs if r.outcome != "cached"]
    git(root, "add", "-A")
    if git(root, "status", "--porcelain") and (ran or last):
        title = f"alignloop: iteration {iteration}" if ran else "alignloop: declaration update"
        body = ", ".join(f"{r.name} ({r.outcome})" for r in ran) or "no stage ran"
        git(root, "commit", "-q", "-m", f"{title}\n\nStages: {body}")
    sha = git(root, "rev-parse", "HEAD")
    if iteration > 0 and ran:
        git(root, "tag", "-f", f"iteration-{iteration}", sha)
    return sha


@task(name="record-iteration", task_run_name="record-iteration-{iteration}",
      cache_policy=NO_CACHE)
def record_iteration(root: str, iteration: int, runs: list[dag.StageRun],
                     last: bool = False) -> Summary:
    path = Path(root)
    sha = commit_iteration(path, iteration, runs, last)
    lock = dag.read_lock(path)
    names = [r.name for r in runs]
    fp = registry.fingerprint(lock, names)
    summary: Summary = {"iteration": iteration, "git_commit": sha,
                        "stages": [asdict(r) for r in runs]}
    if registry.already_recorded(registry.MlflowClient(), iteration, fp):
        summary["recorded"] = "already"
        return summary
    flow_run_id = str(flow_run.get_id() or "")
    run_id = registry.log_iteration(path, iteration, runs, lock, sha, flow_run_id)
    summary["mlflow_run_id"] = run_id
    if iteration > 0:
        p = load_params(path / "params.yaml")
        common = {"git_commit": sha, "prefect_flow_run_id": flow_run_id,
                  "judge": f"{p.judge.kind}:{p.judge.version}", "algo": p.update.algo,
                  "reference": p.update.reference, "workspace": str(path)}
        summary.update(registry.register_iteration(path, iteration, lock, run_id, common))
        summary["gate"] = apply_gate(path, iteration, summary["policy_version"])
    summary["recorded"] = "now"
    return summary


def apply_gate(root: Path, iteration: int, version: str) -> str:
    """Move `champion` to the version when its gate decision passed; else record why not."""
    from flows import aliases
    decision = json.loads((root / layout.gate(iteration)).read_text())
    client = registry.MlflowClient()
    if not decision["passed"]:
        why = "; ".join(decision["reasons"])
        client.set_model_version_tag(registry.POLICY_MODEL, version, "gate", f"failed: {why}")
        say(f"gate: iteration {iteration} (v{version}) not promoted: {why}")
        return "failed"
    client.set_model_version_tag(registry.POLICY_MODEL, version, "gate", "passed")
    if aliases.current(client, "champion") != version:
        aliases.move(root, "champion", version, f"gate passed at iteration {iteration}", "gate")
        say(f"gate: iteration {iteration} (v{version}) is the new champion")
    return "passed"


@flow(name="alignloop", flow_run_name="alignloop-{workspace}")
def alignloop(workspace: str, force: list[str] | None = None) -> list[Summary]:
    """Run every stage instance of the workspace's DAG, iteration by iteration.

    `force` names stage instances to recompute even if DVC finds them up to date (rerun);
    every other stage is run, restored from the run-cache, or skipped as DVC decides.
    """
    forced = set(force or [])
    root = Path(workspace)
    logging.getLogger("dvc").setLevel(logging.WARNING)    # our [run]/[ran] lines say it
    summaries = []
    stages = dag.ordered_stages(root)
    final = max(s.iteration for s in stages)
    for iteration, group in groupby(stages, key=lambda s: s.iteration):
        runs = [run_stage(workspace, s.name, force=s.name in forced) for s in group]
        summary = record_iteration(workspace, iteration, runs, last=iteration == final)
        if any(r.outcome != "cached" for r in runs) or summary["recorded"] == "now":
            summary["pushed"] = push_data(workspace)
        summaries.append(summary)
    sys.stdout.flush()
    return summaries
