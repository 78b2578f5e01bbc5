"""Bad input through the CLI: a clear error naming file, line and field; nothing touched. A
killed run ends what it started."""
from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, TINY, run_cli, snapshot


def _bad_params(tmp_path: Path, old: str, new: str) -> Path:
    text = TINY.read_text()
    assert old in text
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace(old, new, 1))
    return path


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def test_unknown_params_key_fails_before_creating_the_workspace(tmp_path):
    bad = _bad_params(tmp_path, "  lr: 1.0e-3\n", "  lrr: 1.0e-3\n")
    ws = tmp_path / "ws"
    proc = run_cli("run", "--params", str(bad), "--workspace", str(ws), check=False)
    assert proc.returncode == 2
    assert f"{bad}:{_line_of(bad, 'lrr:')}: train_rm.lrr: unknown key" in proc.stderr
    assert not ws.exists()


def test_bad_params_leave_an_existing_workspace_untouched(tiny_run, tmp_path):
    ws = tiny_run["ws"]
    before = snapshot(ws)
    bad = _bad_params(tmp_path, "    beta: 0.1\n", "    beta: lots\n")
    proc = run_cli("run", "--params", str(bad), "--workspace", str(ws), check=False)
    assert proc.returncode == 2
    assert f"{bad}:{_line_of(bad, 'beta: lots')}: update.dpo.beta: expected a finite number" in proc.stderr
    assert snapshot(ws) == before


def test_missing_model_path_is_named(tmp_path):
    bad = _bad_params(tmp_path, "  source: tiny\n", "  source: hf_dir\n")
    bad.write_text(bad.read_text().replace('  path: ""', '  path: /no/such/model'))
    proc = run_cli("run", "--params", str(bad), "--workspace", str(tmp_path / "ws"), check=False)
    assert proc.returncode == 2
    assert "/no/such/model: model directory does not exist" in proc.stderr
    assert not (tmp_path / "ws").exists()


def test_malformed_import_row_fails_in_one_line_and_leaves_the_workspace_byte_identical(
        tiny_run, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(tiny_run["ws"], ws, symlinks=True)
    (ws / "data" / "import" / "pairs.jsonl").write_bytes(
        b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
        b'{"prompt": "a", "chosen": "", "rejected": "c"}\n')
    before = snapshot(ws, cache=False)
    params = _bad_params(tmp_path, "  source: cold_start\n", "  source: import\n")
    proc = run_cli("run", "--params", str(params), "--workspace", str(ws), check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr                 # one line, no Prefect traceback
    assert "stage collect_offpolicy failed" in lines[0]
    assert "data/import/pairs.jsonl:2: field 'chosen' is empty" in lines[0]
    assert "Traceback" not in proc.stdout
    assert snapshot(ws, cache=False) == before         # params.yaml and metrics too


def test_sigterm_ends_the_running_stage_and_the_prefect_server(tmp_path):
    """`kill PID` of a run must not leave its stage process writing into the workspace."""
    import signal
    import time

    import psutil
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--params", str(TINY),
                             "--workspace", str(tmp_path / "ws")], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def cmd(p: psutil.Process) -> str:
        with contextlib.suppress(psutil.Error):
            return " ".join(p.cmdline())
        return ""

    children: list[psutil.Process] = []
    try:
        cli = psutil.Process(proc.pid)
        deadline, stage = time.monotonic() + 120, None
        while stage is None and time.monotonic() < deadline and proc.poll() is None:
            children = cli.children(recursive=True)
            # a stage program that runs a while (prompts, without torch, is over in a blink;
            # the fork server's command names tasks.runtime)
            stage = next((c for c in children if "tasks.stages." in cmd(c)
                          and "tasks.stages.prompts" not in cmd(c)), None)
            time.sleep(0.05)
        assert stage is not None, "no stage process seen"
        children = cli.children(recursive=True)       # the stage and the Prefect server
        assert len(children) >= 2, [cmd(c) for c in children]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(children, timeout=15)
        assert alive == [], [cmd(c) for c in alive]
    finally:                                          # a failure must not leak processes
        for p in [*children, psutil.Process(proc.pid)] if proc.poll() is None else children:
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_relative_model_path_is_relative_to_the_profile_it_is_written_in(tmp_path):
    from flows.params_file import profile_text
    profile = tmp_path / "profiles" / "mine.yaml"
    profile.parent.mkdir()
    profile.write_text(TINY.read_text().replace("  source: tiny\n", "  source: hf_dir\n", 1)
                       .replace('  path: ""\n', '  path: ../models/own   # mine\n', 1))
    text = profile_text(profile)
    want = str((tmp_path / "models" / "own").resolve())
    assert f'  path: "{want}"   # mine\n' in text           # its comment kept
    assert text.endswith(profile.read_text().replace('  path: ../models/own   # mine\n',
                                                     f'  path: "{want}"   # mine\n'))
    proc = run_cli("run", "--params", str(profile), "--workspace", str(tmp_path / "ws"),
                   check=False)
    assert proc.returncode == 2
    assert f"{want}: model directory does not exist" in proc.stderr   # not cwd-relative
    assert not (tmp_path / "ws").exists()
