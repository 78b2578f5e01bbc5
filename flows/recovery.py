"""A run that fails leaves the workspace as it found it, and the next run finds no debris.

`take` notes, under the workspace lock and before anything is synced, what a run may change:
the commit, the tracked files that differ from it (a params edit the user has not run yet),
the untracked files. `restore` puts all of it back after a failure: tracked files as they
were, files the run created removed, every DVC output back to what dvc.lock vouches for (a
stage's outputs are checked out from the cache, outputs of stages no lock entry vouches for
removed), the artifacts of iterations that are no longer declared removed, and temporary
files of interrupted atomic writes swept. Iterations the run recorded before it failed are
commits, registered and pushed: they are kept, and the workspace is restored to the last one.
What lives in `.alignloop/` (logs, stores) is not restored; the DVC cache only gains objects.
"""
from __future__ import annotations

import contextlib
import io
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from flows.dvc_quiet import quiet_dvc
from flows.workspace import STATE_DIR, git

ARTIFACT_ROOTS = ("data", "models", "metrics", "audit", "registry")
_TEMP = re.compile(r"^\..+\.(tmp|old-\d+)$")         # tasks/core/atomic.py's temporary names
_ITER_DIR = re.compile(r"^iter_(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    head: str | None                        # None: a workspace with no commit yet
    changed: dict[str, bytes | None]        # tracked files differing from HEAD (None: deleted)
    untracked: frozenset[str]


def _head(root: Path) -> str | None:
    return git(root, "rev-parse", "--verify", "-q", "HEAD", check=False) or None


def _untracked(root: Path) -> set[str]:
    out = git(root, "ls-files", "-z", "--others", "--exclude-standard", check=False)
    return {p for p in out.split("\0") if p}


def take(root: Path) -> Checkpoint:
    """What the workspace holds now (call under the lock, before the run touches anything)."""
    if not (root / ".git").exists():
        return Checkpoint(None, {}, frozenset())
    head = _head(root)
    changed: dict[str, bytes | None] = {}
    if head is not None:
        diff = git(root, "diff", "-z", "--name-only", "HEAD", check=False)
        for rel in filter(None, diff.split("\0")):
            path = root / rel
            changed[rel] = path.read_bytes() if path.is_file() else None
    return Checkpoint(head, changed, frozenset(_untracked(root)))


def restore(root: Path, cp: Checkpoint) -> list[str]:
    """Put the workspace back as `cp` found it (see the module docstring); returns what was
    wrong and put right, for the log."""
    if not (root / ".git").exists():
        return []
    fixed: list[str] = []
    head = _head(root)
    if head is not None:
        if git(root, "status", "--porcelain", "--untracked-files=no", check=False):
            fixed.append("tracked files reset to HEAD")
        git(root, "reset", "-q", "--hard", head)
    if head == cp.head:                     # nothing recorded since: the user's edits return
        for rel, data in cp.changed.items():
            path = root / rel
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
    for rel in sorted(_untracked(root) - cp.untracked):
        _remove(root / rel)
        fixed.append(f"{rel} (new, removed)")
    fixed += restore_outputs(root)
    fixed += sweep(root)
    return fixed


def clear_killed_outputs(root: Path) -> list[str]:
    """What a run killed with -9 left of its stages' outputs: an output no dvc.lock entry
    vouches for (a stage that finished its write in the instant between the CLI's death and its
    own), which no .gitignore names yet, so the next record step's `git add -A` would stage it
    into git and DVC would then refuse the stage ("already tracked by SCM"). Such an output is
    an untracked, unignored file under data/, models/ or metrics/; only when one exists are the
    outputs put back as dvc.lock vouches for them (`restore_outputs`, which opens DVC, ~1 s).
    Files that are no stage's output (a person's own, under data/) are left alone."""
    out = git(root, "ls-files", "-z", "--others", "--exclude-standard", "--",
              "data", "models", "metrics", check=False)
    if not any(out.split("\0")):
        return []
    return restore_outputs(root)


def restore_outputs(root: Path) -> list[str]:
    """Every stage's outputs as dvc.lock records them; outputs no lock entry vouches for and
    directories of iterations that are not declared removed."""
    from dvc.repo import Repo

    from flows.dag import remove_unlocked_outputs
    fixed: list[str] = []
    if not (root / "dvc.yaml").is_file():
        return fixed
    declared: set[int] = set()
    with contextlib.chdir(root), Repo(str(root)) as repo, \
            contextlib.redirect_stdout(io.StringIO()), quiet_dvc():
        for stage in repo.index.stages:
            declared.add(int(stage.addressing.partition("@")[2] or 0))
            outs = [str(o.def_path) for o in stage.outs]
            fixed += remove_unlocked_outputs(root, stage.addressing, outs)
        with contextlib.suppress(Exception):    # a missing cache object is left to `status`
            changes = repo.checkout(force=True)
            fixed += [f"{p} (restored from the DVC cache)"
                      for kind in ("added", "modified") for p in changes.get(kind, [])]
    for top in ("data", "models", "metrics"):
        for d in sorted((root / top).glob("iter_*")):
            m = _ITER_DIR.match(d.name)
            if m and int(m.group(1)) not in declared and \
                    not git(root, "ls-files", "--", str(d.relative_to(root)), check=False):
                shutil.rmtree(d, ignore_errors=True)
                fixed.append(f"{d.relative_to(root)} (undeclared iteration, removed)")
    return fixed


def sweep(root: Path) -> list[str]:
    """Remove what interrupted atomic writes left: `.NAME.*.tmp` and `.NAME.old-PID`."""
    removed = []
    for top in ARTIFACT_ROOTS:
        base = root / top
        if not base.is_dir():
            continue
        for path in sorted(base.rglob(".*")):
            if _TEMP.match(path.name) and (path.exists() or path.is_symlink()):
                _remove(path)
                removed.append(f"{path.relative_to(root)} (temporary, removed)")
    # and what a killed `alignloop gc` moved aside
    from flows.gc import finish_interrupted
    return removed + finish_interrupted(root, root / STATE_DIR)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
