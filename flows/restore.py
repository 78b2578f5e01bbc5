"""A registered model's exact bytes, from the DVC stores that keep them.

A version names its bytes by the md5 DVC gave the model directory (`model_md5`). Serving
assembles that directory from the cache (or, when the cache lacks an object, the default remote
when it is a local directory): hard links to the stored (read-only) objects under
`.alignloop/serve/<md5>/`, copies only across file systems, so the workspace's checked-out models
are never written to and what is served is what was registered, whatever the workspace has
checked out or the version's `source` says. Not symbolic links: MLflow refuses to load a file
whose resolved path leaves the model directory.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from flows.verify import stored, stores


class NotRestorable(Exception):
    """The bytes are in no store this workspace can read."""


def materialise(root: Path, state: Path, model_path: str, model_md5: str) -> Path:
    """The directory holding model_md5's files (built once, atomically); NotRestorable names
    the first missing object."""
    if not model_md5.endswith(".dir"):
        raise NotRestorable(f"{model_path}: md5 {model_md5} is not a directory")
    dest = state / "serve" / model_md5.removesuffix(".dir")
    if dest.is_dir():
        return dest
    bases = [s.base for s in stores(root) if s.base is not None]
    manifest = stored(bases, model_md5)
    if manifest is None:
        raise NotRestorable(f"{model_path} ({model_md5}) is in no store here (the DVC cache or "
                            "a local default remote): `dvc pull` it at the version's commit")
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for entry in json.loads(manifest.read_text()):
            obj = stored(bases, entry["md5"])
            if obj is None:
                raise NotRestorable(f"{model_path}/{entry['relpath']} ({entry['md5']}) is in no "
                                    "store here: `dvc pull` it at the version's commit")
            link = tmp / entry["relpath"]
            link.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(obj, link)
            except OSError:                         # another file system: a copy
                shutil.copy2(obj, link)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not dest.is_dir():
            raise
    return dest
