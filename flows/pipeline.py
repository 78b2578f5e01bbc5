"""The alignment loop as a Prefect flow: DVC's stage instances in order, one task each, then
per iteration a record step: commit dvc.lock and params to git, log to MLflow, register the
iteration's models, push data to the DVC remote. At the end the final stages (the `report`
stage: tasks/stages/report.py) run as DVC decides and are committed on their own; the report is
logged to the last iteration's MLflow run and published as a Prefect artifact.

Prefect result caching stays off: DVC alone decides what is up to date.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import replace
from itertools import groupby
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows import (
    archived,
    crashpoints,
    dag,
    heartbeats,
    registry,
    relocate,
    signals,
    targets,
    tracking,
)
from flows.messages import say, warn
from flows.record import IterationRecord, commit_final, record_iteration
from flows.workspace import STATE_DIR, Workspace
from tasks.core import layout
from tasks.runtime.stage import SUMMARY_FILE_ENV

REPORT_ARTIFACT_KEY = "alignloop-report"     # the Prefect artifact (one version per run)
REPORT_MLFLOW_PATH = "report"                # artifact folder in the last iteration's MLflow run

heartbeats.install()        # every process that runs the flow: it ends without a 0-1 s wait


@task(name="stage", task_run_name="{name}", cache_policy=NO_CACHE)
def run_stage(root: str, name: str, force: bool = False, terminal_cached: bool = True
              ) -> dag.StageRun:
    """Bring one stage instance up to date. Its progress lines go to the terminal and the
    Prefect log, its summary line (`tasks.runtime.stage.say`) to the Prefect log; a stage found up
    to date goes to the terminal only with `terminal_cached` (the loop's stages: the flow says one
    line per iteration found wholly up to date)."""
    run_id = flow_run.get_id()              # one open DVC repo per flow run: parsed once
    session = dag.session_for(Path(root), str(run_id)) if run_id else None
    if session is not None and not force and session.up_to_date(name):
        say(f"[cached] {name}", terminal=terminal_cached)
        return dag.StageRun(name, "cached", 0.0, time.time())
    if not force and archived.skip(Path(root), name):    # weights `alignloop gc` removed
        say(f"[archived] {name}", terminal=terminal_cached)
        return dag.StageRun(name, "cached", 0.0, time.time())
    say(f"[{'rerun' if force else 'run'}] {name} ...")
    summary = Path(root) / STATE_DIR / "logs" / f"{name.replace('@', '-')}.summary"
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.unlink(missing_ok=True)
    os.environ[SUMMARY_FILE_ENV] = str(summary)    # the stage process appends its summary
    try:
        result = dag.reproduce(Path(root), name, force=force, session=session)
    finally:
        os.environ.pop(SUMMARY_FILE_ENV, None)
    if summary.is_file():
        for line in summary.read_text().splitlines():
            say(line, terminal=False)              # the stage printed it itself
        summary.unlink()
    say(f"[{result.outcome}] {name} ({result.seconds:.1f} s)",
        terminal=terminal_cached or result.outcome != "cached")
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


def warm_up(root: Path) -> None:
    """What the flow asks first, asked before it starts (while a Prefect server starts): the
    MLflow store opened and the experiment made, the DAG parsed (dag.ordered_stages keeps its
    answer while the declaration files are unchanged)."""
    ensure_experiment(root)
    dag.ordered_stages(root)


def ensure_experiment(root: Path) -> None:
    """Create the experiment, marked for model training; with the workspace's own MLflow store
    its artifact store is under .alignloop/ (MLflow's default, ./mlruns, is relative to
    wherever the run started). A team's tracking server keeps its own artifact location."""
    import mlflow
    ws = Workspace(root)
    client = registry.MlflowClient()
    exp = client.get_experiment_by_name(tracking.EXPERIMENT)
    if exp is None:
        location = (ws.state / relocate.ARTIFACTS).as_uri() \
            if mlflow.get_tracking_uri() == ws.mlflow_uri else None
        exp_id = client.create_experiment(tracking.EXPERIMENT, artifact_location=location)
    else:
        exp_id = exp.experiment_id
    # MLflow 3 opens an experiment on its GenAI overview unless it is marked for training
    if exp is None or exp.tags.get("mlflow.experimentKind") != "custom_model_development":
        client.set_experiment_tag(exp_id, "mlflow.experimentKind", "custom_model_development")


@task(name="publish-report", cache_policy=NO_CACHE)
def publish_report(root: str, last: IterationRecord) -> dict[str, str]:
    """Log the report the `report` stage built to the last iteration's MLflow run and publish
    its table as a Prefect markdown artifact. Returns what was done (`html`, `mlflow_run_id`,
    `prefect_artifact`). A failing step is a warning, never a failed run."""
    from prefect.artifacts import create_markdown_artifact

    from tasks.evaluation import report
    path = Path(root)
    html = path / layout.REPORT_DIR / report.HTML_NAME
    done: dict[str, str] = {"html": str(html)}
    say(f"report: {html}")
    try:
        run_id = last.mlflow_run_id                # every recorded iteration has its run
        registry.MlflowClient().log_artifacts(run_id, str(html.parent), REPORT_MLFLOW_PATH)
        done["mlflow_run_id"] = run_id
    except Exception as e:  # noqa: BLE001 (the report's MLflow copy is best effort)
        warn(f"report: not logged to MLflow ({type(e).__name__}: {e})")
    try:
        markdown = report.render_markdown(path, html, done.get("mlflow_run_id"))
        if last.policy_version:
            markdown += (f"\nIteration {last.iteration} at workspace commit "
                         f"`{last.git_commit[:10]}`: policy "
                         f"`models:/{registry.POLICY_MODEL}/{last.policy_version}` (gate "
                         f"{last.gate}), reward model `models:/{registry.REWARD_MODEL}/"
                         f"{last.reward_model_version}`.\n")
        artifact = create_markdown_artifact(markdown, key=REPORT_ARTIFACT_KEY,
                                            description=f"alignloop report: {path}")
        done["prefect_artifact"] = str(artifact)
    except Exception as e:  # noqa: BLE001 (the Prefect artifact is best effort)
        warn(f"report: no Prefect artifact ({type(e).__name__}: {e})")
    return done


class _EmptyLabels(logging.Filter):
    """DVC warns that the audit labels file is empty at every check of every train_rm stage
    (16 lines a tiny run); it is empty until a person audits, which is no news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and
                    f"'{layout.AUDIT_LABELS}' is empty" in record.getMessage())


@flow(name="alignloop", flow_run_name="alignloop-{workspace}")
def alignloop(workspace: str, force: list[str] | None = None) -> list[IterationRecord]:
    """Run every stage instance of the workspace's DAG, iteration by iteration.

    `force` names stage instances to recompute even if DVC finds them up to date (rerun);
    every other stage is run, restored from the run-cache, or skipped as DVC decides.
    """
    signals.reinstall()                                   # over Prefect's (flows/signals.py)
    forced = set(force or [])
    root = Path(workspace)
    dvc_log = logging.getLogger("dvc")
    dvc_log.setLevel(logging.WARNING)                     # our [run]/[ran] lines say it
    empty = logging.getLogger("dvc.output")              # a filter acts where it is logged
    if not any(isinstance(f, _EmptyLabels) for f in empty.filters):
        empty.addFilter(_EmptyLabels())
    for name in archived.PUSH_LOGGERS:                   # `dvc push` on archived weights
        lg = logging.getLogger(name)
        if not any(isinstance(f, archived.ArchivedPushWarning) for f in lg.filters):
            lg.addFilter(archived.ArchivedPushWarning(root))
    ensure_experiment(root)
    records: list[IterationRecord] = []
    stages = dag.ordered_stages(root)
    loop = [s for s in stages if s.base not in layout.FINAL_STAGES]
    final = max(s.iteration for s in loop)
    for iteration, group in groupby(loop, key=lambda s: s.iteration):
        runs = []
        for s in group:
            signals.check()
            runs.append(run_stage(workspace, s.name, force=s.name in forced,
                                  terminal_cached=False))
        if all(r.outcome == "cached" for r in runs):
            say(f"[cached] iteration {iteration}: {len(runs)} stages up to date")
        record = record_iteration(workspace, iteration, runs, last=iteration == final)
        if record.ran() or not record.pushed:
            crashpoints.reach("dvc_push", iteration)
            record = replace(record, pushed=str(push_data(workspace)))
            registry.MlflowClient().set_tag(record.mlflow_run_id, f"{tracking.TAG}pushed",
                                            record.pushed)
        records.append(record)
    runs = []
    for s in stages:                                     # the report, after every iteration
        if s.base in layout.FINAL_STAGES:
            signals.check()
            runs.append(run_stage(workspace, s.name, force=s.name in forced))
    if flow_run.get_id():
        dag.end_session(root, str(flow_run.get_id()))    # no stage checks after these
    if commit_final(root, runs):
        push_data(workspace)
    if records:
        last = records[-1]
        tracking.log_final_stages(root, last.mlflow_run_id, last.iteration, runs,
                                  dag.read_lock(root))
        records[-1] = replace(last, report=publish_report(workspace, last))
    sys.stdout.flush()
    return records
