"""Every command and code block in README.md and docs/ runs as written, against a finished tiny
workspace at `./workspace` (where `make run` leaves the default one), or says why it does not
run here in a `<!-- not run: WHY -->` line right above it. Blocks without a language (drawings,
sample output) are not commands."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, copy_workspace

RUNNABLE = ("bash", "sh", "python")
BLOCK = re.compile(r"(?:^<!-- (?P<mark>[^\n]*?) -->\n)?^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```",
                   re.MULTILINE | re.DOTALL)


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks() -> list[tuple[str, str, str, str | None]]:
    """(where: file:line, language, body, mark) of every fenced block with a language."""
    out = []
    for path in _docs():
        text = path.read_text()
        for m in BLOCK.finditer(text):
            if not m["lang"]:
                continue
            line = text.count("\n", 0, m.start("lang")) + 1
            out.append((f"{path.relative_to(ROOT)}:{line}", m["lang"], m["body"], m["mark"]))
    return out


def _runnable() -> list[tuple[str, str, str]]:
    return [(where, lang, body) for where, lang, body, mark in _blocks() if mark is None]


def test_every_block_runs_here_or_says_why():
    assert _blocks(), "no code block found"
    for where, lang, _, mark in _blocks():
        if mark is None:
            assert lang in RUNNABLE, f"{where}: a ```{lang} block runs only as {RUNNABLE}"
        else:
            assert re.fullmatch(r"not run: \S.{10,}", mark), \
                f"{where}: a block that does not run says why (<!-- not run: WHY -->)"


@pytest.fixture(scope="module")
def place(tiny_run, tmp_path_factory) -> Path:
    """A directory holding `workspace`: a copy of the finished tiny run."""
    here = tmp_path_factory.mktemp("snippets")
    copy_workspace(tiny_run["ws"], here / "workspace")
    return here


@pytest.mark.parametrize("where,lang,body", _runnable(), ids=[b[0] for b in _runnable()])
def test_the_block_runs_as_written(place: Path, where: str, lang: str, body: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    cmd = [sys.executable, "-c", body] if lang == "python" else \
        ["bash", "-e", "-o", "pipefail", "-c", body]
    proc = subprocess.run(cmd, cwd=place, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{where} exited {proc.returncode}\n--- stdout\n" \
        f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, f"{where}\n{proc.stderr[-3000:]}"
