"""Candidate against champion on the select prompts (tasks/evaluation/headtohead.py), the select
prompt set (stage prompts) and the gate's head-to-head rule."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.core.jsonl import DataError
from tasks.evaluation import headtohead
from tasks.schemas.gate import GateParams
from tasks.schemas.prompts import PromptParams
from tasks.stages.gate import decide
from tasks.stages.prompts import build_prompts, build_select


class Score(int):
    valid = True


class Gold:
    """Scores a text by its number: higher wins (the rule is gold_verdict's shape)."""

    def score(self, texts, subjects, nll):
        return [Score(t) for t in texts]


def verdict(a: int, b: int) -> str:
    return "A" if a > b else "B" if b > a else "tie"


def rows(*texts: str) -> list[dict]:
    return [{"prompt_id": f"s{i}", "subject": "x", "text": t, "nll": 1.0}
            for i, t in enumerate(texts)]


def test_compare_counts_wins_losses_and_ties_half():
    m = headtohead.compare(Gold(), verdict, rows("3", "3", "1", "2"), rows("1", "2", "1", "5"),
                           200, 0)
    assert (m["eval/champion_gold_n_win"], m["eval/champion_gold_n_loss"],
            m["eval/champion_gold_n_tie"]) == (2, 1, 1)
    assert m["eval/champion_gold_win_rate"] == pytest.approx(2.5 / 4)
    assert m["eval/champion_gold_win_rate_ci_low"] <= 0.625 <= \
        m["eval/champion_gold_win_rate_ci_high"]
    other = headtohead.compare(Gold(), verdict, rows("1"), rows("0"), 10, 0, "eval/select_gold_")
    assert other["eval/select_gold_win_rate"] == 1.0


def test_read_refuses_other_prompts_and_bad_rows(tmp_path: Path):
    path = tmp_path / "select_samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows("a", "b")))
    assert [r["text"] for r in headtohead.read(str(path), ["s0", "s1"])] == ["a", "b"]
    with pytest.raises(DataError, match="responses to other prompts than the select prompts"):
        headtohead.read(str(path), ["s0", "s9"])
    path.write_text(json.dumps({"prompt_id": "s0", "subject": "x", "text": "a"}) + "\n")
    with pytest.raises(DataError, match=f"^{path}:1: field 'nll' missing or not a number"):
        headtohead.read(str(path), ["s0"])


def test_select_prompts_use_subjects_neither_other_set_has_and_change_neither():
    subjects = [f"Movie {i} (19{i % 100:02d})" for i in range(40)]
    templates = ["Review {movie}.", "Write about {movie}.", "Critique {movie}."]
    p = PromptParams(n_train=20, n_heldout=10, n_select=25)
    train, held = build_prompts(subjects, templates, p, 0)
    assert (train, held) == build_prompts(subjects, templates,
                                          PromptParams(n_train=20, n_heldout=10), 0)
    select = build_select(subjects, templates, p, 0)
    used = {r["subject"] for r in train + held}
    assert len(select) == 25 and not used & {r["subject"] for r in select}
    texts = [r["prompt"][0]["content"] for r in select]
    assert len(set(texts)) == 25                       # 10 subjects, up to 3 templates each
    with pytest.raises(DataError, match="10 subjects left after train and held-out, with 3 "
                                        "templates at most 30 select prompts; n_select is 31"):
        build_select(subjects, templates, PromptParams(n_train=20, n_heldout=10, n_select=31), 0)


def test_the_gate_promotes_only_a_gain_over_the_champion_beyond_its_noise():
    base = {"eval/win_rate": 0.9, "eval/win_rate_ci_low": 0.8, "eval/kl": 5.0,
            "eval/violation_rate_increase_ci_high": 0.0}     # no worse on the red-team set
    p = GateParams(min_champion_gold_ci_low=0.5)
    vs = lambda lo: {"eval/champion_gold_win_rate": lo + 0.09,
                     "eval/champion_gold_win_rate_ci_low": lo}
    assert not decide({**base, **vs(0.46)}, p)["passed"]     # 0.55: a copy's luck
    assert not decide({**base, **vs(0.5)}, p)["passed"]
    assert decide({**base, **vs(0.51)}, p)["passed"]
    assert decide({**base, **vs(0.2)}, GateParams(min_champion_gold_ci_low=-1.0))["passed"]
    assert decide(base, p)["passed"]                   # a workspace without select prompts
    flagged = decide({**base, **vs(0.6), "eval/hacking_flag": 1.0}, p)
    assert flagged["reasons"] == ["reward-hacking monitor flagged this iteration"]
