"""Preference pairs carry the tokens their responses were sampled as (records round trip, strict
parsing, an audit swap keeps each text with its own tokens); text-only pairs stay as they were."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tasks.core.jsonl import DataError
from tasks.data.records import Message, PreferencePair, Sampled, parse_pair

PROMPT = (Message("user", "Review Jaws."),)
TOKENS = {"Great fun": Sampled((5, 6, 2), True), "Dull and": Sampled((7, 8, 9), False)}


def _pair() -> PreferencePair:
    return PreferencePair(PROMPT, "Great fun", "Dull and", "iter_1", {"prompt_id": "p1"}, TOKENS)


def test_sampled_pair_round_trips() -> None:
    rec = _pair().to_record()
    assert (rec["chosen_ids"], rec["rejected_ids"]) == ([5, 6, 2], [7, 8, 9])
    assert (rec["chosen_finished"], rec["rejected_finished"]) == (True, False)
    back = parse_pair(rec, "pairs.jsonl", 1, "?")
    assert back == _pair() and back.tokens("Dull and") == Sampled((7, 8, 9), False)


def test_text_only_pair_record_is_unchanged() -> None:
    pair = PreferencePair(PROMPT, "Great fun", "Dull and", "import")
    rec = pair.to_record()
    assert list(rec) == ["prompt", "chosen", "rejected", "source", "meta"]
    assert parse_pair(rec, "p", 1, "?").sampled == {}


def test_swap_by_replace_keeps_every_text_with_its_tokens() -> None:
    swapped = replace(_pair(), chosen="Dull and", rejected="Great fun")   # as tasks/data/audit.py
    rec = swapped.to_record()
    assert (rec["chosen_ids"], rec["chosen_finished"]) == ([7, 8, 9], False)
    assert (rec["rejected_ids"], rec["rejected_finished"]) == ([5, 6, 2], True)


@pytest.mark.parametrize("edit, message", [
    ({"rejected_finished": None}, "field 'rejected_finished' must be true or false"),
    ({"chosen_ids": []}, "field 'chosen_ids' must be a non-empty list of token ids"),
    ({"chosen_ids": [1, "2"]}, "field 'chosen_ids' must be a non-empty list of token ids"),
    ({"rejected_ids": [1, -3]}, "field 'rejected_ids' must be a non-empty list of token ids"),
    ({"chosen_finished": 1}, "field 'chosen_finished' must be true or false"),
])
def test_malformed_sampled_tokens_are_named(edit: dict, message: str) -> None:
    rec = {**_pair().to_record(), **edit}
    with pytest.raises(DataError) as e:
        parse_pair(rec, "pairs.jsonl", 4, "?")
    assert str(e.value) == f"pairs.jsonl:4: {message}"


def test_sampled_tokens_come_all_four_or_none() -> None:
    rec = _pair().to_record()
    del rec["rejected_ids"]
    with pytest.raises(DataError, match=r"^pairs.jsonl:2: field 'rejected_ids' missing"):
        parse_pair(rec, "pairs.jsonl", 2, "?")
