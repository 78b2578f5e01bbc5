"""The MLflow model registry: one reward-model and one policy version per iteration (the runs
they come from are logged by flows/tracking.py).

Every registered version is tied to the exact bytes that produced it: workspace git commit,
DVC stage, the md5 of the model directory (as DVC records it) and of every input, the parent
policy version, the reward model version, the judge, and the Prefect flow-run id. The weights
themselves are stored once, by DVC, and found by `model_md5` (flows/restore.py). A version's
`source` is where MLflow itself would load it from: the workspace path when the registry is this
machine's store; on a tracking server (which accepts only sources inside the run's artifacts) a
run artifact directory `runs:/<run>/<model_path>` holding only `dvc-pointer.json` (path, md5,
commit and how to restore them); the weights are never uploaded.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from flows import crashpoints
from flows.dag import parse_name
from flows.tracking import entry_io
from tasks.config.params import Params, prev_of
from tasks.core import layout

POLICY_MODEL = "alignloop-policy"
REWARD_MODEL = "alignloop-reward-model"


def params_md5(entry: dict[str, Any]) -> str:
    """md5 of the params values a stage read (its dvc.lock entry), as tags and lineage show it."""
    values = entry.get("params", {}).get(layout.PARAMS_FILE, {})
    return hashlib.md5(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


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
    out_path = next(p for p in entry_io(entry, "outs") if p.startswith("models/"))
    model_md5 = entry_io(entry, "outs")[out_path]
    existing = find_version(client, name, model_md5)
    if existing is not None:
        return existing
    _ensure_model(client, name, f"alignloop {name.split('-', 1)[1]} (one version per iteration)")
    tags = {"model_md5": model_md5, "model_path": out_path, "dvc_stage": stage,
            "iteration": str(parse_name(stage).iteration), **extra_tags}
    tags.update({f"input:{p}": m for p, m in entry_io(entry, "deps").items()
                 if not p.startswith("tasks/")})
    tags["params_md5"] = params_md5(entry)
    links = [f"`{stage}` at workspace commit `{extra_tags['git_commit'][:10]}`, run "
             f"[{run_id[:8]}](#/experiments/{client.get_run(run_id).info.experiment_id}"
             f"/runs/{run_id})"]
    for key, model in (("parent_policy_version", POLICY_MODEL),
                       ("reward_model_version", REWARD_MODEL)):
        version = extra_tags.get(key, "")
        if version.isdigit():
            tags[key.replace("_version", "_uri")] = f"models:/{model}/{version}"
            links.append(f"{key.replace('_version', '').replace('_', ' ')}: "
                         f"[{model} v{version}](#/models/{model}/versions/{version})")
    source = _source(client, root, out_path, run_id, tags)
    return client.create_model_version(name, source=source, run_id=run_id,
                                       tags=tags, description="\n\n".join(links))


def _served_registry() -> bool:
    """True when the registry is a tracking server (http, https, databricks), not a store this
    process opens itself (a SQLite file, a database URL, a directory)."""
    from mlflow import get_registry_uri
    scheme = urlparse(get_registry_uri()).scheme
    return scheme in ("http", "https") or scheme.startswith("databricks")


def _source(client: MlflowClient, root: Path, out_path: str, run_id: str,
            tags: dict[str, str]) -> str:
    if not _served_registry():
        return str(root / out_path)
    pointer = {k: tags[k] for k in ("model_path", "model_md5", "dvc_stage", "git_commit")
               if k in tags}
    pointer["restore"] = (f"git checkout {tags.get('git_commit', '<commit>')} && "
                          f"dvc pull {out_path}")
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "dvc-pointer.json"
        f.write_text(json.dumps(pointer, indent=2) + "\n")
        client.log_artifact(run_id, str(f), artifact_path=out_path)
    return f"runs:/{run_id}/{out_path}"


def register_iteration(root: Path, iteration: int, lock: dict[str, Any], run_id: str,
                       common: dict[str, str], p: Params) -> dict[str, str]:
    """Register iteration k's reward model and policy (the workspace's params `p` say what it
    started from); returns their version numbers."""
    client = MlflowClient()
    rm = register(client, REWARD_MODEL, root, f"train_rm@{iteration}", lock, run_id, common)
    crashpoints.reach("rm_version", iteration)
    prev = prev_of(p, iteration)                                        # what it started from
    parent = "initial" if prev == 0 else _version_of(client, lock, prev)
    pol = register(client, POLICY_MODEL, root, f"update@{iteration}", lock, run_id,
                   {**common, "parent_policy_version": parent,
                    "reward_model_version": str(rm.version)})
    crashpoints.reach("policy_version", iteration)
    return {"policy_version": str(pol.version), "reward_model_version": str(rm.version)}


def _version_of(client: MlflowClient, lock: dict[str, Any], iteration: int) -> str:
    entry = lock.get(f"update@{iteration}")
    if entry is None:
        return "unknown"
    md5 = entry_io(entry, "outs").get(layout.policy(iteration), "")
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
        mv = versions.get(entry_io(lock[name], "outs").get(layout.policy(ref.iteration)))
        if mv is not None and mv.tags.get("gate") == "passed" and \
                (best is None or ref.iteration > best[0]):
            best = (ref.iteration, str(mv.version))
    return best
