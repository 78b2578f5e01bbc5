"""The registry's record in git: every registered version of the workspace's models, as text.

The MLflow store lives in `.alignloop/` and does not travel with `git clone`; this record does.
`registry/versions.json` holds, for each registered reward-model and policy version, the tags
lineage reads (git commit, DVC stage, model md5, parent policy, reward model, judge, gate) and
the aliases on it; the alias moves themselves are in the ledger beside it
(`registry/aliases.jsonl`). It is rewritten from the store and committed after each iteration is
recorded and after each alias move, so a clone that ran `dvc pull` audits a model with
`alignloop lineage` and no MLflow store: `Record` answers the registry calls lineage makes.

Why a record rather than lineage rebuilt from `dvc.lock` alone: version numbers, aliases and
gate decisions exist only in the registry, and an auditor asks about `models:/NAME@ALIAS`.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from flows.registry import POLICY_MODEL, REWARD_MODEL
from flows.workspace import git
from tasks.core import atomic

RECORD = "registry/versions.json"
LOCAL_TAGS = ("workspace",)            # where the recording workspace lay: not the clone's


def _known_commits(root: Path, shas: set[str]) -> set[str]:
    """The commits among `shas` that this repository holds."""
    import subprocess
    if not shas:
        return set()
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=root, capture_output=True,
                         text=True, input="".join(f"{s}\n" for s in sorted(shas))).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()[1:2] == ["commit"]}


def snapshot(client: MlflowClient, root: Path | None = None) -> dict[str, Any]:
    """The store's versions of alignloop's models, as the record holds them (sorted, no
    absolute paths). With `root`, only the versions this workspace registered (their
    `git_commit` is in its history): a team's server holds other workspaces' too."""
    models: dict[str, Any] = {}
    for name in (REWARD_MODEL, POLICY_MODEL):
        versions = []
        found = client.search_model_versions(f"name = '{name}'")
        if root is not None:
            ours = _known_commits(root, {mv.tags.get("git_commit", "") for mv in found} - {""})
            found = [mv for mv in found if mv.tags.get("git_commit") in ours]
        # search_model_versions leaves `aliases` empty: the registered model holds them
        aliases = client.get_registered_model(name).aliases if found else {}
        for mv in found:
            tags = {k: v for k, v in sorted(mv.tags.items()) if k not in LOCAL_TAGS}
            versions.append({"version": str(mv.version), "run_id": mv.run_id,
                             "model_path": tags.get("model_path", ""),
                             "aliases": sorted(a for a, v in aliases.items()
                                               if str(v) == str(mv.version)),
                             "tags": tags})
        if versions:
            models[name] = sorted(versions, key=lambda v: int(v["version"]))
    return {"models": models}


def write(root: Path, client: MlflowClient | None = None) -> bool:
    """Rewrite the record from the store; True if its bytes changed."""
    text = json.dumps(snapshot(client or MlflowClient(), root), indent=1, sort_keys=True) + "\n"
    path = root / RECORD
    if path.is_file() and path.read_text() == text:
        return False
    atomic.write_text(path, text)
    return True


def commit(root: Path, message: str, also: tuple[str, ...] = ()) -> bool:
    """Commit the record (and `also`) when they differ from HEAD's; nothing else staged goes
    with them. True if it committed."""
    paths = [p for p in (RECORD, *also) if (root / p).exists()]
    if not paths or not git(root, "status", "--porcelain", "--", *paths):
        return False
    git(root, "add", *paths)
    git(root, "commit", "-q", "-m", message, "--", *paths)
    return True


def sync(root: Path, message: str) -> bool:
    """The record rewritten from the store and committed if it changed."""
    write(root)
    return commit(root, message)


class Record:
    """The registry calls lineage makes, answered from the record at the workspace's HEAD."""

    def __init__(self, root: Path) -> None:
        path = root / RECORD
        self.where = f"{RECORD} at commit {git(root, 'rev-parse', '--short', 'HEAD')}"
        self.models: dict[str, list[dict[str, Any]]] = json.loads(path.read_text())["models"]

    @staticmethod
    def available(root: Path) -> bool:
        return (root / RECORD).is_file()

    def _version(self, name: str, v: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(name=name, version=v["version"], tags=v["tags"],
                               aliases=v["aliases"], run_id=v["run_id"],
                               source=v["model_path"])

    def search_registered_models(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name=n) for n in self.models]

    def get_registered_model(self, name: str) -> SimpleNamespace:
        aliases = {a: v["version"] for v in self._versions(name) for a in v["aliases"]}
        return SimpleNamespace(name=name, aliases=aliases)

    def search_model_versions(self, filter_string: str) -> list[SimpleNamespace]:
        name = filter_string.split("'")[1]
        return [self._version(name, v) for v in self.models.get(name, [])]

    def get_model_version(self, name: str, version: str) -> SimpleNamespace:
        for v in self._versions(name):
            if v["version"] == str(version):
                return self._version(name, v)
        raise MlflowException(f"{name} version {version} is not in {self.where}")

    def get_model_version_by_alias(self, name: str, alias: str) -> SimpleNamespace:
        for v in self._versions(name):
            if alias in v["aliases"]:
                return self._version(name, v)
        raise MlflowException(f"{name} has no alias {alias} in {self.where}")

    def _versions(self, name: str) -> list[dict[str, Any]]:
        if name not in self.models:
            raise MlflowException(f"no registered model {name} in {self.where}")
        return self.models[name]
