"""Model aliases: `champion` (set by the promotion gate) and `production` (deploy / rollback).

Every move is appended to the workspace's ledger `registry/aliases.jsonl` (who, when, why,
from, to), committed to git, and stamped on the model version as tags, so it is visible in
lineage and in the MLflow UI.
"""
from __future__ import annotations

import getpass
import json
import time
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from flows.registry import POLICY_MODEL
from flows.workspace import git
from tasks import atomic

LEDGER = "registry/aliases.jsonl"


class AliasError(RuntimeError):
    """A deploy or rollback that cannot be done (no champion, nothing to roll back to)."""


def current(client: MlflowClient, alias: str, model: str = POLICY_MODEL) -> str | None:
    try:
        return str(client.get_model_version_by_alias(model, alias).version)
    except MlflowException:
        return None


def read_ledger(root: Path) -> list[dict[str, Any]]:
    path = root / LEDGER
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def move(root: Path, alias: str, version: str, why: str, action: str,
         model: str = POLICY_MODEL, commit: bool = True) -> dict[str, Any]:
    """Point `alias` at `version`, record the move, and commit the ledger."""
    client = MlflowClient()
    client.get_model_version(model, version)            # fails clearly on a bad version
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "who": _who(root),
             "model": model, "alias": alias, "from": current(client, alias, model),
             "to": str(version), "action": action, "why": why}
    client.set_registered_model_alias(model, alias, str(version))
    client.set_model_version_tag(model, str(version), f"alias.{alias}.last_set",
                                 f"{entry['time']} by {entry['who']}: {why}")
    lines = read_ledger(root) + [entry]
    atomic.write_text(root / LEDGER, "".join(json.dumps(x, sort_keys=True) + "\n" for x in lines))
    if commit:
        git(root, "add", LEDGER)
        git(root, "commit", "-q", "-m", f"alignloop: {alias} -> v{version} ({action}: {why})")
    return entry


def _who(root: Path) -> str:
    name = git(root, "config", "user.name", check=False)
    try:
        user = getpass.getuser()
    except Exception:   # no passwd entry in some containers
        user = "unknown"
    return f"{user} ({name})" if name else user


def production_stack(root: Path) -> list[str]:
    """Versions production has stood on, replaying deploys (push) and rollbacks (pop)."""
    stack: list[str] = []
    for e in read_ledger(root):
        if e["alias"] != "production":
            continue
        if e["action"] == "rollback":
            stack = stack[:-1]
        else:
            stack.append(e["to"])
    return stack


def deploy(root: Path, version: str | None, why: str) -> dict[str, Any]:
    """Move `production` to `version` (default: the current champion)."""
    if version is None:
        version = current(MlflowClient(), "champion")
        if version is None:
            raise AliasError("no champion to deploy: no iteration has passed the promotion gate")
    return move(root, "production", version, why, "deploy")


def rollback(root: Path, why: str) -> dict[str, Any]:
    """Move `production` back to the version it had before the current one."""
    stack = production_stack(root)
    if len(stack) < 2:
        raise AliasError("nothing to roll back to: production has had "
                         f"{len(stack)} version(s)")
    return move(root, "production", stack[-2], why, "rollback")
