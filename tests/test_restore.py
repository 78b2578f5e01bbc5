"""A registered version's exact bytes, assembled from the DVC stores (flows/restore.py): what
`alignloop serve` serves, whatever the workspace has checked out."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import copy_workspace, run_cli
from flows import restore
from flows.registry_record import Record
from flows.verify import CACHE, object_path


def _champion(ws: Path) -> tuple[str, str]:
    mv = Record(ws).get_model_version_by_alias("alignloop-policy", "champion")
    return mv.tags["model_path"], mv.tags["model_md5"]


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_the_served_directory_is_the_registered_bytes_not_the_checkout(tiny_run, tmp_path):
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    path, md5 = _champion(ws)
    weights = next((ws / path).glob("*.safetensors"))
    weights.chmod(0o644)
    weights.write_bytes(b"not the registered weights")       # the checkout moved on
    served = restore.materialise(ws, ws / ".alignloop", path, md5)
    manifest = json.loads(object_path(ws / CACHE, md5).read_text())
    assert sorted(str(p.relative_to(served)) for p in served.rglob("*") if p.is_file()) == \
        sorted(e["relpath"] for e in manifest)
    for e in manifest:
        assert _md5(served / e["relpath"]) == e["md5"]
    assert weights.read_bytes() == b"not the registered weights"   # the workspace not written
    assert restore.materialise(ws, ws / ".alignloop", path, md5) == served    # built once


def test_bytes_in_no_store_are_one_line_naming_the_file(tiny_run, tmp_path):
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    path, md5 = _champion(ws)
    manifest = json.loads(object_path(ws / CACHE, md5).read_text())
    weights = next(e for e in manifest if e["relpath"].endswith(".safetensors"))
    for base in (ws / CACHE, ws / ".alignloop" / "dvc-remote" / "files" / "md5"):
        obj = object_path(base, weights["md5"])
        if obj.exists():
            obj.chmod(0o644)
            obj.unlink()
    with pytest.raises(restore.NotRestorable, match=f"{path}/{weights['relpath']}"):
        restore.materialise(ws, ws / ".alignloop", path, md5)
    assert not (ws / ".alignloop" / "serve").exists() or \
        not any((ws / ".alignloop" / "serve").iterdir())           # nothing half-built kept
    out = run_cli("serve", "--workspace", str(ws), check=False)
    assert out.returncode == 2
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("error: models:/alignloop-policy@champion: alignloop-policy v")
    assert weights["relpath"] in line and "dvc pull" in line
