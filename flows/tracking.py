"""MLflow runs of the loop, laid out for a person who audits in the MLflow UI.

- One run per iteration (`iteration k`) with a nested run per stage instance, created with the
  stages' real start and end times. A stage run carries its params, its metrics (at
  step = iteration), its outcome, one `code_md5` for its source files, the torch device it ran
  on (`device`: the `device` param resolved, for the stages that declare it), and every data/model
  input as an MLflow dataset input whose name is the DVC path, whose digest is DVC's md5 and
  whose source is that object in the DVC remote. The iteration run carries the iteration's
  headline metrics too, so the runs table shows them.
- One `loop` run per workspace holds the headline metrics of every iteration at step =
  iteration: the chart of win rate, KL, length and RM accuracy against the iteration.
- A run being logged is tagged `record: logging` until all of it is in; `iteration_run` finds
  the finished one and deletes what a killed record step left half-logged.
"""
from __future__ import annotations

import configparser
import hashlib
import json
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from flows import crashpoints
from flows.dag import StageRun, fingerprint, flatten
from flows.verify import object_path
from tasks.core import layout

EXPERIMENT = "alignloop"
TAG = "alignloop."
HEADLINE = ("eval/win_rate", "eval/win_rate_ci_low", "eval/gold_win_rate",
            "eval/gold_win_rate_ci_low", "eval/rm_win_rate", "eval/bon_gold_win_rate", "eval/kl",
            "eval/length_ratio", "eval/on_topic_rate", "eval/review_rate", "eval/fluency_nll",
            "rm/accuracy")


def entry_io(entry: dict[str, Any], kind: str) -> dict[str, str]:
    """path -> md5 of an entry's deps or outs (directories carry a `.dir` md5)."""
    return {d["path"]: d.get("md5", "") for d in entry.get(kind, [])}


def stage_metrics(root: Path, entry: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for path in entry_io(entry, "outs"):
        if path.startswith("metrics/") and path.endswith(".json") and (root / path).is_file():
            for k, v in json.loads((root / path).read_text()).items():
                if isinstance(v, (int, float)) and v == v:       # NaN is not loggable
                    out[k] = float(v)
    return out


def code_md5(entry: dict[str, Any]) -> str:
    """One md5 for a stage's source files (each is a dep; ~40 tags folded into one)."""
    code = sorted(f"{p}:{m}" for p, m in entry_io(entry, "deps").items()
                  if p.startswith("tasks/"))
    return hashlib.md5("\n".join(code).encode()).hexdigest()


def ran_on(entry: dict[str, Any], outcome: str) -> dict[str, str]:
    """The `device` tag of a stage run: its `device` param resolved as the stage resolved it
    (tasks/runtime/device.py, on this machine: stages run here as the flow's subprocesses). Only for
    a stage that declares the param and ran now: restored or cached outputs were computed earlier,
    maybe elsewhere, and their param value (auto, say) does not say where."""
    name = entry.get("params", {}).get(layout.PARAMS_FILE, {}).get("device")
    if name is None or outcome != "ran":
        return {}
    from tasks.runtime.device import resolve_device  # torch, not transformers: only here
    return {f"{TAG}device": str(resolve_device(str(name)))}


def remote_url(root: Path) -> str | None:
    """The default DVC remote's URL (file:// for a local directory), from .dvc/config."""
    conf = configparser.ConfigParser()
    conf.read([root / ".dvc" / "config", root / ".dvc" / "config.local"])
    name = conf.get("core", "remote", fallback=None)
    url = conf.get(f"'remote \"{name}\"'", "url", fallback=None) if name else None
    if url and "://" not in url:
        path = Path(url)
        url = (path if path.is_absolute() else (root / ".dvc" / path).resolve()).as_uri()
    return url


def _datasets(root: Path, entry: dict[str, Any], remote: str | None) -> list[DatasetInput]:
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    out = []
    for path, md5 in entry_io(entry, "deps").items():
        if path.startswith("tasks/") or not md5:
            continue
        where = f"{remote}/files/md5/{object_path(Path(), md5).as_posix()}" if remote else \
            (root / path).as_uri()
        try:
            with warnings.catch_warnings():   # MLflow registers its local source twice and
                warnings.filterwarnings(      # says so on every resolve: not the user's concern
                    "ignore", message="The specified dataset source can be interpreted")
                source = resolve_dataset_source(where)
        except Exception:   # noqa: BLE001 (a remote scheme MLflow has no dataset source for)
            source = HTTPDatasetSource(where)
        ds = MetaDataset(source=source, name=path, digest=md5)
        kind = "model" if path.startswith("models/") else "data"
        out.append(DatasetInput(ds._to_mlflow_entity(),   # noqa: SLF001 (the client API's type)
                                [InputTag("mlflow.data.context", kind)]))
    return out


def iteration_run(client: MlflowClient, iteration: int, fp: str) -> str | None:
    """The completely logged iteration run of these very lock entries, or None. Runs a killed
    record step left half-logged are deleted with their stage runs, so that the run about to
    be logged is the only one."""
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=(
        f"tags.`{TAG}iteration` = '{iteration}' and tags.`{TAG}lock_fingerprint` = '{fp}'"),
        order_by=["attributes.start_time ASC"])
    pending = {r.info.run_id for r in runs if r.data.tags.get(f"{TAG}record") == "logging"}
    done = None
    for r in runs:
        parent = r.data.tags.get("mlflow.parentRunId")
        if r.info.run_id in pending or parent in pending:
            client.delete_run(r.info.run_id)
        elif parent is None and done is None:
            done = r.info.run_id
    return done


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def log_iteration(root: Path, iteration: int, runs: Sequence[StageRun], lock: dict[str, Any],
                  git_commit: str, flow_run_id: str) -> str:
    """Log the iteration run and its nested stage runs; returns the iteration run id."""
    client = MlflowClient()
    exp_id = mlflow.set_experiment(EXPERIMENT).experiment_id
    now = time.time()
    tags = {f"{TAG}iteration": str(iteration), f"{TAG}git_commit": git_commit,
            f"{TAG}lock_fingerprint": fingerprint(lock, [r.name for r in runs]),
            f"{TAG}prefect_flow_run_id": flow_run_id, f"{TAG}workspace": str(root),
            f"{TAG}record": "logging"}       # until every stage run is in: see iteration_run
    starts = [r.started for r in runs if r.started] or [now]
    parent = client.create_run(exp_id, start_time=_ms(min(starts)), tags=tags,
                               run_name=f"iteration {iteration}").info.run_id
    remote, children, headline = remote_url(root), [], {}
    for i, r in enumerate(runs):
        child, metrics = _log_stage_run(client, exp_id, root, parent, tags, r, lock, remote,
                                        iteration)
        headline.update({k: v for k, v in metrics.items() if k in HEADLINE})
        children.append(child)
        if i == len(runs) // 2:
            crashpoints.reach("mlflow_run", iteration)
    client.log_batch(parent, metrics=[Metric(k, v, _ms(now), iteration)
                                      for k, v in headline.items()])
    log_loop_point(client, exp_id, root, iteration, headline)
    for run_id in children:
        client.set_tag(run_id, f"{TAG}record", "done")
    client.set_tag(parent, f"{TAG}record", "done")
    ends = [(r.started or now) + r.seconds for r in runs] or [now]
    client.set_terminated(parent, end_time=_ms(max(ends)))
    return parent


def _log_stage_run(client: MlflowClient, exp_id: str, root: Path, parent: str,
                   tags: dict[str, str], r: StageRun, lock: dict[str, Any], remote: str | None,
                   iteration: int) -> tuple[str, dict[str, float]]:
    """One stage run nested under `parent`: its lock entry's params, metrics, inputs (as
    datasets with their DVC md5) and outputs; returns its id and metrics."""
    entry, now = lock.get(r.name, {}), time.time()
    stage_tags = {**tags, "mlflow.parentRunId": parent, f"{TAG}dvc_stage": r.name,
                  f"{TAG}outcome": r.outcome, f"{TAG}code_md5": code_md5(entry)}
    stage_tags.update({f"{TAG}out:{p}": m for p, m in entry_io(entry, "outs").items()})
    stage_tags.update(ran_on(entry, r.outcome))
    start = r.started or now
    child = client.create_run(exp_id, start_time=_ms(start), tags=stage_tags,
                              run_name=r.name).info.run_id
    params = {k: str(v) for k, v in
              flatten("", entry.get("params", {}).get(layout.PARAMS_FILE, {}), {}).items()}
    metrics = {**stage_metrics(root, entry), "stage/seconds": r.seconds}
    client.log_batch(child, params=[Param(k, v[:6000]) for k, v in params.items()],
                     metrics=[Metric(k, v, _ms(now), iteration) for k, v in metrics.items()])
    client.log_inputs(child, datasets=_datasets(root, entry, remote))
    log_curves(client, child, root, entry, _ms(start))
    client.set_terminated(child, end_time=_ms(start + r.seconds))
    return child, metrics


def log_curves(client: MlflowClient, run_id: str, root: Path, entry: dict[str, Any],
               start_ms: int) -> int:
    """The per-step training curves a stage's model directories hold (training_curve.json:
    one record per optimiser step) as `train/<key>` metrics at step = the step's index (an
    ensemble's members as `train/member_<i>/<key>`), so MLflow draws loss, reward margin,
    log-ratio and learning rate against steps. Returns the points logged."""
    points: list[Metric] = []
    for out in entry_io(entry, "outs"):
        path = root / out / layout.TRAINING_CURVE
        if not path.is_file():
            continue
        records = json.loads(path.read_text())
        several = len({r.get("member") for r in records}) > 1
        steps: dict[float, int] = {}
        for record in records:
            member = record.get("member")
            prefix = f"train/member_{int(member)}/" if several else "train/"
            step = steps[member] = steps.get(member, -1) + 1
            points += [Metric(prefix + k, float(v), start_ms, step) for k, v in record.items()
                       if k != "member"]
    for i in range(0, len(points), 1000):             # MLflow's log_batch limit
        client.log_batch(run_id, metrics=points[i:i + 1000])
    return len(points)


def log_final_stages(root: Path, parent: str, iteration: int, runs: Sequence[StageRun],
                     lock: dict[str, Any]) -> list[str]:
    """The final stages (the report) as stage runs nested under the last iteration's run,
    each once per lock entry: a stage run of these very bytes already logged (say by a run
    killed after it) is not logged again. Returns the names logged now."""
    if not runs:
        return []
    client = MlflowClient()
    exp_id = mlflow.set_experiment(EXPERIMENT).experiment_id
    remote, logged = remote_url(root), []
    for r in runs:
        fp = fingerprint(lock, [r.name])
        if client.search_runs([exp_id], filter_string=(
                f"tags.`{TAG}dvc_stage` = '{r.name}' and tags.`{TAG}lock_fingerprint` = '{fp}'"),
                max_results=1):
            continue
        tags = {f"{TAG}iteration": str(iteration), f"{TAG}lock_fingerprint": fp,
                f"{TAG}workspace": str(root), f"{TAG}record": "done"}
        _log_stage_run(client, exp_id, root, parent, tags, r, lock, remote, iteration)
        logged.append(r.name)
    return logged


def loop_run(client: MlflowClient, exp_id: str, root: Path) -> str:
    """The workspace's `loop` run (created on first use): one point per iteration."""
    found = client.search_runs([exp_id], filter_string=(
        f"tags.`{TAG}loop` = 'true' and tags.`{TAG}workspace` = '{root}'"), max_results=1)
    if found:
        return found[0].info.run_id
    run = client.create_run(exp_id, run_name="loop", tags={
        f"{TAG}loop": "true", f"{TAG}workspace": str(root),
        "mlflow.note.content": "Headline metrics of every iteration of this workspace, at "
                               "step = iteration (judge, gold and RM win rates, KL, length, "
                               "RM accuracy): open Model metrics for the curves."})
    return run.info.run_id


def log_targets(run_id: str, result: dict[str, Any]) -> None:
    """The targets' decision on the last iteration's run: `targets/met` and `targets/of` as
    metrics, each check as `targets/<name>` (1 met, 0 missed), the block as targets.json."""
    client = MlflowClient()
    now, step = _ms(time.time()), int(result["iteration"])
    checks = {f"targets/{_metric_name(c['name'])}": float(c["met"]) for c in result["checks"]}
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in
                                      {"targets/met": result["met"], "targets/of": result["of"],
                                       **checks}.items()])
    client.log_dict(run_id, dict(result), "targets.json")


def _metric_name(text: str) -> str:
    """An MLflow metric name from a check's name (letters, digits, _ - . / and spaces only)."""
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in text).strip()


def log_loop_point(client: MlflowClient, exp_id: str, root: Path, iteration: int,
                   metrics: dict[str, float]) -> None:
    """The iteration's headline metrics on the loop run, each once per (step, value): a record
    step redone after a kill adds no second point."""
    run_id = loop_run(client, exp_id, root)
    new = []
    for k, v in metrics.items():
        seen = {(m.step, m.value) for m in client.get_metric_history(run_id, k)}
        if (iteration, v) not in seen:
            new.append(Metric(k, v, _ms(time.time()), iteration))
    if new:
        client.log_batch(run_id, metrics=new, tags=[RunTag(f"{TAG}last_iteration",
                                                           str(iteration))])
    client.set_terminated(run_id)             # finished as of this iteration
