"""A workspace holds each artifact's bytes once: where the filesystem has hard links, DVC's
cache type is `hardlink` and its outputs are links to the cache's copy, read-only, and the
stages' atomic writes replace a linked output without touching the cache's copy. Where it has
none (a cache on another device), the workspace copies as DVC does by default: those tests
skip, saying so."""
from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from flows.workspace import STATE_DIR


def _tracked_files(ws: Path) -> list[Path]:
    """Every file of the DVC-cached outputs dvc.lock names (directories walked); the metrics
    files are outputs git keeps (`cache: false`), not the cache."""
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    in_git = set(subprocess.run(["git", "ls-files"], cwd=ws, capture_output=True, text=True,
                                check=True).stdout.split())
    out = []
    for entry in lock.values():
        for o in entry.get("outs", []):
            path = ws / o["path"]
            if path.is_dir():
                out += sorted(p for p in path.rglob("*") if p.is_file())
            elif path.is_file():
                out.append(path)
    return [p for p in out if str(p.relative_to(ws)) not in in_git]


def _cache_inodes(ws: Path) -> set[int]:
    return {p.stat().st_ino for p in (ws / ".dvc" / "cache").rglob("*") if p.is_file()}


def _disk_bytes(root: Path, skip: Path) -> int:
    """Bytes of the files under root (each inode once), `skip` left out."""
    seen, total = set(), 0
    for p in root.rglob("*"):
        if skip in p.parents or not p.is_file() or p.is_symlink():
            continue
        st = p.stat()
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    return total


def _links_here(where: Path) -> bool:
    """Hard links work in `where` (a fresh directory)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "a").write_bytes(b"")
    try:
        os.link(where / "a", where / "b")
    except OSError:
        return False
    return True


def _config_local(ws: Path) -> str:
    path = ws / ".dvc" / "config.local"
    return path.read_text() if path.is_file() else ""


def _linking(ws: Path) -> None:
    if "type = hardlink" not in _config_local(ws):
        pytest.skip("this filesystem has no hard links: the workspace copies")


def test_new_workspaces_link_the_cache(tiny_run, tmp_path) -> None:
    """Where the filesystem links (the test's tmp directory: the same filesystem as the
    workspace), the cache type is `hardlink`, in this machine's `.dvc/config.local`, and every
    output is a read-only cache inode."""
    ws: Path = tiny_run["ws"]
    assert ("type = hardlink" in _config_local(ws)) == _links_here(tmp_path / "probe")
    _linking(ws)
    files = _tracked_files(ws)
    assert files
    cache = _cache_inodes(ws)
    copies = [str(p.relative_to(ws)) for p in files if p.stat().st_ino not in cache]
    assert not copies, f"outputs held as a second copy: {copies[:5]}"
    writable = [str(p.relative_to(ws)) for p in files if p.stat().st_mode & stat.S_IWUSR]
    assert not writable, f"linked outputs left writable: {writable[:5]}"


def test_the_workspace_holds_its_artifacts_once(tiny_run) -> None:
    """Disk outside the DVC remote at most 1.15x the artifacts' own bytes (a copying cache:
    about 2x)."""
    ws: Path = tiny_run["ws"]
    _linking(ws)
    artifacts = sum(p.stat().st_size for p in _tracked_files(ws))
    disk = _disk_bytes(ws, ws / STATE_DIR / "dvc-remote")
    assert disk <= 1.15 * artifacts, (disk, artifacts, disk / artifacts)


def test_a_rerun_replaces_a_linked_output_and_the_cache_keeps_its_bytes(tiny_run, tmp_path):
    """cp -a keeps the links; the rerun's atomic write puts a new file where the linked one was
    (DVC unlinks it first) and never writes through the link into the cache."""
    ws = tmp_path / "ws"
    _linking(tiny_run["ws"])
    subprocess.run(["cp", "-a", str(tiny_run["ws"]), str(ws)], check=True)
    objects = {p: hashlib.md5(p.read_bytes()).hexdigest()
               for p in (ws / ".dvc" / "cache" / "files" / "md5").rglob("*")
               if p.is_file() and not p.name.endswith(".dir")}
    run_cli("rerun", "update@2", "--workspace", str(ws))
    changed = [str(p) for p, md5 in objects.items()
               if p.parent.name + p.name != md5]          # an object's name is its md5
    assert not changed, f"cache objects whose bytes no longer match their name: {changed[:3]}"
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "--quiet"], cwd=ws,
                            capture_output=True, text=True,
                            env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert status.returncode == 0, status.stdout + status.stderr


def test_a_clone_does_not_inherit_this_machines_link_type(tiny_run, tmp_path) -> None:
    """The link type is this machine's (.dvc/config.local, which git does not carry): a clone
    on a filesystem without hard links must not be told to link. The clone's own first run
    decides for its machine."""
    _linking(tiny_run["ws"])
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(tiny_run["ws"]), str(clone)], check=True)
    assert "hardlink" not in (clone / ".dvc" / "config").read_text()
    assert not (clone / ".dvc" / "config.local").exists()
