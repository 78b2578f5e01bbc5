"""`alignloop gc`: old iterations' weights leave the workspace, the DVC cache and the remote;
data, the initial model, aliased versions and what kept stages read stay; lineage says
archived; the next run passes the archived stages and a tick builds on. Driven through the CLI
on copies of the shared tiny run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import copy_workspace, ran_stages, run_cli, snapshot

CACHE = Path(".dvc/cache/files/md5")
REMOTE = Path(".alignloop/dvc-remote/files/md5")


def _out_md5(ws: Path, path: str) -> str:
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    return next(o["md5"] for e in lock.values() for o in e.get("outs", []) if o["path"] == path)


def _objects(ws: Path, store: Path, md5: str) -> set[str]:
    manifest = ws / store / md5[:2] / md5[2:]
    return {md5} | {e["md5"] for e in json.loads(manifest.read_text())}


def _present(ws: Path, store: Path, oids: set[str]) -> set[str]:
    return {o for o in oids if (ws / store / o[:2] / o[2:]).is_file()}


def _tree(ws: Path, top: str) -> dict[str, str]:
    return {k: v for k, v in snapshot(ws, cache=False).items() if k.startswith(top)}


@pytest.fixture
def ws(tiny_run, tmp_path) -> Path:
    return copy_workspace(tiny_run["ws"], tmp_path / "ws")


def test_dry_run_names_what_would_go_and_removes_nothing(ws):
    before, remote = snapshot(ws), sorted(p.name for p in (ws / REMOTE).rglob("*"))
    out = run_cli("gc", "--keep-last", "1", "--dry-run", "--workspace", str(ws)).stdout
    assert "archive models/iter_1/rm" in out                      # iteration 1's reward model
    assert "keep    models/iter_1/policy: read by rollout@2" in out   # iteration 2 started there
    assert "would free (dry run: nothing removed)" in out
    assert "archive models/iter_2" not in out and "archive models/iter_0" not in out
    assert snapshot(ws) == before
    assert sorted(p.name for p in (ws / REMOTE).rglob("*")) == remote


def test_gc_frees_the_bytes_keeps_the_record_and_the_next_run_reruns_nothing(ws):
    policy1, rm1 = _out_md5(ws, "models/iter_1/policy"), _out_md5(ws, "models/iter_1/rm")
    gone = _objects(ws, CACHE, policy1) | _objects(ws, CACHE, rm1)
    shared = _objects(ws, CACHE, _out_md5(ws, "models/iter_2/policy")) | \
        _objects(ws, CACHE, _out_md5(ws, "models/iter_0/policy"))
    data, lock = _tree(ws, "data/"), (ws / "dvc.lock").read_bytes()
    out = run_cli("gc", "--keep-last", "0", "--workspace", str(ws)).stdout
    # the champion's policy stays (an alias points to it), and so does the initial model
    assert "keep    models/iter_2/policy: alias champion -> alignloop-policy v2" in out
    for path in ("models/iter_1/policy", "models/iter_1/rm", "models/iter_2/rm"):
        assert not (ws / path).exists(), path
    assert (ws / "models/iter_2/policy/model.safetensors").is_file()
    assert (ws / "models/iter_0/policy/model.safetensors").is_file()
    for store in (CACHE, REMOTE):                 # exactly their objects, less the shared ones
        assert _present(ws, store, gone - shared) == set(), store
        assert _present(ws, store, shared) == shared, store
    assert _tree(ws, "data/") == data and (ws / "dvc.lock").read_bytes() == lock
    ledger = [json.loads(x) for x in (ws / "registry/archived.jsonl").read_text().splitlines()]
    assert {(e["path"], tuple(e["versions"])) for e in ledger} == {
        ("models/iter_1/policy", ("alignloop-policy v1",)),
        ("models/iter_1/rm", ("alignloop-reward-model v1",)),
        ("models/iter_2/rm", ("alignloop-reward-model v2",))}
    assert all(e["bytes"]["cache"] > 0 and e["bytes"]["remote 'local'"] > 0 for e in ledger)
    # lineage: archived, not corrupt
    lin = run_cli("lineage", "models:/alignloop-policy/1", "--verify", "--workspace", str(ws))
    assert "weights archived (" in lin.stdout and "alignloop gc --keep-last 0" in lin.stdout
    assert "verify: ok:" in lin.stdout and "1 archived by `alignloop gc`" in lin.stdout
    status = run_cli("status", "--workspace", str(ws))          # exit 0: nothing to do
    assert "archived    update@1" in status.stdout
    # gc again: nothing left to archive; a run passes every archived stage
    assert "gc: nothing to archive" in run_cli("gc", "--keep-last", "0", "--workspace",
                                               str(ws)).stdout
    run = run_cli("run", "--workspace", str(ws))
    assert ran_stages(run.stdout) == [], run.stdout
    assert not (ws / "models/iter_1/policy").exists()


def test_bad_input_is_one_line_and_changes_nothing(ws, tmp_path):
    before = snapshot(ws)
    proc = run_cli("gc", "--keep-last", "-1", "--workspace", str(ws), check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "error: --keep-last: expected 0 or more, got -1"
    proc = run_cli("gc", "--keep-last", "1", "--workspace", str(tmp_path / "none"), check=False)
    assert proc.returncode == 2 and "not an alignloop workspace" in proc.stderr
    assert "Traceback" not in proc.stderr and snapshot(ws) == before


def test_a_gc_killed_before_its_record_is_put_back_and_one_killed_after_is_finished(ws):
    before, head = snapshot(ws), (ws / ".git/HEAD").read_text()
    proc = run_cli("gc", "--keep-last", "0", "--workspace", str(ws), check=False,
                   env={"ALIGNLOOP_CRASH_AT": "gc_aside@0"})
    assert proc.returncode == -9
    assert not (ws / "models/iter_1/policy").exists()            # moved aside when killed
    out = run_cli("gc", "--keep-last", "0", "--dry-run", "--workspace", str(ws)).stdout
    assert "interrupted before its record; put back" in out
    assert snapshot(ws) == before and (ws / ".git/HEAD").read_text() == head
    proc = run_cli("gc", "--keep-last", "0", "--workspace", str(ws), check=False,
                   env={"ALIGNLOOP_CRASH_AT": "gc_record@0"})
    assert proc.returncode == -9 and (ws / "registry/archived.jsonl").is_file()
    rm1 = _out_md5(ws, "models/iter_1/rm")
    assert (ws / REMOTE / rm1[:2] / rm1[2:]).is_file()          # not yet deleted there
    out = run_cli("gc", "--keep-last", "0", "--workspace", str(ws)).stdout
    assert ": finished" in out and not (ws / REMOTE / rm1[:2] / rm1[2:]).exists()
    assert not (ws / ".alignloop/gc-trash").exists()


@pytest.mark.slow
def test_a_tick_after_gc_runs_the_next_iteration_only(ws):
    run_cli("gc", "--keep-last", "0", "--workspace", str(ws))
    tick = run_cli("tick", "--workspace", str(ws))
    ran = ran_stages(tick.stdout)
    assert ran and all(s.endswith("@3") or s == "report" for s in ran), ran
    assert (ws / "models/iter_3/policy/model.safetensors").is_file()
    assert not (ws / "models/iter_1/policy").exists()
    assert "Some of the cache files" not in tick.stdout + tick.stderr   # dvc push's warning
