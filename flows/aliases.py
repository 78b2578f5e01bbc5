"""Model aliases: `champion` (set by the promotion gate), `production` (deploy, promote,
rollback) and `canary` (deploy --canary; flows/release.py).

Every move is appended to the workspace's ledger `registry/aliases.jsonl` (who, when, why,
from, to, and for release moves the evidence they rested on), committed to git, and stamped
on the model version as tags, so it is visible in lineage and in the MLflow UI.
"""
from __future__ import annotations

import getpass
import json
import time
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from flows import crashpoints, registry_record
from flows.registry import POLICY_MODEL
from flows.workspace import git
from tasks.core import atomic
from tasks.core.errors import InputError

LEDGER = "registry/aliases.jsonl"


class AliasError(InputError):
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
         model: str = POLICY_MODEL, commit: bool = True, iteration: int = 0,
         evidence: dict[str, Any] | None = None) -> dict[str, Any]:
    """Point `alias` at `version`, record the move (with the `evidence` it rests on, when
    given), and commit the ledger.

    The ledger entry is written first, then the alias moves, then the ledger is committed: a
    move killed half-way is finished by `ensure`, never recorded twice."""
    client = MlflowClient()
    client.get_model_version(model, version)            # fails clearly on a bad version
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "who": who(root),
             "model": model, "alias": alias, "from": current(client, alias, model),
             "to": str(version), "action": action, "why": why}
    if evidence is not None:
        entry["evidence"] = evidence
    lines = read_ledger(root)
    last = _last_move(lines, alias, model)
    if last is None or (last["to"], last["from"]) != (entry["to"], entry["from"]):
        lines.append(entry)
        atomic.write_text(root / LEDGER,
                          "".join(json.dumps(x, sort_keys=True) + "\n" for x in lines))
    else:
        entry = last                                     # redoing a killed move
    crashpoints.reach("alias_ledger", iteration)
    client.set_registered_model_alias(model, alias, str(version))
    client.set_model_version_tag(model, str(version), f"alias.{alias}.last_set",
                                 f"{entry['time']} by {entry['who']}: {why}")
    crashpoints.reach("alias", iteration)
    if commit:
        _commit_ledger(root, f"alignloop: {alias} -> v{version} ({action}: {why})")
    return entry


def ensure(root: Path, alias: str, version: str, why: str, action: str,
           iteration: int = 0, model: str = POLICY_MODEL) -> bool:
    """`alias` on `version` with its move in the committed ledger; True if it moved now. A move
    a killed run left half-done (ledger written, alias moved, ledger not committed) is
    completed here, not repeated."""
    client = MlflowClient()
    if current(client, alias, model) != version:
        move(root, alias, version, why, action, model, iteration=iteration)
        return True
    last = _last_move(read_ledger(root), alias, model)
    if last is not None and last["to"] == version:     # a killed move's ledger, uncommitted
        _commit_ledger(root, f"alignloop: {alias} -> v{version} ({last['action']}: "
                             f"{last['why']})")
    return False


def _last_move(lines: list[dict[str, Any]], alias: str, model: str) -> dict[str, Any] | None:
    return next((e for e in reversed(lines) if e["alias"] == alias
                 and e.get("model", POLICY_MODEL) == model), None)


def _commit_ledger(root: Path, message: str) -> None:
    """Commit the ledger, with the registry's record in git rewritten (it holds the aliases),
    if they differ from HEAD's (nothing else that is staged goes with them)."""
    registry_record.write(root)
    registry_record.commit(root, message, also=(LEDGER,))


def who(root: Path) -> str:
    """The user (and git's user.name) a ledger line names."""
    name = git(root, "config", "user.name", check=False)
    try:
        user = getpass.getuser()
    except Exception:   # noqa: BLE001 (no passwd entry in some containers)
        user = "unknown"
    return f"{user} ({name})" if name else user


def production_stack(root: Path) -> list[str]:
    """Versions production has stood on, replaying deploys and promotions (push) and
    rollbacks (pop)."""
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
