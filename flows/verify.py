"""Proof of recoverability: every artifact of a lineage tree is re-hashed from every copy kept.

A copy is the DVC cache object, the DVC remote object, or (for git-tracked metrics) the blob
at the recorded commit. Directories are checked file by file against their DVC manifest, and
model weights are also opened and read tensor by tensor. Any missing or altered byte is a
problem that names the artifact and the copy.
"""
from __future__ import annotations

import hashlib
import json
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


def _stores(root: Path) -> dict[str, Path]:
    stores = {"cache": root / CACHE}
    with Repo(str(root)) as repo:
        conf = repo.config
        name = conf["core"].get("remote")
        url = conf["remote"].get(name, {}).get("url") if name else None
    if url and "://" not in url:
        remote = Path(url) if Path(url).is_absolute() else (root / ".dvc" / url).resolve()
        stores["remote"] = remote / "files" / "md5"
    return stores


def _load_weights(path: Path) -> str | None:
    """Open a safetensors file and read every tensor; returns an error or None."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)
    except Exception as e:   # any failure to load is the finding
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


def verify(root: Path, artifacts: list[dict[str, Any]], commit: str) -> list[str]:
    """Problems found ("" list = every artifact recoverable and intact)."""
    from flows.workspace import git_bytes
    stores, problems = _stores(root), []
    for a in artifacts:
        copies = {name: _check_copy(base, a) for name, base in stores.items()
                  if base.exists()}
        present = {n: p for n, p in copies.items() if p != ["missing"]}
        if not present:
            blob = git_bytes(root, "show", f"{commit}:{a['path']}")
            if blob is not None and hashlib.md5(blob).hexdigest() == a["md5"]:
                continue                     # git-tracked (metrics): intact at the commit
            problems.append(f"{a['path']} ({a['md5']}): not recoverable from "
                            f"{', '.join(stores)} or git")
            continue
        for name, found in present.items():
            problems.extend(f"{a['path']} ({a['md5']}) in {name}: {p}" for p in found)
    return problems
