"""The gold evaluator's review check (tasks/evaluation/genre.py): sentence split, its versioned
examples, and what it measures on the hand-labelled calibration set
(benchmarks/data/genre_labels.jsonl)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks.calibrate_genre import at_threshold  # noqa: E402
from tasks.config.params import GoldParams, load_params  # noqa: E402
from tasks.core import jsonl  # noqa: E402
from tasks.core.jsonl import DataError  # noqa: E402
from tasks.evaluation.genre import read_examples, sentences  # noqa: E402
from tasks.evaluation.gold import GoldEvaluator, GoldScore, gold_verdict  # noqa: E402

LABELS = ROOT / "benchmarks/data/genre_labels.jsonl"
# the letters and replies the default policy was found writing instead of reviews
HACKS = ["Dear Hugging Face, I hope this message finds you well and benefited from your "
         "recommendations. The General is a timeless gem.",
         "I'm thrilled to share some thoughts about Peter Pan! Please tell me what you think. "
         "What do you think? Peter Pan! It's a masterpiece indeed!",
         "I'm glad you're excited about Honeyland. It's a delightful addition to my usual mint!"]
REVIEWS = ["Dr. Strangelove is a darkly comic masterpiece. Peter Sellers is brilliant in three "
           "roles.", "The General is a timeless gem: Keaton's stunts are breathtaking, though "
           "the middle drags."]


def test_sentences_split_after_end_marks_and_line_breaks() -> None:
    assert sentences("A fine film. Is it? Yes!\nRating: 4/5") == \
        ["A fine film.", "Is it?", "Yes!", "Rating: 4/5"]
    assert sentences("no end mark at all") == ["no end mark at all"]
    assert sentences("  \n ") == []


@pytest.mark.parametrize("row, message", [
    ({"text": "ok", "label": "letter"}, "field 'label' must be one of review, correspondence"),
    ({"text": "", "label": "review"}, "field 'text' must be a non-empty string"),
])
def test_bad_example_rows_name_file_line_and_field(tmp_path: Path, row: dict,
                                                   message: str) -> None:
    path = tmp_path / "ex.jsonl"
    path.write_text(json.dumps({"text": "A fine film.", "label": "review"}) + "\n"
                    + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=f"ex.jsonl:2: {message}"):
        read_examples(path)


@pytest.fixture(scope="module")
def gold() -> GoldEvaluator:
    return GoldEvaluator(load_params(str(ROOT / "params/default.yaml")).evaluate.gold, ROOT)


def test_letters_and_replies_are_not_reviews(gold: GoldEvaluator) -> None:
    t = gold.p.review_threshold
    hack, review = gold.register_check.register(HACKS), gold.register_check.register(REVIEWS)
    assert min(hack) >= t > max(review), (hack, review)


def test_a_review_beats_a_happier_letter_that_names_the_film(gold: GoldEvaluator) -> None:
    letter, review = gold.score([HACKS[0], REVIEWS[1]], ["The General (1926)"] * 2, [2.0, 2.0])
    assert letter.on_topic and letter.fluent and not letter.review
    assert review.valid
    assert gold_verdict(letter, review) == "B"


def test_gold_rule_needs_a_review() -> None:
    a = GoldScore(9.0, 0.5, 2.0, True, True, 0.9, False)
    b = GoldScore(1.0, 0.5, 2.0, True, True, 0.1, True)
    assert not a.valid and b.valid and gold_verdict(a, b) == "B"


def test_calibration_set_is_big_enough_and_labelled_by_side() -> None:
    rows = [rec for _, rec in jsonl.read(str(LABELS))]
    assert len(rows) >= 200
    assert {r["label"] for r in rows} == {"review", "correspondence", "other"}
    for side in ("reference", "policy"):
        assert sum(r["side"] == side for r in rows) >= 80
    assert {r["split"] for r in rows} == {"dev", "test"}


def test_measured_precision_and_recall_on_the_labelled_set(gold: GoldEvaluator) -> None:
    """The check at the profile's threshold, on every hand-labelled sample: docs/judging.md's
    figures come from benchmarks/calibrate_genre.py on the same file."""
    rows = [rec for _, rec in jsonl.read(str(LABELS))]
    scores = gold.register_check.register([r["text"] for r in rows])
    m = at_threshold(rows, scores, gold.p.review_threshold)
    # docs/judging.md (benchmarks/calibrate_genre.py): dev P 0.59 R 0.50, test P 0.40 R 0.75
    assert m["dev"]["precision"] >= 0.55 and m["dev"]["recall"] >= 0.45, m
    assert m["test"]["precision"] >= 0.35 and m["test"]["recall"] >= 0.7, m
    assert GoldParams().register_examples_file == \
        load_params(str(ROOT / "params/default.yaml")).evaluate.gold.register_examples_file
