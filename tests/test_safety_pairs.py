"""The red-team training pairs (`params/redteam/safety_pairs.jsonl`): they import as
`alignloop import` reads them, cover every violation kind, and share no film and no prompt
with the regression set, so a policy trained on them is still measured on prompts it never saw."""
from __future__ import annotations

import difflib
import json
import re
from collections import Counter

from conftest import ROOT
from tasks.data.pair_import import read_pairs
from tasks.data.records import parse_prompt
from tasks.evaluation.violations import KINDS, Probe, check, read_probes

PAIRS = ROOT / "params" / "redteam" / "safety_pairs.jsonl"
REGRESSION = ROOT / "params" / "redteam" / "prompts.jsonl"
MOVIES = ROOT / "params" / "prompts" / "movies.txt"
ORDINARY = "ordinary"            # meta.kind of a plain review request
MAX_SIMILARITY = 0.8             # to any regression prompt, films masked (highest is 0.72)
SUBJECT = re.compile(r"^(?P<title>.+) \((?P<year>\d{4})\)$")


def _rows() -> list[dict]:
    return [json.loads(line) for line in PAIRS.read_text().splitlines() if line.strip()]


def _text(prompt: list[dict] | tuple) -> str:
    return " ".join(m["content"] if isinstance(m, dict) else m.content for m in prompt)


def _titles(subject: str) -> tuple[str, str]:
    """"Sunrise: A Song of Two Humans (1927)" -> ("sunrise: a song of two humans", "sunrise"):
    the title and the short form a prompt may use ("Review Sunrise (1927)")."""
    m = SUBJECT.match(subject)
    assert m, f"{subject!r} is not 'Title (Year)'"
    title = m["title"].lower()
    return title, title.split(":")[0]


def _masked(text: str, names: list[str]) -> str:
    for name in names:
        text = text.replace(name, "<film>")
    return " ".join(text.lower().split())


def test_the_file_imports_as_alignloop_import_reads_it() -> None:
    res = read_pairs(PAIRS)
    assert res.errors == [] and res.identical == [] and res.duplicates == 0
    assert res.rows == len(res.pairs) >= 100
    assert len({_text(p.prompt) for p in res.pairs}) == len(res.pairs)   # one pair a prompt
    assert all(p.meta["kind"] in (*KINDS, ORDINARY) for p in res.pairs)


def test_every_kind_is_there_and_plain_requests_are_about_a_third() -> None:
    kinds = Counter(r["meta"]["kind"] for r in _rows())
    assert set(kinds) == {*KINDS, ORDINARY} and min(kinds[k] for k in KINDS) >= 15
    assert 0.25 <= kinds[ORDINARY] / sum(kinds.values()) <= 0.35


def test_chosen_is_a_short_clean_review_naming_its_film() -> None:
    """What the policy is pulled towards: 30-45 words that name the film, and nothing the
    violation checker flags (the rejected side is not held to the checker: its wording goes
    beyond the checker's rules on purpose)."""
    for r in _rows():
        meta, chosen = r["meta"], r["chosen"][0]["content"]
        kind = meta["kind"] if meta["kind"] in KINDS else "contact"
        probe = Probe("x", kind, meta["subject"], parse_prompt(r, "x"),
                      tuple(meta.get("canary", ())))
        assert meta["subject"] in chosen, chosen
        assert 30 <= len(chosen.split()) <= 45, chosen
        assert len(r["rejected"][0]["content"].split()) <= 60
        assert check(chosen, probe) == (), chosen


def test_no_film_of_the_regression_set_or_of_the_task_s_prompts() -> None:
    """Each prompt names exactly its own film, and that film is neither in the regression
    set nor among the task's subjects (whose held-out share evaluation samples)."""
    subjects = [p.subject for p in read_probes(REGRESSION)] + [
        ln.strip() for ln in MOVIES.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    full = {_titles(s)[0] for s in subjects}
    short = {_titles(s)[1] for s in subjects}
    seen = set()
    for r in _rows():
        subject, text = r["meta"]["subject"], _text(r["prompt"])
        assert len(re.findall(r"\(\d{4}\)", text)) == text.count(subject) == 1, text
        title, title_short = _titles(subject)         # a sequel or namesake of a title differs
        assert title not in full | short and title_short not in full, subject
        assert subject not in seen, subject
        seen.add(subject)


def test_no_prompt_is_a_regression_prompt_or_close_to_one() -> None:
    probes = read_probes(REGRESSION)
    regression = []
    for p in probes:
        m = SUBJECT.match(p.subject)
        assert m
        regression.append(_masked(_text(p.prompt), [p.subject, f"{m['title'].split(':')[0]} "
                                                               f"({m['year']})"]))
    assert all("<film>" in t for t in regression)
    canaries = {c for p in probes for c in p.canary}
    for r in _rows():
        text = _text(r["prompt"])
        own = _masked(text, [r["meta"]["subject"]])
        assert own not in regression, text
        close = max(difflib.SequenceMatcher(None, own, t).ratio() for t in regression)
        assert close < MAX_SIMILARITY, text
        assert not [c for c in canaries if c in text.lower()], text   # not the test's payloads


def test_the_pairs_are_shipped_into_workspaces() -> None:
    """A workspace gets them at params/redteam/safety_pairs.jsonl, from where `alignloop import`
    brings them into its data/import/ (the only place offpolicy.import_path may name)."""
    from flows import shipped
    assert (PAIRS, "params/redteam/safety_pairs.jsonl") in shipped.data_files()
