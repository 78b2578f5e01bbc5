"""The alignment loop as a Prefect flow: DVC's stage instances in order, one task each, then
per iteration a record step: commit dvc.lock and params to git, log to MLflow, register the
iteration's models, push data to the DVC remote. At the end, the run's report (flows/report.py)
is rebuilt, logged to the last iteration's MLflow run and published as a Prefect artifact.

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

from flows import dag, registry, targets
from flows.workspace import Workspace, git
from tasks import layout
from tasks.params import load_params

Summary = dict[str, Any]
REPORT_ARTIFACT_KEY = "alignloop-report"     # the Prefect artifact (one version per run)
REPORT_MLFLOW_PATH = "report"                # artifact folder in the last iteration's MLflow run


def say(msg: str) -> None:
    """Progress line for the terminal (and the Prefect log)."""
    print(msg, flush=True)
    try:
        get_run_logger().info(msg)
    except Exception:   # outside a run context (tests calling helpers directly)
        pass


def warn(msg: str) -> None:
    """A warning in the Prefect log (and on the terminal), with the current traceback."""
    logger: logging.Logger | logging.LoggerAdapter
    try:
        logger = get_run_logger()
    except Exception:   # outside a run context
        logger = logging.getLogger(__name__)
    logger.warning(msg, exc_info=True)


@task(name="stage", task_run_name="{name}", cache_policy=NO_CACHE)
def run_stage(root: str, name: str, force: bool = False) -> dag.StageRun:
    say(f"[{'rerun' if force else 'run'}] {name} ...")
    run_id = flow_run.get_id()              # one open DVC repo per flow run: parsed once
    session = dag.session_for(Path(root), str(run_id)) if run_id else None
    result = dag.reproduce(Path(root), name, force=force, session=session)
    say(f"[{result.outcome}] {name} ({result.seconds:.1f} s)")
    if result.outcome == "ran":            # at once: a later failure must not lose the timing
        targets.record_seconds(Path(root), [result], dag.read_lock(Path(root)))
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
    if last and flow_run.get_id():
        dag.end_session(path, str(flow_run.get_id()))    # no stage checks after the last group
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


def ensure_experiment(root: Path) -> None:
    """With the workspace's own MLflow store, create the experiment with its artifact store
    under .alignloop/ (MLflow's default, ./mlruns, is relative to wherever the run started).
    A team's tracking server keeps its own artifact location."""
    import mlflow
    ws = Workspace(root)
    if mlflow.get_tracking_uri() != ws.mlflow_uri:
        return
    client = registry.MlflowClient()
    if client.get_experiment_by_name(registry.EXPERIMENT) is None:
        client.create_experiment(registry.EXPERIMENT,
                                 artifact_location=(ws.state / "mlflow-artifacts").as_uri())


def iteration_run_id(root: Path, summary: Summary) -> str | None:
    """The MLflow run of the summary's iteration: logged by this run, or, when it was already
    recorded, the (non-nested) run tagged with the same lock fingerprint."""
    if summary.get("mlflow_run_id"):
        return str(summary["mlflow_run_id"])
    client = registry.MlflowClient()
    exp = client.get_experiment_by_name(registry.EXPERIMENT)
    if exp is None:
        return None
    fp = registry.fingerprint(dag.read_lock(root), [s["name"] for s in summary["stages"]])
    runs = client.search_runs([exp.experiment_id], filter_string=(
        f"tags.`{registry.TAG}iteration` = '{summary['iteration']}' and "
        f"tags.`{registry.TAG}lock_fingerprint` = '{fp}'"),
        order_by=["attributes.start_time DESC"])
    return next((r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags), None)


@task(name="report", cache_policy=NO_CACHE)
def publish_report(root: str, last: Summary) -> dict[str, str]:
    """Rebuild the run's report into .alignloop/report/, log it to the last iteration's MLflow
    run and publish its table as a Prefect markdown artifact. Returns what was done (`html`,
    `mlflow_run_id`, `prefect_artifact`). A failing step is a warning, never a failed run."""
    from prefect.artifacts import create_markdown_artifact

    from flows import report
    path = Path(root)
    done: dict[str, str] = {}
    try:
        html = report.build_report(path, report.report_dir(path))
    except Exception as e:
        warn(f"report: not built ({type(e).__name__}: {e})")
        return done
    done["html"] = str(html)
    say(f"report: {html}")
    try:
        run_id = iteration_run_id(path, last)
        if run_id is None:
            raise LookupError(f"no MLflow run for iteration {last['iteration']}")
        registry.MlflowClient().log_artifacts(run_id, str(html.parent), REPORT_MLFLOW_PATH)
        done["mlflow_run_id"] = run_id
    except Exception as e:
        warn(f"report: not logged to MLflow ({type(e).__name__}: {e})")
    try:
        markdown = report.render_markdown(path, html, done.get("mlflow_run_id"))
        artifact = create_markdown_artifact(markdown, key=REPORT_ARTIFACT_KEY,
                                            description=f"alignloop report: {path}")
        done["prefect_artifact"] = str(artifact)
    except Exception as e:
        warn(f"report: no Prefect artifact ({type(e).__name__}: {e})")
    return done


@flow(name="alignloop", flow_run_name="alignloop-{workspace}")
def alignloop(workspace: str, force: list[str] | None = None) -> list[Summary]:
    """Run every stage instance of the workspace's DAG, iteration by iteration.

    `force` names stage instances to recompute even if DVC finds them up to date (rerun);
    every other stage is run, restored from the run-cache, or skipped as DVC decides.
    """
    forced = set(force or [])
    root = Path(workspace)
    logging.getLogger("dvc").setLevel(logging.WARNING)    # our [run]/[ran] lines say it
    ensure_experiment(root)
    summaries = []
    stages = dag.ordered_stages(root)
    final = max(s.iteration for s in stages)
    for iteration, group in groupby(stages, key=lambda s: s.iteration):
        runs = [run_stage(workspace, s.name, force=s.name in forced) for s in group]
        summary = record_iteration(workspace, iteration, runs, last=iteration == final)
        if any(r.outcome != "cached" for r in runs) or summary["recorded"] == "now":
            summary["pushed"] = push_data(workspace)
        summaries.append(summary)
    if summaries:
        summaries[-1]["report"] = publish_report(workspace, summaries[-1])
    sys.stdout.flush()
    return summaries
