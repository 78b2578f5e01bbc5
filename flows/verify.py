"""Proof of recoverability: every artifact of a lineage tree is re-hashed from every copy kept.

A copy is the DVC cache object, the DVC remote object, or (for git-tracked metrics) the blob
at the recorded commit. Directories are checked file by file against their DVC manifest, and
model weights are also opened and read tensor by tensor. Any missing or altered byte is a
problem that names the artifact and the copy.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dvc.repo import Repo


def _md5_file(path: Path) -> str:
    h = hashlib.md5()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


CACHE = Path(".dvc") / "cache" / "files" / "md5"     # DVC 3's object store, also remotes'


def object_path(base: Path, md5: str) -> Path:
    """Where an object with this md5 lives in a DVC store rooted at `base`."""
    return base / md5[:2] / md5[2:]


@dataclass(frozen=True)
class Store:
    """A place that keeps copies: the DVC cache, or the default remote (by name)."""
    name: str                       # "cache" or "remote 'NAME'"
    where: str                      # its path or URL, as configured
    base: Path | None               # its object store on this machine; None: not re-hashable
    problem: str | None = None      # why it cannot be checked (unreachable, not local)


def stores(root: Path, skip_remote: bool = False) -> list[Store]:
    """The cache, and the default remote unless skipped: a local remote whose directory is
    missing is a store that cannot be checked (a problem, never a silent skip); a remote that is
    not a local directory cannot be re-hashed here and is a problem too, unless skipped."""
    out = [Store("cache", str(root / CACHE), root / CACHE)]
    with Repo(str(root)) as repo:
        conf = repo.config                  # .dvc/config with config.local over it, resolved
        name = conf["core"].get("remote")
        url = conf["remote"].get(name, {}).get("url") if name else None
    if skip_remote or not url:
        return out
    label = f"remote '{name}'"
    if "://" in url and not url.startswith("file://"):
        return out + [Store(label, url, None, "not a local directory: its objects cannot be "
                                              "re-hashed here (--skip-remote verifies without it)")]
    path = Path(url.removeprefix("file://"))
    path = path if path.is_absolute() else (root / ".dvc" / path).resolve()
    if not path.is_dir():
        return out + [Store(label, str(path), None, "unreachable (no such directory)")]
    return out + [Store(label, str(path), path / "files" / "md5")]


def _load_weights(path: Path) -> str | None:
    """Open a safetensors file and read every tensor; returns an error or None."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)
    except Exception as e:   # noqa: BLE001 (any failure to load is the finding)
        return f"weights do not load: {e}"
    return None


def _check_object(base: Path, md5: str, relname: str) -> str | None:
    obj = object_path(base, md5)
    if not obj.is_file():
        return "missing"
    if _md5_file(obj) != md5:
        return "altered (md5 mismatch)"
    if relname.endswith(".safetensors"):
        return _load_weights(obj)
    return None


def stored(bases: list[Path], md5: str) -> Path | None:
    """The first store's copy of an object (a directory: its manifest), or None."""
    return next((object_path(b, md5) for b in bases if object_path(b, md5).is_file()), None)


def present(bases: list[Path], md5: str) -> bool:
    """Whether any store holds the object (a directory: its manifest)."""
    return stored(bases, md5) is not None


def read_member(bases: list[Path], dir_md5: str, relpath: str) -> str | None:
    """The text of one file of a stored directory, or None (no such file, or not stored)."""
    manifest = stored(bases, dir_md5) if dir_md5.endswith(".dir") else None
    entry = next((e for e in json.loads(manifest.read_text()) if e["relpath"] == relpath),
                 None) if manifest else None
    obj = stored(bases, entry["md5"]) if entry else None
    return obj.read_text() if obj else None


def weights_md5(bases: list[Path], dir_md5: str) -> str | None:
    """tasks.models.lm.weights_md5 of a stored model directory, from its objects: md5 over its
    top-level *.safetensors in name order (and alignloop_base.json for an adapter). None when
    a file is in no store."""
    manifest = stored(bases, dir_md5)
    if manifest is None:
        return None
    top = {e["relpath"]: e["md5"] for e in json.loads(manifest.read_text())
           if "/" not in e["relpath"]}
    names = sorted(n for n in top if n.endswith(".safetensors"))
    names += ["alignloop_base.json"] if "alignloop_base.json" in top else []
    h = hashlib.md5()
    for name in names:
        obj = stored(bases, top[name])
        if obj is None:
            return None
        with obj.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def _check_copy(base: Path, artifact: dict[str, Any]) -> list[str]:
    md5, path = artifact["md5"], artifact["path"]
    if not md5.endswith(".dir"):
        why = _check_object(base, md5, path)
        return [why] if why else []
    manifest = object_path(base, md5)
    if not manifest.is_file():
        return ["missing"]
    if _md5_file(manifest) != md5.removesuffix(".dir"):
        return ["directory manifest altered"]
    problems = []
    for entry in json.loads(manifest.read_text()):
        why = _check_object(base, entry["md5"], entry["relpath"])
        if why:
            problems.append(f"{entry['relpath']}: {why}")
    return problems


def verify(root: Path, artifacts: list[tuple[dict[str, Any], str]],
           kept: list[Store]) -> list[str]:
    """Problems found ([] = every artifact recoverable and intact, and every store checked):
    a store that cannot be checked is one; an artifact (with the commit that recorded it) with
    no intact copy in any store, nor in git at its commit for git-tracked metrics, is one; a
    copy present but altered is one."""
    from flows.workspace import git_bytes
    problems = [f"{s.name} at {s.where}: {s.problem}" for s in kept if s.problem]
    readable = {s.name: s.base for s in kept if s.base is not None}
    for a, commit in artifacts:
        copies = {name: _check_copy(base, a) for name, base in readable.items()}
        present = {n: p for n, p in copies.items() if p != ["missing"]}
        if not present:
            blob = git_bytes(root, "show", f"{commit}:{a['path']}")
            if blob is not None and hashlib.md5(blob).hexdigest() == a["md5"]:
                continue                     # git-tracked (metrics): intact at the commit
            problems.append(f"{a['path']} ({a['md5']}): not recoverable from "
                            f"{', '.join(readable)} or git")
            continue
        for name, found in present.items():
            problems.extend(f"{a['path']} ({a['md5']}) in {name}: {p}" for p in found)
    return problems
