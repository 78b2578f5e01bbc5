"""MLflow: one run per iteration with a nested run per stage instance, and the model registry.

Every registered version is tied to the exact bytes that produced it: workspace git commit,
DVC stage, the md5 of the model directory (as DVC records it) and of every input, the parent
policy version, the reward model version, the judge, and the Prefect flow-run id. The weights
themselves are stored once, by DVC; a version's source is the workspace path, restorable at
its git commit with `dvc pull` and checked against `model_md5`.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from flows import crashpoints
from flows.dag import StageRun, parse_name
from tasks import layout

EXPERIMENT = "alignloop"
POLICY_MODEL = "alignloop-policy"
REWARD_MODEL = "alignloop-reward-model"
TAG = "alignloop."


def fingerprint(lock: dict[str, Any], names: Sequence[str]) -> str:
    """md5 of the lock entries of these stages: equal iff the same bytes were produced."""
    blob = json.dumps({n: lock.get(n) for n in sorted(names)}, sort_keys=True, default=str)
    return hashlib.md5(blob.encode()).hexdigest()


def params_md5(entry: dict[str, Any]) -> str:
    """md5 of the params values a stage read (its dvc.lock entry), as tags and lineage show it."""
    values = entry.get("params", {}).get(layout.PARAMS_FILE, {})
    return hashlib.md5(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = str(value)


def _entry_io(entry: dict[str, Any], kind: str) -> dict[str, str]:
    """path -> md5 of an entry's deps or outs (directories carry a `.dir` md5)."""
    return {d["path"]: d.get("md5", "") for d in entry.get(kind, [])}


def _stage_metrics(root: Path, entry: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for path in _entry_io(entry, "outs"):
        if path.startswith("metrics/") and path.endswith(".json") and (root / path).is_file():
            for k, v in json.loads((root / path).read_text()).items():
                if isinstance(v, (int, float)) and v == v:       # NaN is not loggable
                    out[k] = float(v)
    return out


def iteration_run(client: MlflowClient, iteration: int, fp: str) -> str | None:
    """The completely logged iteration run of these very lock entries, or None. Runs a killed
    record step left half-logged (tagged `record: logging`) are deleted with their stage runs,
    so that the run about to be logged is the only one."""
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


def log_iteration(root: Path, iteration: int, runs: Sequence[StageRun], lock: dict[str, Any],
                  git_commit: str, flow_run_id: str) -> str:
    """Log the iteration run and its nested stage runs; returns the iteration run id."""
    mlflow.set_experiment(EXPERIMENT)
    names = [r.name for r in runs]
    tags = {f"{TAG}iteration": str(iteration), f"{TAG}git_commit": git_commit,
            f"{TAG}lock_fingerprint": fingerprint(lock, names),
            f"{TAG}prefect_flow_run_id": flow_run_id, f"{TAG}workspace": str(root)}
    pending = {f"{TAG}record": "logging"}       # until every stage run is in: see iteration_run
    client = MlflowClient()
    with mlflow.start_run(run_name=f"iteration {iteration}", tags={**tags, **pending}) as parent:
        children = []
        for i, r in enumerate(runs):
            entry = lock.get(r.name, {})
            stage_tags = {**tags, f"{TAG}dvc_stage": r.name, f"{TAG}outcome": r.outcome}
            stage_tags.update({f"{TAG}dep:{p}": m for p, m in _entry_io(entry, "deps").items()})
            stage_tags.update({f"{TAG}out:{p}": m for p, m in _entry_io(entry, "outs").items()})
            with mlflow.start_run(run_name=r.name, nested=True,
                                  tags={**stage_tags, **pending}) as child:
                params: dict[str, str] = {}
                _flatten("", entry.get("params", {}).get(layout.PARAMS_FILE, {}), params)
                if params:
                    mlflow.log_params(params)
                metrics = _stage_metrics(root, entry)
                metrics["stage/seconds"] = r.seconds
                mlflow.log_metrics(metrics)
                children.append(child.info.run_id)
            if i == len(runs) // 2:
                crashpoints.reach("mlflow_run", iteration)
        for run_id in [*children, parent.info.run_id]:
            client.set_tag(run_id, f"{TAG}record", "done")
        return parent.info.run_id


def _ensure_model(client: MlflowClient, name: str, description: str) -> None:
    try:
        client.create_registered_model(name, description=description)
    except MlflowException as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
            raise


def find_version(client: MlflowClient, name: str, model_md5: str) -> Any | None:
    for mv in client.search_model_versions(f"name = '{name}'"):
        if mv.tags.get("model_md5") == model_md5:
            return mv
    return None


def register(client: MlflowClient, name: str, root: Path, stage: str, lock: dict[str, Any],
             run_id: str, extra_tags: dict[str, str]) -> Any:
    """Register the model directory produced by `stage`, unless these bytes already are."""
    entry = lock[stage]
    out_path = next(p for p in _entry_io(entry, "outs") if p.startswith("models/"))
    model_md5 = _entry_io(entry, "outs")[out_path]
    existing = find_version(client, name, model_md5)
    if existing is not None:
        return existing
    _ensure_model(client, name, f"alignloop {name.split('-', 1)[1]} (one version per iteration)")
    tags = {"model_md5": model_md5, "model_path": out_path, "dvc_stage": stage,
            "iteration": str(parse_name(stage).iteration), **extra_tags}
    tags.update({f"input:{p}": m for p, m in _entry_io(entry, "deps").items()
                 if not p.startswith("tasks/")})
    tags["params_md5"] = params_md5(entry)
    return client.create_model_version(name, source=str(root / out_path), run_id=run_id,
                                       tags=tags, description=f"{stage} at {extra_tags['git_commit']}")


def register_iteration(root: Path, iteration: int, lock: dict[str, Any], run_id: str,
                       common: dict[str, str]) -> dict[str, str]:
    """Register iteration k's reward model and policy; returns their version numbers."""
    client = MlflowClient()
    rm = register(client, REWARD_MODEL, root, f"train_rm@{iteration}", lock, run_id, common)
    crashpoints.reach("rm_version", iteration)
    parent = "initial" if iteration == 1 else _version_of(client, lock, iteration - 1)
    pol = register(client, POLICY_MODEL, root, f"update@{iteration}", lock, run_id,
                   {**common, "parent_policy_version": parent,
                    "reward_model_version": str(rm.version)})
    crashpoints.reach("policy_version", iteration)
    return {"policy_version": str(pol.version), "reward_model_version": str(rm.version)}


def _version_of(client: MlflowClient, lock: dict[str, Any], iteration: int) -> str:
    entry = lock.get(f"update@{iteration}")
    if entry is None:
        return "unknown"
    md5 = _entry_io(entry, "outs").get(layout.policy(iteration), "")
    mv = find_version(client, POLICY_MODEL, md5)
    return str(mv.version) if mv is not None else "unknown"


def latest_passing(client: MlflowClient, lock: dict[str, Any]) -> tuple[int, str] | None:
    """(iteration, version) of the latest iteration whose policy, as dvc.lock holds it now, is
    registered with a passed gate; None when no iteration passed."""
    versions = {mv.tags.get("model_md5"): mv
                for mv in client.search_model_versions(f"name = '{POLICY_MODEL}'")}
    best = None
    for name in lock:
        ref = parse_name(name)
        if ref.base != "update":
            continue
        mv = versions.get(_entry_io(lock[name], "outs").get(layout.policy(ref.iteration)))
        if mv is not None and mv.tags.get("gate") == "passed" and \
                (best is None or ref.iteration > best[0]):
            best = (ref.iteration, str(mv.version))
    return best
