"""Each params key is documented once, in its schema (tasks/schemas/): `alignloop params` prints
it; the profiles carry values, and comments only where they say why a profile picks a value."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from flows import params_doc
from tasks.config.params import load_params

PROFILES = sorted((ROOT / "params").glob("*.yaml"))


def test_every_schema_field_is_documented_in_its_schema() -> None:
    entries = list(params_doc.entries())
    assert len(entries) > 100
    undocumented = [e.key for e in entries if not e.doc]
    assert not undocumented, f"undocumented params keys: {undocumented}"


def test_docs_are_read_from_the_field_line_and_the_comment_lines_under_it() -> None:
    from tasks.schemas.judge import JudgeParams
    docs = params_doc.field_docs(JudgeParams)
    assert docs["kind"].startswith("lexicon (VADER) | lexicon_topic")     # a two-line field
    assert docs["kind"].endswith("judge.model: its directory)")          # and its comment lines
    assert docs["timeout_s"] == "http: seconds per request"
    assert set(docs) == set(JudgeParams.__dataclass_fields__)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _shingles(text: str, n: int = 4) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def profile_comments(path: Path) -> dict[str, str]:
    """Dotted key -> its comment (the line's and the comment lines under it) in a profile."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    last = None
    for raw in path.read_text().splitlines():
        text = raw.lstrip()
        indent = len(raw) - len(text)
        if text.startswith("#"):
            if last is not None and indent > 10:
                out[last] += " " + text.lstrip("#").strip()
            else:
                last = None
            continue
        m = re.match(r'"?([\w.]+)"?\s*:\s*([^#]*)(#.*)?$', text)
        if not m:
            last = None
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(1)))
        last = ".".join(k for _, k in stack) if m.group(3) else None
        if last is not None:
            out[last] = m.group(3).lstrip("#").strip()
    return out


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_profiles_do_not_repeat_the_schema_docs(profile: Path) -> None:
    docs = {e.key: e.doc for e in params_doc.entries()}
    for key, comment in profile_comments(profile).items():
        assert key in docs or key.split(".")[0] == "iterations" or \
            any(k.startswith(key + ".") for k in docs), f"{profile.name}: {key} is no params key"
        shared = _shingles(comment) & _shingles(docs.get(key, ""))
        assert not shared, (f"{profile.name}: the comment on {key} repeats its schema doc "
                            f"({' '.join(sorted(shared)[0])} ...): it says what the key means; "
                            f"that is tasks/schemas/' job")


def test_the_checker_finds_a_copied_doc(tmp_path: Path) -> None:
    p = tmp_path / "p.yaml"
    p.write_text("judge:\n  tie_margin: 0.05   # score gaps below this are ties, not\n"
                 "                     #   preferences\n")
    comment = profile_comments(p)["judge.tie_margin"]
    assert comment == "score gaps below this are ties, not preferences"
    doc = dict((e.key, e.doc) for e in params_doc.entries())["judge.tie_margin"]
    assert _shingles(comment) & _shingles(doc)


def test_cli_params_prints_value_type_default_and_meaning() -> None:
    proc = run_cli("params", "update.dpo.beta", "--params", str(ROOT / "params" / "default.yaml"))
    lines = proc.stdout.splitlines()
    assert lines[0] == "update.dpo.beta = 0.2    (float, default 0.1)"
    assert "KL strength of the implicit reward" in proc.stdout
    section = run_cli("params", "update.ppo.reuse").stdout          # a section: all its keys
    assert [line.split()[0] for line in section.splitlines() if not line.startswith(" ")] == [
        "update.ppo.reuse.iterations_back", "update.ppo.reuse.truncate",
        "update.ppo.reuse.level", "update.ppo.reuse.max_staleness"]


def test_cli_params_reads_an_overlay_merged_with_its_base() -> None:
    ppo = ROOT / "params" / "default-ppo.yaml"
    proc = run_cli("params", "update", "--params", str(ppo))
    assert "update.algo = 'ppo'" in proc.stdout
    beta = load_params(ROOT / "params" / "default.yaml").update.dpo.beta    # from its base
    assert "beta" not in ppo.read_text() and f"update.dpo.beta = {beta!r}" in proc.stdout


def test_cli_params_unknown_key_is_one_line() -> None:
    proc = run_cli("params", "update.dpo.betta", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: update.dpo.betta: no such params key (alignloop params lists them all)"]
