"""What `alignloop gc` archived: its ledger, and how the rest of alignloop reads it.

`registry/archived.jsonl` (git-tracked, append-only) holds one line per model directory whose
weights gc removed: when, by whom, the iteration, the path and md5 `dvc.lock` still records,
the registry versions it was, and the bytes that went from the workspace, the DVC cache and the
remote. `dvc.lock` keeps every md5, so lineage still names them; DVC then sees those stage
instances' outputs (and the inputs of the stages that read them) as missing. The flow skips a
stage instance whose only change is archived data (`skip`, DVC's own `allow_missing` reading of
a stage), reruns it as usual when anything else changed, and refuses one that must rerun but
reads archived weights, naming the stage that recomputes them.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from tasks.core.errors import InputError

LEDGER = "registry/archived.jsonl"
TAG = "archived"                       # the model version tag gc sets
MISSING = ("deleted", "not in cache")  # DVC's words for data that is not there
PUSH_LOGGERS = ("dvc_data.index.fetch", "dvc.data_cloud")   # where `dvc push` warns of them


def read_ledger(root: Path) -> list[dict[str, Any]]:
    path = root / LEDGER
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def archived(root: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(path, md5) -> the ledger line that archived it (the latest, when gc ran twice)."""
    return {(e["path"], e["md5"]): e for e in read_ledger(root)}


def _locked_paths(entry: dict[str, Any], kind: str) -> dict[str, str]:
    return {str(x["path"]): str(x.get("md5", "")) for x in entry.get(kind, [])}


def _changes(status: list[Any]) -> list[tuple[str, str, str]]:
    """A stage's DVC status as (kind, path, how); a change that names no path is ("", "", how)."""
    out = []
    for change in status:
        if isinstance(change, str):
            out.append(("", "", change))
            continue
        for kind, items in change.items():
            if not isinstance(items, dict):
                out.append((kind, "", str(items)))
                continue
            for path, how in items.items():
                out.append((kind, str(path), how if isinstance(how, str) else "modified"))
    return out


def skip(root: Path, name: str) -> bool:
    """True when DVC finds stage instance `name` changed only because data gc archived is gone
    (its outputs, or inputs another archived stage produced): nothing to run, the flow passes it.
    False when it touches no archived data, or changed otherwise and can rerun (its archived
    outputs are then recomputed). An InputError when it must rerun but reads archived weights."""
    gone = archived(root)
    if not gone:
        return False
    from flows.dag import read_lock
    entry = read_lock(root).get(name)
    if entry is None:
        return False
    deps, outs = _locked_paths(entry, "deps"), _locked_paths(entry, "outs")
    mine = {p for p, m in {**deps, **outs}.items() if (p, m) in gone}
    if not mine:
        return False
    import contextlib

    from dvc.repo import Repo
    with contextlib.chdir(root), Repo(str(root)) as repo, repo.lock:
        stage = next((s for s in repo.index.stages if s.addressing == name), None)
        status = stage.status().get(name, []) if stage is not None else ["not declared"]
    changes = _changes(status)
    missing = {(p, how) for kind, p, how in changes if p in mine and how in MISSING}
    real = [(kind, p, how) for kind, p, how in changes if (p, how) not in missing]
    if not real:
        return True
    needed = sorted(p for p, _ in missing if p in deps)
    if needed:
        what = "; ".join(f"{k.replace('changed ', '')} {p}: {h}".strip() for k, p, h in real)
        raise InputError(f"{name} must rerun ({what}) but reads {', '.join(needed)}, whose "
                         f"weights `alignloop gc` archived ({LEDGER}): `alignloop rerun "
                         f"STAGE@K` of the stage that wrote them recomputes them first")
    return False


def archived_reasons(reasons: list[str], gone: dict[tuple[str, str], Any]) -> bool:
    """Whether every reason `alignloop status` gives for a stage is archived data missing."""
    paths = {p for p, _ in gone}
    pattern = re.compile(r"^(deps|outs) (\S+): (deleted|not in cache)$")
    return bool(reasons) and all((m := pattern.match(r)) is not None and m.group(2) in paths
                                 for r in reasons)


class ArchivedPushWarning(logging.Filter):
    """`dvc push` warns of cache files that exist nowhere: after gc, the archived weights
    dvc.lock still names. Dropped when every md5 it lists is archived; others still show."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "do not exist neither locally nor on remote" not in message:
            return True
        listed = set(re.findall(r"md5: ([0-9a-f]{32}(?:\.dir)?)", message))
        return not listed or not listed <= {md5 for _, md5 in archived(self.root)}
