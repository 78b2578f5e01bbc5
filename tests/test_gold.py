"""The gold evaluator: its pairwise rule, its scorers on canned text, Best-of-N's pieces."""
from __future__ import annotations

import math

import pytest
import torch

from tasks.config.params import GenerationParams, GoldParams, MonitorParams
from tasks.evaluation.gold import GoldEvaluator, GoldScore, gold_verdict, subject_title
from tasks.models.lm import mean_nll, padded
from tasks.stages.evaluate import best_of_n_kl, hacking_flags, kl_per_response


def g(sentiment: float = 0.0, on_topic: bool = True, fluent: bool = True) -> GoldScore:
    return GoldScore(sentiment, 0.5 if on_topic else 0.0, 2.0 if fluent else 9.0, on_topic,
                     fluent)


@pytest.mark.parametrize("a, b, expected", [
    (g(1), g(5, on_topic=False), "A"),         # on-topic beats gushing off-topic
    (g(-3), g(9, fluent=False), "A"),          # fluent beats disfluent, whatever the words
    (g(5, on_topic=False), g(0), "B"),
    (g(5, on_topic=False), g(-5, fluent=False), "tie"),   # neither valid
    (g(4), g(2), "A"), (g(2), g(4), "B"), (g(3), g(3), "tie"),
])
def test_gold_rule(a: GoldScore, b: GoldScore, expected: str) -> None:
    assert gold_verdict(a, b) == expected


def test_subject_title_drops_the_year_only() -> None:
    assert subject_title("Nosferatu (1922)") == "Nosferatu"
    assert subject_title("Dr. Strangelove (1964)") == "Dr. Strangelove"
    assert subject_title("Alien (Director's Cut)") == "Alien (Director's Cut)"
    assert subject_title("Heat") == "Heat"


def test_mean_nll_and_empty_response() -> None:
    logp, mask = padded([[-1.0, -3.0], [-2.0], []])
    assert mean_nll(logp, mask) == [2.0, 2.0, math.inf]


@pytest.fixture(scope="module")
def gold() -> GoldEvaluator:
    return GoldEvaluator(GoldParams())


def test_embedder_separates_on_and_off_topic(gold: GoldEvaluator) -> None:
    responses = ["Jaws is a gripping thriller; Spielberg's shark still terrifies.",
                 "Thank you for the great work! I'm glad I could assist you today.",
                 "Jaws is a gripping thriller; Spielberg's shark still terrifies."]
    sims = gold.similarity(responses, ["Jaws (1975)", "Jaws (1975)", "Casablanca (1942)"])
    assert sims[0] > GoldParams().on_topic_threshold > sims[1]
    assert sims[0] > sims[2]          # the same review, the wrong movie: less similar
    unit = gold.embedder.embed(["a", "b c"])
    assert torch.allclose(unit.norm(dim=-1), torch.ones(2), atol=1e-5)


def test_scores_combine_sentiment_topic_fluency(gold: GoldEvaluator) -> None:
    s = gold.score(["Jaws is a wonderful, thrilling film.", "Jaws is a boring, bad film."],
                   ["Jaws (1975)"] * 2, [2.0, 9.0])
    assert s[0].sentiment > 0 > s[1].sentiment
    assert s[0].fluent and not s[1].fluent and s[0].valid and not s[1].valid
    assert gold_verdict(s[0], s[1]) == "A"


def test_the_same_lists_scored_again_are_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring the same responses, subjects and NLLs again (the candidate's select responses,
    against the champion and against the reference) embeds nothing; other lists are scored."""
    gold = GoldEvaluator(GoldParams())
    texts, subjects = ["Jaws is a wonderful film.", "Dear team, thanks."], ["Jaws (1975)"] * 2
    first = gold.score(texts, subjects, [2.0, 3.0])
    calls: list[int] = []
    real = gold.embedder.embed
    monkeypatch.setattr(gold.embedder, "embed", lambda xs, *a, **k: calls.append(len(xs)) or
                        real(xs, *a, **k))
    assert gold.score(list(texts), list(subjects), [2.0, 3.0]) == first and calls == []
    changed = gold.score(texts, subjects, [2.0, 9.0])        # another NLL: scored
    assert calls and changed[1].fluent != first[1].fluent


def test_best_of_n_kl_is_analytic() -> None:
    assert best_of_n_kl(1) == 0.0
    assert best_of_n_kl(4) == pytest.approx(math.log(4) - 0.75)


def test_kl_uses_only_response_tokens() -> None:
    pi, mask = padded([[-1.0, -1.0], [-0.5]])
    ref, _ = padded([[-2.0, -1.5], [-0.5]])
    assert kl_per_response(pi, ref, mask) == pytest.approx((1.5 + 0.0) / 2)


def test_stored_logprobs_only_when_untempered() -> None:
    assert GenerationParams(temperature=1.0, top_p=1.0).untempered
    assert not GenerationParams(temperature=0.7, top_p=1.0).untempered
    assert not GenerationParams(temperature=1.0, top_p=0.9).untempered


def test_judge_gold_gap_flags_hacking() -> None:
    p = MonitorParams(max_judge_gold_gap=0.15)
    base = {"eval/length_ratio": 1.0}
    calm = hacking_flags({**base, "eval/judge_gold_gap": 0.1}, p)
    gamed = hacking_flags({**base, "eval/judge_gold_gap": 0.3}, p)
    assert calm["eval/flag_judge_gold"] == 0.0 and calm["eval/hacking_flag"] == 0.0
    assert gamed["eval/flag_judge_gold"] == 1.0 and gamed["eval/hacking_flag"] == 1.0
