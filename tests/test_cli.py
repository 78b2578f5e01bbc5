"""Bad input through the CLI: a clear error naming file, line and field; nothing touched."""
from __future__ import annotations

import shutil
from pathlib import Path

from conftest import TINY, run_cli, snapshot


def _bad_params(tmp_path: Path, old: str, new: str) -> Path:
    text = TINY.read_text()
    assert old in text
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace(old, new, 1))
    return path


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def test_unknown_params_key_fails_before_creating_the_workspace(tmp_path):
    bad = _bad_params(tmp_path, "  lr: 1.0e-3                  # AdamW", "  lrr: 1.0e-3                 # AdamW")
    ws = tmp_path / "ws"
    proc = run_cli("run", "--params", str(bad), "--workspace", str(ws), check=False)
    assert proc.returncode == 2
    assert f"{bad}:{_line_of(bad, 'lrr:')}: train_rm.lrr: unknown key" in proc.stderr
    assert not ws.exists()


def test_bad_params_leave_an_existing_workspace_untouched(tiny_run, tmp_path):
    ws = tiny_run["ws"]
    before = snapshot(ws)
    bad = _bad_params(tmp_path, "    beta: 0.1 ", "    beta: lots ")
    proc = run_cli("run", "--params", str(bad), "--workspace", str(ws), check=False)
    assert proc.returncode == 2
    assert f"{bad}:{_line_of(bad, 'beta: lots')}: update.dpo.beta: expected a finite number" in proc.stderr
    assert snapshot(ws) == before


def test_missing_model_path_is_named(tmp_path):
    bad = _bad_params(tmp_path, "  source: tiny ", "  source: hf_dir ")
    bad.write_text(bad.read_text().replace('  path: ""', '  path: /no/such/model'))
    proc = run_cli("run", "--params", str(bad), "--workspace", str(tmp_path / "ws"), check=False)
    assert proc.returncode == 2
    assert "/no/such/model: model directory does not exist" in proc.stderr
    assert not (tmp_path / "ws").exists()


def test_malformed_import_data_names_file_and_line_and_keeps_stored_pairs(tiny_run, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(tiny_run["ws"], ws, symlinks=True)
    (ws / ".alignloop" / "mlflow.db").unlink()           # a fresh store for this copy
    pool = ws / "data" / "iter_0" / "pairs_pool.jsonl"
    stored = pool.read_bytes()
    (ws / "data" / "import" / "pairs.jsonl").write_bytes(
        b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": ""}\n')
    params = _bad_params(tmp_path, "  source: cold_start ", "  source: import ")
    proc = run_cli("run", "--params", str(params), "--workspace", str(ws), check=False)
    assert proc.returncode == 1
    assert "data/import/pairs.jsonl:2: field 'chosen' is empty" in proc.stderr
    assert "stage collect_offpolicy failed" in proc.stderr
    assert pool.read_bytes() == stored
