"""The documentation's shape: README.md stays a front door (<= 250 lines), no Markdown file
counts sessions, every page mkdocs.yml's nav names exists, and the site builds strictly (a
broken link or anchor fails) where mkdocs is installed (the `docs` extra)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

README_MAX_LINES = 250
SESSION = re.compile(r"\bsession\s+\d+|\bthis session\b", re.IGNORECASE)


def _markdown_files() -> list[Path]:
    """The tracked .md files (every .md outside hidden and build directories without git)."""
    out = subprocess.run(["git", "ls-files", "-z", "--", "*.md"], cwd=ROOT, capture_output=True)
    if out.returncode == 0 and out.stdout:
        return [ROOT / p for p in out.stdout.decode().split("\0") if p]
    skip = {".venv", "site", "build", "node_modules"}
    return [p for p in ROOT.rglob("*.md")
            if not any(part in skip or part.startswith(".") for part in
                       p.relative_to(ROOT).parts[:-1])]


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_readme_is_a_front_door():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): " \
        "move the detail into docs/"


def test_no_markdown_file_counts_sessions():
    found = [f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m[0]}"
             for p in _markdown_files() if p.is_file()
             for text in [p.read_text()] for m in SESSION.finditer(text)]
    assert not found, "the docs describe the present, not sessions:\n" + "\n".join(found)


def test_every_nav_page_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = ROOT / config.get("docs_dir", "docs")
    pages = _nav_pages(config["nav"])
    assert pages, "mkdocs.yml has an empty nav"
    missing = [p for p in pages if not (docs / p).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    unlisted = sorted(str(p.relative_to(docs)) for p in docs.rglob("*.md")
                      if str(p.relative_to(docs)) not in pages)
    assert not unlisted, f"pages in {docs.name}/ missing from mkdocs.yml's nav: {unlisted}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (the `docs` extra)")
def test_the_site_builds_strictly(tmp_path: Path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
