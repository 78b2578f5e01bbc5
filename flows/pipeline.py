"""The alignment loop as a Prefect flow: DVC's stage instances in order, one task each, then
per iteration a record step: commit dvc.lock and params to git, log to MLflow, register the
iteration's models, push data to the DVC remote.

Prefect result caching stays off: DVC alone decides what is up to date.
"""
from __future__ import annotations

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
def run_stage(root: str, name: str) -> dag.StageRun:
    say(f"[run] {name} ...")
    result = dag.reproduce(Path(root), name)
    say(f"[{result.outcome}] {name} ({result.seconds:.1f} s)")
    return result


@task(name="dvc-push", retries=3, retry_delay_seconds=[1, 4, 16], cache_policy=NO_CACHE)
def push_data(root: str) -> int:
    """Push every cached output to the DVC remote (I/O: may flake, so retried)."""
    import contextlib

    from dvc.repo import Repo
    with contextlib.chdir(root), Repo(root) as repo:
        return int(repo.push())


def commit_iteration(root: Path, iteration: int, runs: list[dag.StageRun]) -> str:
    """Commit dvc.lock, params and metrics when they changed; returns HEAD's sha."""
    git(root, "add", "-A")
    if git(root, "status", "--porcelain"):
        ran = ", ".join(f"{r.name} ({r.outcome})" for r in runs if r.outcome != "cached")
        git(root, "commit", "-q", "-m", f"alignloop: iteration {iteration}\n\nStages: "
                                         f"{ran or 'none'}")
    sha = git(root, "rev-parse", "HEAD")
    if iteration > 0:
        git(root, "tag", "-f", f"iteration-{iteration}", sha)
    return sha


@task(name="record-iteration", task_run_name="record-iteration-{iteration}",
      cache_policy=NO_CACHE)
def record_iteration(root: str, iteration: int, runs: list[dag.StageRun]) -> Summary:
    path = Path(root)
    sha = commit_iteration(path, iteration, runs)
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
    summary["recorded"] = "now"
    return summary


@flow(name="alignloop", flow_run_name="alignloop-{workspace}")
def alignloop(workspace: str) -> list[Summary]:
    """Run every stage instance of the workspace's DAG, iteration by iteration."""
    root = Path(workspace)
    logging.getLogger("dvc").setLevel(logging.WARNING)    # our [run]/[ran] lines say it
    summaries = []
    stages = dag.ordered_stages(root)
    for iteration, group in groupby(stages, key=lambda s: s.iteration):
        runs = [run_stage(workspace, s.name) for s in group]
        summary = record_iteration(workspace, iteration, runs)
        if any(r.outcome != "cached" for r in runs) or summary["recorded"] == "now":
            summary["pushed"] = push_data(workspace)
        summaries.append(summary)
    sys.stdout.flush()
    return summaries
