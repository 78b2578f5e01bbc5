"""Profiles as diffs: `base:` merges the profile it names under the one that names it; errors
name the file that holds the bad key; a workspace gets one complete params file."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from conftest import TINY, run_cli
from flows.workspace import sync_declaration
from tasks.config.params import ParamsError, load_params, to_dict
from tasks.config.profiles import read_profile
from tasks.core import layout


def overlay(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def line_of(path: Path, start: str) -> int:
    return next(i for i, x in enumerate(path.read_text().splitlines(), 1) if x.startswith(start))


def test_an_overlay_is_its_base_with_its_own_keys_on_top(tmp_path: Path) -> None:
    base = overlay(tmp_path / "base.yaml", TINY.read_text())
    over = overlay(tmp_path / "over.yaml", 'base: base.yaml\nseed: 3\niterations:\n'
                   '  "3": {prev: 2}\nupdate:\n  dpo:\n    beta: 0.3\n'
                   'train_rm:\n  num_layers_grid: [1]\n')
    want, got = to_dict(load_params(base)), to_dict(load_params(over))
    want["seed"] = 3
    want["iterations"]["3"] = {"prev": 2}                         # a mapping: merged
    want["update"]["dpo"]["beta"] = 0.3                           # ... down to the leaf
    want["train_rm"]["num_layers_grid"] = [1]                     # a list: replaced
    assert got == want
    assert read_profile(over).files == (str(base), str(over))


@pytest.mark.parametrize("in_base", [False, True], ids=["overlay", "base"])
def test_an_error_names_the_file_and_line_that_hold_the_key(tmp_path: Path,
                                                            in_base: bool) -> None:
    text = TINY.read_text()
    if in_base:
        text = text.replace("\nrollout:\n  n_prompts: 12\n", "\nrollout:\n  n_prompts: -1\n", 1)
    base = overlay(tmp_path / "profiles" / "base.yaml", text)
    over = overlay(tmp_path / "over.yaml", "base: profiles/base.yaml\n" +
                   ("" if in_base else "rollout:\n  n_prompts: -1\n"))
    where = base if in_base else over
    line = line_of(where, "  n_prompts: -1")
    with pytest.raises(ParamsError, match=rf"^{where}:{line}: rollout\.n_prompts: must be > 0"):
        load_params(over)


def test_a_bad_base_is_named_at_the_overlays_base_line(tmp_path: Path) -> None:
    overlay(tmp_path / "base.yaml", TINY.read_text())
    cases = {"base: nope.yaml\n": "base: nope.yaml: no such file",
             "base: 3\n": "base: expected the file name",
             "base: over.yaml\n": "base: over.yaml is this profile or one it starts from"}
    for text, msg in cases.items():
        over = overlay(tmp_path / "over.yaml", "seed: 1\n" + text)
        with pytest.raises(ParamsError, match=rf"^{over}:2: {msg}"):
            load_params(over)
    a = overlay(tmp_path / "a.yaml", "base: b.yaml\n")
    overlay(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ParamsError, match=r"b\.yaml:1: base: a\.yaml is this profile or one "
                                          r"it starts from \(a cycle\)"):
        load_params(a)
    bad = overlay(tmp_path / "bad.yaml", "base: base.yaml\nrollout:\n  samples: 4\n")
    with pytest.raises(ParamsError, match=rf"^{bad}:3: rollout\.samples: unknown key"):
        load_params(bad)


def test_the_workspace_gets_the_merged_profile_in_one_file(tmp_path: Path) -> None:
    """A relative model.path stays relative to the file that wrote it (the base's directory)."""
    text = TINY.read_text().replace("  source: tiny\n", "  source: hf_dir\n", 1).replace(
        '  path: ""\n', "  path: ../models/own   # the base's\n", 1)
    assert "path: ../models/own" in text
    base = overlay(tmp_path / "profiles" / "base" / "base.yaml", text)
    over = overlay(tmp_path / "over.yaml", "base: profiles/base/base.yaml\nseed: 5\n")
    ws = tmp_path / "ws"
    assert layout.PARAMS_FILE in sync_declaration(ws, over)
    written = (ws / layout.PARAMS_FILE).read_text()
    data = yaml.safe_load(written)
    assert "base" not in data and data["seed"] == 5
    own = str((tmp_path / "profiles" / "models" / "own").resolve())
    assert data["model"]["path"] == own
    assert data == {**read_profile(over).data, "model": {**read_profile(over).data["model"],
                                                         "path": own}}
    assert f"#   {over}\n#   {base}\n" in written                  # whence, in the header
    p = load_params(over)
    assert load_params(ws / layout.PARAMS_FILE) == replace(p, model=replace(p.model, path=own))


def test_the_cli_names_the_overlays_line_before_touching_anything(tmp_path: Path) -> None:
    over = overlay(tmp_path / "over.yaml", f"base: {TINY}\nupdate:\n  dpo:\n    beta: x\n")
    proc = run_cli("run", "--params", str(over), "--workspace", str(tmp_path / "ws"),
                   check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {over}:4: update.dpo.beta: expected a finite number, got 'x'"]
    assert not (tmp_path / "ws").exists()


def test_the_shipped_overlays_name_their_base_and_little_else() -> None:
    """default-ppo, default-http-judge, tiny-distributed and tiny-http-judge hold their
    differences only (the rest of each is its base, merged: no copy to drift)."""
    params = TINY.parent
    for name, base, sections in (("default-ppo", "default.yaml", {"iterations", "update",
                                                                   "targets"}),
                                 ("default-http-judge", "default.yaml", {"judge"}),
                                 ("tiny-http-judge", "tiny.yaml", {"offpolicy", "judge"}),
                                 ("tiny-distributed", "tiny.yaml",
                                  {"judge", "rollout", "train_rm", "update", "evaluate"})):
        own = yaml.safe_load((params / f"{name}.yaml").read_text())
        assert own.pop("base") == base and set(own) == sections, name


@pytest.mark.slow      # a whole loop through the CLI from a new workspace
def test_a_profile_that_leaves_out_a_key_a_stage_reads_runs_through(tmp_path: Path) -> None:
    """A person's profile leaves `offpolicy.source` to its default (cold_start). dvc.yaml names
    it for update@k, and DVC fails a stage whose key params.yaml lacks, defaults or not: the
    loop used to stop at update@1 after five stages. The workspace's params.yaml gets it
    written; a workspace file that lacks it is refused before anything runs, in one line."""
    lines = TINY.read_text().splitlines(keepends=True)
    sparse = overlay(tmp_path / "mine.yaml", "".join(
        x for x in lines if not x.startswith(('  source: cold_start', '  "2": {prev: 1}'))))
    ws = tmp_path / "ws"
    proc = run_cli("run", "--params", str(sparse), "--workspace", str(ws))
    assert "[ran] update@1" in proc.stdout and "[ran] gate@1" in proc.stdout
    written = (ws / layout.PARAMS_FILE).read_text()
    assert "# written with their defaults (a stage reads them): offpolicy.source\n" in written
    assert yaml.safe_load(written)["offpolicy"]["source"] == "cold_start"
    assert load_params(ws / layout.PARAMS_FILE) == load_params(sparse)

    data = yaml.safe_load(written)
    del data["offpolicy"]["source"]                     # a person edits the workspace's file
    (ws / layout.PARAMS_FILE).write_text(yaml.safe_dump(data, sort_keys=False))
    proc = run_cli("run", "--workspace", str(ws), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {ws / layout.PARAMS_FILE}: offpolicy.source: not written, and a stage reads "
        "it (DVC needs every key dvc.yaml names in params.yaml); write it (its default: "
        "'cold_start') or run with --params PROFILE, which writes the defaults in"]
