"""The alignment loop as a Prefect flow: DVC's stage instances in order, one task each, then
per iteration a record step: commit dvc.lock and params to git, log to MLflow, register the
iteration's models, push data to the DVC remote. At the end the final stages (the `report`
stage: tasks/stages/report.py) run as DVC decides and are committed on their own; the report is
logged to the last iteration's MLflow run and published as a Prefect artifact.

Prefect result caching stays off: DVC alone decides what is up to date.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict
from itertools import groupby
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows import (
    crashpoints,
    dag,
    heartbeats,
    registry,
    registry_record,
    relocate,
    signals,
    targets,
    tracking,
)
from flows.workspace import STATE_DIR, Workspace, git, git_bytes
from tasks.config.params import JudgeParams
from tasks.core import layout
from tasks.judging.judges import PAIRWISE_KINDS
from tasks.judging.pairwise import load_template
from tasks.runtime.stage import SUMMARY_FILE_ENV

Summary = dict[str, Any]
REPORT_ARTIFACT_KEY = "alignloop-report"     # the Prefect artifact (one version per run)
REPORT_MLFLOW_PATH = "report"                # artifact folder in the last iteration's MLflow run

heartbeats.install()        # every process that runs the flow: it ends without a 0-1 s wait


def say(msg: str, terminal: bool = True) -> None:
    """Progress line for the terminal (unless `terminal` is False) and the Prefect log."""
    if terminal:
        print(msg, flush=True)
    try:
        get_run_logger().info(msg)
    except Exception:   # noqa: BLE001 (outside a run context (tests calling helpers directly))
        pass


def warn(msg: str) -> None:
    """A warning in the Prefect log (and on the terminal), with the current traceback."""
    logger: logging.Logger | logging.LoggerAdapter
    try:
        logger = get_run_logger()
    except Exception:   # noqa: BLE001 (outside a run context)
        logger = logging.getLogger(__name__)
    logger.warning(msg, exc_info=True)


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


def _uncommitted(root: Path, runs: list[dag.StageRun]) -> list[str]:
    """The stage instances of `runs` whose dvc.lock entries differ from HEAD's: they ran now or
    in a run killed before their commit."""
    lock = dag.read_lock(root)
    head = dag.read_lock(root, git_bytes(root, "show", "HEAD:dvc.lock") or b"")
    return [r.name for r in runs if lock.get(r.name) != head.get(r.name)]


def _commit(root: Path, title: str, runs: list[dag.StageRun], new: list[str]) -> None:
    outcomes = {r.name: r.outcome for r in runs}
    body = ", ".join(f"{n} ({outcomes[n]})" for n in new) or "no stage ran"
    git(root, "commit", "-q", "-m", f"{title}\n\nStages: {body}")


def commit_iteration(root: Path, iteration: int, runs: list[dag.StageRun],
                     last: bool) -> str:
    """Commit what the iteration changed (dvc.lock, params, metrics); returns HEAD's sha.

    The iteration's results are uncommitted when its stages' dvc.lock entries differ from
    HEAD's, whether the stages ran now or in a run killed before its commit. A group with
    nothing uncommitted commits nothing (its other changes, say a params edit for a later
    iteration, go with the next commit), except the last one, which leaves a clean tree. The
    `iteration-k` tag marks the commit that holds iteration k's results.
    """
    new = _uncommitted(root, runs)
    git(root, "add", "-A")
    if git(root, "status", "--porcelain") and (new or last):
        _commit(root, f"alignloop: iteration {iteration}" if new else
                "alignloop: declaration update", runs, new)
    sha = git(root, "rev-parse", "HEAD")
    tag = f"iteration-{iteration}"
    if iteration > 0 and (new or not git(root, "tag", "--list", tag)):
        git(root, "tag", "-f", tag, sha)
    return sha


def commit_final(root: Path, runs: list[dag.StageRun]) -> bool:
    """Commit the final stages' dvc.lock entries (the report) when they differ from HEAD's, on
    a commit of their own after the last iteration's: a report that fails to build costs no
    iteration its record. True if it committed."""
    new = _uncommitted(root, runs)
    git(root, "add", "-A")
    if not (new and git(root, "status", "--porcelain")):
        return False
    _commit(root, "alignloop: report", runs, new)
    return True


@task(name="record-iteration", task_run_name="record-iteration-{iteration}",
      cache_policy=NO_CACHE)
def record_iteration(root: str, iteration: int, runs: list[dag.StageRun],
                     last: bool = False) -> Summary:
    """The iteration's ledger, as a transaction that a crash at any point cannot lose: every
    step finds what an earlier, killed run already did and does only the rest, so any run
    ends with one commit, one complete MLflow run, one reward-model and one policy version,
    and the champion on the latest iteration that passed its gate."""
    path = Path(root)
    signals.check()
    assessed = None
    if last and iteration > 0:          # the targets' decision goes into the iteration's commit
        loop = [s.name for s in dag.ordered_stages(path) if s.base not in layout.FINAL_STAGES]
        try:
            assessed = targets.assess(path, loop)
        except (OSError, ValueError) as e:        # never costs the iteration its record
            warn(f"targets: not assessed ({type(e).__name__}: {e})")
        if assessed is not None:
            targets.write(path, assessed)
    sha = commit_iteration(path, iteration, runs, last)
    crashpoints.reach("git_commit", iteration)
    lock = dag.read_lock(path)
    fp = dag.fingerprint(lock, [r.name for r in runs])
    summary: Summary = {"iteration": iteration, "git_commit": sha,
                        "stages": [asdict(r) for r in runs]}
    flow_run_id = str(flow_run.get_id() or "")
    run_id = tracking.iteration_run(registry.MlflowClient(), iteration, fp)
    summary["recorded"] = "already" if run_id else "now"
    if run_id is None:
        run_id = tracking.log_iteration(path, iteration, runs, lock, sha, flow_run_id)
    summary["mlflow_run_id"] = run_id
    if assessed is not None:
        for line in targets.lines(assessed):
            say(line, terminal=False)          # `alignloop run` prints them when it ends
        if summary["recorded"] == "now":
            tracking.log_targets(run_id, assessed)
    summary["pushed"] = registry.MlflowClient().get_run(run_id).data.tags.get(
        f"{tracking.TAG}pushed")                     # set once its data reached the remote
    if iteration > 0:
        p = Workspace(path).params()
        common = {"git_commit": sha, "prefect_flow_run_id": flow_run_id,
                  **judge_tags(p.judge, path), "algo": p.update.algo,
                  "reference": p.update.reference, "workspace": str(path)}
        summary.update(registry.register_iteration(path, iteration, lock, run_id, common))
        summary["gate"] = apply_gate(path, iteration, summary["policy_version"])
        registry_record.sync(path, f"alignloop: registry record, iteration {iteration}")
    return summary


def judge_tags(jp: JudgeParams, root: Path) -> dict[str, str]:
    """The judge as registry tags: kind:version for the lexicons (as before); for pairwise
    judges kind:model (or kind:served, the server's one model), its template and its md5; for
    a reward-model judge its directory and weights md5."""
    if jp.kind == "reward_model":
        from tasks.judging.judge_rm import rm_md5
        model = (root / Path(jp.model).expanduser()).resolve()
        return {"judge": f"reward_model:{jp.model}", "judge_model_md5": rm_md5(model)}
    if jp.kind not in PAIRWISE_KINDS:
        return {"judge": f"{jp.kind}:{jp.version}"}
    return {"judge": f"{jp.kind}:{jp.model or 'served'}", "judge_template": jp.template,
            "judge_template_md5": load_template(root, jp.template).md5,
            "judge_decoding": jp.decoding}


def apply_gate(root: Path, iteration: int, version: str) -> str:
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
    best = registry.latest_passing(client, dag.read_lock(root))
    if best is not None:
        best_it, best_version = best
        moved = aliases.ensure(root, "champion", best_version,
                               f"gate passed at iteration {best_it}", "gate", best_it)
        if moved:
            say(f"gate: iteration {best_it} (v{best_version}) is the new champion")
    return "passed" if decision["passed"] else "failed"


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
def publish_report(root: str, last: Summary) -> dict[str, str]:
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
        run_id = str(last["mlflow_run_id"])        # every recorded iteration has its run
        registry.MlflowClient().log_artifacts(run_id, str(html.parent), REPORT_MLFLOW_PATH)
        done["mlflow_run_id"] = run_id
    except Exception as e:  # noqa: BLE001 (the report's MLflow copy is best effort)
        warn(f"report: not logged to MLflow ({type(e).__name__}: {e})")
    try:
        markdown = report.render_markdown(path, html, done.get("mlflow_run_id"))
        if last.get("policy_version"):
            markdown += (f"\nIteration {last['iteration']} at workspace commit "
                         f"`{str(last['git_commit'])[:10]}`: policy "
                         f"`models:/{registry.POLICY_MODEL}/{last['policy_version']}` (gate "
                         f"{last.get('gate')}), reward model `models:/{registry.REWARD_MODEL}/"
                         f"{last['reward_model_version']}`.\n")
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
def alignloop(workspace: str, force: list[str] | None = None) -> list[Summary]:
    """Run every stage instance of the workspace's DAG, iteration by iteration.

    `force` names stage instances to recompute even if DVC finds them up to date (rerun);
    every other stage is run, restored from the run-cache, or skipped as DVC decides.
    """
    forced = set(force or [])
    root = Path(workspace)
    dvc_log = logging.getLogger("dvc")
    dvc_log.setLevel(logging.WARNING)                     # our [run]/[ran] lines say it
    empty = logging.getLogger("dvc.output")              # a filter acts where it is logged
    if not any(isinstance(f, _EmptyLabels) for f in empty.filters):
        empty.addFilter(_EmptyLabels())
    ensure_experiment(root)
    summaries = []
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
        summary = record_iteration(workspace, iteration, runs, last=iteration == final)
        if any(r.outcome != "cached" for r in runs) or not summary["pushed"]:
            crashpoints.reach("dvc_push", iteration)
            summary["pushed"] = push_data(workspace)
            registry.MlflowClient().set_tag(summary["mlflow_run_id"], f"{tracking.TAG}pushed",
                                            str(summary["pushed"]))
        summaries.append(summary)
    runs = []
    for s in stages:                                     # the report, after every iteration
        if s.base in layout.FINAL_STAGES:
            signals.check()
            runs.append(run_stage(workspace, s.name, force=s.name in forced))
    if flow_run.get_id():
        dag.end_session(root, str(flow_run.get_id()))    # no stage checks after these
    if commit_final(root, runs):
        push_data(workspace)
    if summaries:
        last = summaries[-1]
        tracking.log_final_stages(root, str(last["mlflow_run_id"]), int(last["iteration"]),
                                  runs, dag.read_lock(root))
        last["report"] = publish_report(workspace, last)
    sys.stdout.flush()
    return summaries
