"""flows/dag.py on a minimal git + DVC repo: a stage that fails leaves no output behind that its
lock does not vouch for (the partial products of a failed run would otherwise be picked up by
the iteration commit's `git add -A`), keeps its locked outputs, and a later run succeeds."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows import dag


def _sh(root: Path, *args: str) -> str:
    return subprocess.run(args, cwd=root, check=True, capture_output=True, text=True).stdout


def _declare(root: Path, fail: bool, after_command: bool = False) -> None:
    """A stage writing out/model.bin (a directory output, like a model). fail: its command
    exits 1; after_command: the command succeeds but DVC fails afterwards, while saving the
    outputs (a declared output is missing; a full disk fails there too), so `out` is written."""
    script = ("import os, sys; os.makedirs('out', exist_ok=True); "
              "open('out/model.bin', 'w').write(open('src.txt').read()); "
              f"sys.exit({1 if fail and not after_command else 0})")
    outs = ["out", "also.txt"] if fail and after_command else ["out"]
    stage = {"cmd": f'{sys.executable} -c "{script}"', "deps": ["src.txt"], "outs": outs}
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"make": stage}}))


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    _sh(root, "git", "init", "-q")
    _sh(root, sys.executable, "-m", "dvc", "init", "-q")
    _sh(root, sys.executable, "-m", "dvc", "config", "core.analytics", "false")
    (root / "src.txt").write_text("v1")
    return root


@pytest.mark.parametrize("after_command", [False, True])
@pytest.mark.parametrize("checkout_fails", [False, True])
def test_failed_first_run_leaves_no_unlocked_output(repo: Path, after_command: bool,
                                                   checkout_fails: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if checkout_fails:      # as on a full disk, where the restoring checkout fails as well
        def no_space(*args: object, **kwargs: object) -> None:
            raise OSError(28, "No space left on device")
        monkeypatch.setattr("dvc.repo.Repo.checkout", no_space)
    _declare(repo, fail=True, after_command=after_command)
    with pytest.raises(dag.StageFailed, match="stage make failed"):
        dag.reproduce(repo, "make")
    assert not (repo / "out").exists()                   # the partial product is gone
    _sh(repo, "git", "add", "-A")                        # what commit_iteration does
    assert "out/" not in _sh(repo, "git", "diff", "--cached", "--name-only")
    monkeypatch.undo()
    _declare(repo, fail=False)
    assert dag.reproduce(repo, "make").outcome == "ran"
    assert (repo / "out" / "model.bin").read_text() == "v1"
    assert "out" in dag.read_lock(repo)["make"]["outs"][0]["path"]


def test_failed_rerun_keeps_the_locked_output(repo: Path) -> None:
    _declare(repo, fail=False)
    dag.reproduce(repo, "make")
    (repo / "src.txt").write_text("v2")
    _declare(repo, fail=True)
    with pytest.raises(dag.StageFailed):
        dag.reproduce(repo, "make")
    assert (repo / "out" / "model.bin").read_text() == "v1"   # the last good one, back


def test_read_lock_follows_the_file_and_hands_out_copies(repo: Path) -> None:
    """The parsed lock is kept per text (a run reads it a dozen times between writes): a
    rewritten dvc.lock is read anew, and a caller editing its answer changes no later one."""
    _declare(repo, fail=False)
    dag.reproduce(repo, "make")
    first = dag.read_lock(repo)
    md5 = first["make"]["outs"][0]["md5"]
    first["make"]["outs"][0]["md5"] = "edited by a caller"
    assert dag.read_lock(repo)["make"]["outs"][0]["md5"] == md5
    (repo / "src.txt").write_text("v2")
    dag.reproduce(repo, "make")
    assert dag.read_lock(repo)["make"]["outs"][0]["md5"] != md5


def test_remove_unlocked_outputs_only_touches_unlocked_paths(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("1")
    (tmp_path / "b.txt").write_text("2")
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(
        {"schema": "2.0", "stages": {"s": {"outs": [{"path": "b.txt", "md5": "0"}]}}}))
    removed = dag.remove_unlocked_outputs(tmp_path, "s", ["a", "b.txt", "missing"])
    assert removed == ["a"]
    assert not (tmp_path / "a").exists() and (tmp_path / "b.txt").exists()


def test_stage_order_is_parsed_again_once_the_declaration_changes(
        repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _declare(repo, fail=False)
    assert [s.name for s in dag.ordered_stages(repo)] == ["make"]
    with monkeypatch.context() as m:                 # kept: nothing changed, no repo opened
        m.setattr(dag, "Repo", lambda *a, **k: pytest.fail("parsed again"))
        assert [s.name for s in dag.ordered_stages(repo)] == ["make"]
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())
    stages["stages"]["after"] = {"cmd": "cp out/model.bin copy.bin", "deps": ["out"],
                                 "outs": ["copy.bin"]}
    (repo / "dvc.yaml").write_text(yaml.safe_dump(stages))
    assert [s.name for s in dag.ordered_stages(repo)] == ["make", "after"]


def test_a_session_runs_what_changed_and_skips_what_did_not(repo: Path) -> None:
    _declare(repo, fail=False)
    session = dag.DvcSession(repo)
    try:
        assert dag.reproduce(repo, "make", session=session).outcome == "ran"
        assert dag.reproduce(repo, "make", session=session).outcome == "cached"
        (repo / "src.txt").write_text("v2")
        assert dag.reproduce(repo, "make", session=session).outcome == "ran"
        assert (repo / "out" / "model.bin").read_text() == "v2"
    finally:
        session.close()


@pytest.mark.parametrize("users", [None, ""])
def test_a_stage_process_starts_with_the_heap_settings(
        repo: Path, users: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage's command, run by DVC through dag.reproduce, sees tasks/core/heap.py's
    GLIBC_TUNABLES (glibc reads them when the process starts), unless the user set their own
    (even empty); this process's environment is as before afterwards."""
    from tasks.core import heap
    if users is None:
        monkeypatch.delenv(heap.ENV, raising=False)
    else:
        monkeypatch.setenv(heap.ENV, users)
    script = "import os; open('seen.txt', 'w').write(os.environ.get('GLIBC_TUNABLES', '-'))"
    stage = {"cmd": f'{sys.executable} -c "{script}"', "deps": ["src.txt"], "outs": ["seen.txt"]}
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"probe": stage}}))
    assert dag.reproduce(repo, "probe").outcome == "ran"
    seen = (repo / "seen.txt").read_text()
    if users is None:
        assert seen == (heap.TUNABLES if heap.is_glibc() else "-")
        assert heap.ENV not in os.environ
    else:
        assert seen == users and os.environ[heap.ENV] == users
