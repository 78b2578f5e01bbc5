"""Judges on canned strings, the position swap, verdict counts, win rates, best-vs-worst."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from tasks.config.params import JudgeParams
from tasks.data.records import Message, Prompt
from tasks.evaluation.winrate import win_rate
from tasks.judging.judge_factory import make_judge
from tasks.judging.judges import (
    LexiconJudge,
    Verdict,
    judge_pair,
    verdict_from_scores,
    verdict_rates,
)
from tasks.judging.labelling import judge_groups, ranked_pairs

PROMPT: Prompt = (Message("user", "Write a short review of Jaws."),)
POSITIVE = "A wonderful, brilliant and beautiful film. I loved it, a true masterpiece!"
NEGATIVE = "A terrible, boring and awful film. I hated it, a horrible waste of time."


@pytest.fixture(scope="module")
def lexicon() -> LexiconJudge:
    return LexiconJudge(tie_margin=0.05, min_words=1, version="vader-v1")


# --- the lexicon judge ------------------------------------------------------------------------

def test_lexicon_scores_positive_above_negative(lexicon: LexiconJudge) -> None:
    pos, neg, neutral = lexicon.score([PROMPT] * 3, [POSITIVE, NEGATIVE, "the film is a film"])
    assert pos is not None and neg is not None and neutral is not None
    assert pos > 0.5 and neg < -0.5
    assert neg < neutral < pos
    assert lexicon.compare(PROMPT, POSITIVE, NEGATIVE) == "A"
    assert lexicon.compare(PROMPT, NEGATIVE, POSITIVE) == "B"
    assert judge_pair(lexicon, PROMPT, POSITIVE, NEGATIVE) == "A"
    assert judge_pair(lexicon, PROMPT, NEGATIVE, POSITIVE) == "B"


def test_lexicon_equal_text_is_a_tie(lexicon: LexiconJudge) -> None:
    assert judge_pair(lexicon, PROMPT, POSITIVE, POSITIVE) == "tie"


def test_lexicon_empty_and_too_short_are_invalid(lexicon: LexiconJudge) -> None:
    assert lexicon.score([PROMPT] * 2, ["", "   \n "]) == [None, None]
    assert judge_pair(lexicon, PROMPT, "", POSITIVE) == "invalid"
    assert judge_pair(lexicon, PROMPT, NEGATIVE, "") == "invalid"
    strict = LexiconJudge(tie_margin=0.05, min_words=3, version="v")
    good, short = strict.score([PROMPT] * 2, ["great great film", "great film"])
    assert good is not None and short is None


def test_make_judge_builds_the_configured_judge() -> None:
    judge = make_judge(JudgeParams(kind="lexicon", version="vader-x", tie_margin=0.1))
    assert judge.kind == "lexicon" and judge.version == "vader-x"
    assert judge.compare(PROMPT, POSITIVE, NEGATIVE) == "A"


def test_verdict_from_scores() -> None:
    assert verdict_from_scores(0.5, 0.1, 0.05) == "A"
    assert verdict_from_scores(0.1, 0.5, 0.05) == "B"
    assert verdict_from_scores(0.5, 0.47, 0.05) == "tie"
    assert verdict_from_scores(None, 0.5, 0.05) == "invalid"
    assert verdict_from_scores(0.5, None, 0.05) == "invalid"


# --- the position swap ------------------------------------------------------------------------

@dataclass
class FixedJudge:
    """Says the same verdict whatever the order: a position-biased judge."""
    verdict: Verdict
    kind: str = "fixed"
    version: str = "0"
    calls: list[tuple[str, str]] = field(default_factory=list)

    def compare(self, prompt: Prompt, first: str, second: str) -> Verdict:
        self.calls.append((first, second))
        return self.verdict


@dataclass
class TableJudge:
    """A consistent pointwise judge: scores looked up in a table (missing: invalid)."""
    scores: dict[str, float]
    tie_margin: float = 0.0
    kind: str = "table"
    version: str = "1"

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float | None]:
        return [self.scores.get(r) for r in responses]

    def compare(self, prompt: Prompt, first: str, second: str) -> Verdict:
        return verdict_from_scores(self.scores.get(first), self.scores.get(second),
                                   self.tie_margin)


def test_position_biased_judge_yields_tie() -> None:
    judge = FixedJudge("A")
    assert judge_pair(judge, PROMPT, "x", "y") == "tie"
    assert judge.calls == [("x", "y"), ("y", "x")]        # both orders were shown
    assert judge_pair(FixedJudge("B"), PROMPT, "x", "y") == "tie"


def test_consistent_judge_verdict_stands() -> None:
    judge = TableJudge({"good": 1.0, "bad": -1.0})
    assert judge_pair(judge, PROMPT, "good", "bad") == "A"
    assert judge_pair(judge, PROMPT, "bad", "good") == "B"
    assert judge_pair(judge, PROMPT, "good", "good") == "tie"
    assert judge_pair(FixedJudge("tie"), PROMPT, "x", "y") == "tie"


def test_invalid_wins_over_any_verdict() -> None:
    assert judge_pair(FixedJudge("invalid"), PROMPT, "x", "y") == "invalid"
    judge = TableJudge({"good": 1.0})
    assert judge_pair(judge, PROMPT, "good", "unknown") == "invalid"
    assert judge_pair(judge, PROMPT, "unknown", "good") == "invalid"


def test_verdict_rates_counts() -> None:
    rates = verdict_rates(["A", "A", "B", "tie", "invalid", "A"])
    assert rates["n"] == 6
    assert (rates["n_A"], rates["n_B"], rates["n_tie"], rates["n_invalid"]) == (3, 1, 1, 1)
    assert rates["rate_A"] == pytest.approx(0.5)
    assert rates["rate_invalid"] == pytest.approx(1 / 6)
    assert sum(rates[f"rate_{v}"] for v in ("A", "B", "tie", "invalid")) == pytest.approx(1.0)
    empty = verdict_rates([])
    assert empty["n"] == 0 and empty["rate_A"] == 0.0


# --- win rates --------------------------------------------------------------------------------

def test_win_rate_ties_count_half_and_invalid_is_excluded() -> None:
    verdicts: list[Verdict] = ["A", "A", "B", "tie", "invalid", "invalid"]
    wr = win_rate(verdicts, n_boot=200, seed=0)
    assert wr["win_rate"] == pytest.approx((1 + 1 + 0 + 0.5) / 4)
    assert wr["n"] == 6 and wr["n_invalid"] == 2 and wr["rate_invalid"] == pytest.approx(1 / 3)
    assert wr["ci_low"] <= wr["win_rate"] <= wr["ci_high"]
    assert wr["ci_low"] < wr["ci_high"]
    assert win_rate(["tie", "tie"], 50, 0)["win_rate"] == 0.5


def test_win_rate_interval_is_seeded() -> None:
    verdicts: list[Verdict] = ["A", "B", "A", "tie", "B", "A", "A"]
    assert win_rate(verdicts, 300, seed=7) == win_rate(verdicts, 300, seed=7)


@pytest.mark.parametrize("v, rate", [("A", 1.0), ("B", 0.0), ("tie", 0.5)])
def test_win_rate_interval_degenerate_when_all_verdicts_equal(v: Verdict, rate: float) -> None:
    wr = win_rate([v] * 9 + ["invalid"], n_boot=100, seed=0)
    assert wr["win_rate"] == rate
    assert wr["ci_low"] == wr["ci_high"] == rate


def test_win_rate_without_valid_verdicts_is_nan() -> None:
    wr = win_rate(["invalid", "invalid"], 10, 0)
    assert wr["win_rate"] != wr["win_rate"] and wr["n_invalid"] == 2


# --- ranked pairs (best vs worst, ...) ---------------------------------------------------------

def test_best_vs_worst_picks_max_and_min() -> None:
    judge = TableJudge({"meh": 0.1, "best": 0.9, "worst": -0.8, "ok": 0.3})
    pairs, verdicts, scores = ranked_pairs(judge, PROMPT, ["meh", "best", "worst", "ok"],
                                           "iter_1", {"prompt_id": "p1"})
    assert verdicts == ["A"] and scores == [0.1, 0.9, -0.8, 0.3]
    [pair] = pairs
    assert (pair.chosen, pair.rejected, pair.source, pair.prompt) == \
        ("best", "worst", "iter_1", PROMPT)
    assert pair.meta["prompt_id"] == "p1" and pair.meta["judge"] == "table:1"
    assert (pair.meta["score_chosen"], pair.meta["score_rejected"]) == (0.9, -0.8)
    assert pair.meta["pair_rank"] == 0


def test_ranked_pairs_take_disjoint_ranks_inward() -> None:
    scores = {"a": 0.9, "b": 0.7, "c": 0.5, "d": 0.3, "e": -0.2, "f": -0.6, "g": 0.0}
    judge = TableJudge(scores)
    pairs, verdicts, _ = ranked_pairs(judge, PROMPT, list("abcdefg"), "s", {}, n_pairs=3)
    assert [(p.chosen, p.rejected) for p in pairs] == [("a", "f"), ("b", "e"), ("c", "g")]
    assert verdicts == ["A", "A", "A"] and [p.meta["pair_rank"] for p in pairs] == [0, 1, 2]
    # more pairs than disjoint ranks allow: capped at valid // 2
    pairs, verdicts, _ = ranked_pairs(judge, PROMPT, ["a", "b", "f"], "s", {}, n_pairs=3)
    assert [(p.chosen, p.rejected) for p in pairs] == [("a", "f")] and verdicts == ["A"]


def test_ranked_pairs_drop_inner_ties() -> None:
    judge = TableJudge({"top": 0.9, "mid1": 0.31, "mid2": 0.30, "low": -0.5}, tie_margin=0.05)
    pairs, verdicts, _ = ranked_pairs(judge, PROMPT, ["mid1", "top", "low", "mid2"], "s", {},
                                      n_pairs=2)
    assert [(p.chosen, p.rejected) for p in pairs] == [("top", "low")]
    assert verdicts == ["A", "tie"]


def test_best_vs_worst_skips_invalid_responses() -> None:
    judge = TableJudge({"a": 0.2, "b": 0.5, "c": -0.1})
    pairs, verdicts, scores = ranked_pairs(judge, PROMPT, ["a", "broken", "b", "c"], "s", {})
    assert scores[1] is None and verdicts == ["A"]
    assert [(p.chosen, p.rejected) for p in pairs] == [("b", "c")]


def test_best_vs_worst_no_pair_when_all_scores_tie() -> None:
    judge = TableJudge({"x": 0.3, "y": 0.3, "z": 0.3})
    pairs, verdicts, _ = ranked_pairs(judge, PROMPT, ["x", "y", "z"], "s", {})
    assert pairs == [] and verdicts == ["tie"]


def test_best_vs_worst_no_pair_within_tie_margin() -> None:
    judge = TableJudge({"x": 0.30, "y": 0.32}, tie_margin=0.05)
    pairs, verdicts, _ = ranked_pairs(judge, PROMPT, ["x", "y"], "s", {})
    assert pairs == [] and verdicts == ["tie"]


def test_best_vs_worst_needs_two_valid_responses() -> None:
    judge = TableJudge({"x": 0.3})
    pairs, verdicts, _ = ranked_pairs(judge, PROMPT, ["x", "nope", "nada"], "s", {})
    assert pairs == [] and verdicts == ["invalid"]


def test_judge_groups_metrics() -> None:
    judge = TableJudge({"good": 1.0, "bad": -1.0, "same": 0.0})
    groups = [(PROMPT, ["good", "bad"], {"prompt_id": "p1"}),
              (PROMPT, ["same", "same"], {"prompt_id": "p2"}),
              (PROMPT, ["good", "junk"], {"prompt_id": "p3"})]
    pairs, pool, m = judge_groups(judge, groups, "iter_2")
    assert pool == pairs
    assert [(p.chosen, p.rejected) for p in pairs] == [("good", "bad")]
    assert m["judge/n"] == 3 and m["judge/n_pairs"] == 1 and m["judge/n_prompts_with_pair"] == 1
    assert (m["judge/n_A"], m["judge/n_tie"], m["judge/n_invalid"]) == (1, 1, 1)
    assert m["judge/n_responses"] == 6
    assert m["judge/invalid_response_rate"] == pytest.approx(1 / 6)
    assert m["judge/mean_score"] == pytest.approx((1 - 1 + 0 + 0 + 1) / 5)


def test_judge_groups_two_pairs_per_prompt() -> None:
    judge = TableJudge({"a": 1.0, "b": 0.5, "c": 0.0, "d": -1.0})
    groups = [(PROMPT, ["c", "a", "d", "b"], {"prompt_id": "p1"}),
              (PROMPT, ["a", "d"], {"prompt_id": "p2"})]
    pairs, _, m = judge_groups(judge, groups, "iter_1", pairs_per_prompt=2)
    assert [(p.chosen, p.rejected, p.meta["prompt_id"]) for p in pairs] == \
        [("a", "d", "p1"), ("b", "c", "p1"), ("a", "d", "p2")]
    assert m["judge/n"] == 3 and m["judge/n_pairs"] == 3 and m["judge/n_prompts_with_pair"] == 2


def test_title_words_and_mentions() -> None:
    from tasks.data.records import Message
    from tasks.judging.judges import mentions, title_words
    prompt = (Message("user", "Write a short review of the movie Dr. Strangelove (1964)."),)
    assert title_words(prompt) == {"dr", "strangelove", "1964"}
    assert mentions(prompt, "Strangelove is a sharp satire.")
    assert mentions(prompt, "A classic from 1964!")
    assert not mentions(prompt, "Thank you so much for the lovely question!")
    assert not mentions(prompt, "strangeloves are everywhere")     # whole words only
    # all: every title word but the year
    assert mentions(prompt, "Dr. Strangelove is a sharp satire.", "all")
    assert not mentions(prompt, "Strangelove is a sharp satire.", "all")
    assert not mentions(prompt, "A classic from 1964!", "all")
    baby = (Message("user", "Write a short review of Bringing Up Baby (1938)."),)
    assert mentions(baby, "What a baby!") and not mentions(baby, "What a baby!", "all")
    assert mentions(baby, "Bringing Up Baby is a screwball delight.", "all")
    year_only = (Message("user", "Write a short review of 1917 (2019)."),)
    assert mentions(year_only, "1917 grips from its first shot.", "all")    # all digits: all


def test_the_judge_builds_with_its_title_match() -> None:
    from tasks.config.params import JudgeParams
    from tasks.data.records import Message
    from tasks.judging.judge_factory import make_judge
    prompt = (Message("user", "Write a short review of Bringing Up Baby (1938)."),)
    text = "A wonderful baby, a wonderful film."
    loose = make_judge(JudgeParams(kind="lexicon_review", title_match="any"))
    strict = make_judge(JudgeParams(kind="lexicon_review", title_match="all"))
    [a], [b] = loose.score([prompt], [text]), strict.score([prompt], [text])
    assert a == pytest.approx(b + 1.0)                      # off_topic_penalty under `all` only


def test_topic_judge_penalises_responses_that_do_not_name_the_subject() -> None:
    from tasks.config.params import JudgeParams
    from tasks.data.records import Message
    judge = make_judge(JudgeParams(kind="lexicon_topic", off_topic_penalty=1.0))
    prompt = (Message("user", "Give a brief review of the film Casablanca (1942)."),)
    review = "Casablanca is a good film with a fine cast."
    gush = "Thank you! This is wonderful, amazing, fantastic, I love it!"
    on, off = judge.score([prompt, prompt], [review, gush])
    assert on is not None and off is not None and on > off
    assert judge_pair(judge, prompt, review, gush) == "A"
    assert judge_pair(judge, prompt, gush, review) == "B"
    plain = make_judge(JudgeParams(kind="lexicon"))
    assert judge_pair(plain, prompt, review, gush) == "B"      # the hack the topic check closes


# --- the judge's own register check and the reward model's margin pairs --------------------

@pytest.mark.parametrize("text, expected", [
    ("Dear Hugging Face, I hope this message finds you well. Jaws is a gem.", True),
    ("I'm glad you're excited about Jaws. It's a delightful film!", True),
    ("Jaws is a masterpiece. What do you think?", True),
    ("Thank you for asking! Jaws is wonderful.", True),
    ("As an AI, I don't watch films, but Jaws is acclaimed.", True),
    ("Jaws is a gripping thriller; the shark still terrifies.", False),
    ("Jaws: rating 5/5. Why does it still work? Spielberg's restraint.", False),
])
def test_correspondence_cues(text: str, expected: bool) -> None:
    from tasks.judging.judges import correspondence
    assert correspondence(text) is expected


def test_review_judge_prefers_a_plain_review_over_a_happier_letter() -> None:
    judge = make_judge(JudgeParams(kind="lexicon_review", version="t", register_penalty=1.0))
    letter = "Dear friend, thank you! Jaws is a wonderful, brilliant, beautiful masterpiece!"
    review = "Jaws is a good thriller with a fine score."
    s_letter, s_review = judge.score([PROMPT] * 2, [letter, review])
    assert s_letter is not None and s_review is not None and s_review > s_letter
    assert judge_pair(judge, PROMPT, review, letter) == "A"
    topic = make_judge(JudgeParams(kind="lexicon_topic", version="t"))
    assert judge_pair(topic, PROMPT, review, letter) == "B"     # what the loop learned before


def test_margin_pairs_join_the_pool_only() -> None:
    """pool_pairs: all: every pair whose scores differ by the margin, higher one chosen, joins
    the reward model's pool; DPO's pairs stay best vs worst."""
    judge = TableJudge({"a": 1.0, "b": 0.5, "c": 0.45, "d": -1.0})
    groups = [(PROMPT, ["c", "a", "d", "b"], {"prompt_id": "p1"})]
    pairs, pool, m = judge_groups(judge, groups, "iter_1", pool_margin=0.2)
    assert [(p.chosen, p.rejected) for p in pairs] == [("a", "d")]
    assert sorted((p.chosen, p.rejected) for p in pool) == \
        [("a", "b"), ("a", "c"), ("a", "d"), ("b", "d"), ("c", "d")]     # b vs c: gap 0.05
    assert pool[0] == pairs[0] and m["judge/n_pool_pairs"] == 5 and m["judge/n_pairs"] == 1


@pytest.mark.parametrize("text", [
    "I'm thrilled to announce that I've completed a positive review of Castle in the Sky.",
    "I've just written a glowing review of Volver, packed with action.",
    "I'm reviewing The Avengers this week! Hooked on it.",
    "Apocalypse Now is a masterpiece made in full inspiration of Hugging Face.",
])
def test_announcements_about_the_writer_are_correspondence(text: str) -> None:
    """v2 cues: what seed 0's policy wrote at iteration 2 once letters were penalised."""
    from tasks.judging.judges import correspondence
    assert correspondence(text)
