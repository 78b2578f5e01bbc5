"""The mistake book's pure part (tasks/data/pair_book.py): another workspace's pools as one
union, its audit applied, each pair re-tagged as an iteration-0 off-policy pair naming its
origin, tokens kept only under the same tokenizer; and how the stages read such pairs (the
import reader, collect_offpolicy's tokenizer check, the reward model's window)."""
from __future__ import annotations

import hashlib
import json

import pytest

from tasks.core import layout
from tasks.data import audit, pair_book
from tasks.data.pair_import import read_pairs
from tasks.data.records import Message, PreferencePair, Sampled

TOKENIZER = b'{"model": {"vocab": {"a": 0, "b": 1}}}'


def pair(n: int, source: str, it: int, tokens: bool = True) -> PreferencePair:
    prompt = (Message("user", f"Review film {n}."),)
    chosen, rejected = f"Film {n} is wonderful.", f"Film {n} is bad."
    sampled = {chosen: Sampled((5, n, 2), True, (-0.5, -1.0, -0.25)),
               rejected: Sampled((7, n), False, (-2.0, -0.125))} if tokens else {}
    return PreferencePair(prompt, chosen, rejected, source,
                          {"iteration": it, "policy": f"md5-of-{it}", "prompt_id": str(n),
                           "judge": "lexicon:vader-v1"}, sampled)


# iteration 0's pool: 0-2 (cold start); 1's: 0-2 + 3-4; 2's (refused by the gate): 0-4 + 5
POOLS = {0: [pair(n, "cold_start", 0) for n in range(3)]}
POOLS[1] = POOLS[0] + [pair(n, "iter_1", 1) for n in (3, 4)]
POOLS[2] = POOLS[1] + [pair(5, "iter_2", 2)]
ORIGIN = {"workspace": "/w/A", "commit": "c" * 40}


def pools() -> list[pair_book.Pool]:
    return [pair_book.Pool(layout.pairs_pool(k), k, f"md5-{k}", ps) for k, ps in POOLS.items()]


def label(p: PreferencePair, verdict: str) -> audit.AuditLabel:
    return audit.AuditLabel(audit.pair_id(p), verdict, source=p.source)


def test_retag_makes_an_iteration_0_book_pair_that_names_its_origin():
    src = pair(3, "iter_1", 1)
    pool = pools()[1]
    out = pair_book.retag(src, pool, ORIGIN, keep_tokens=True, tokenizer="tok")
    assert out.source == "book" and (out.prompt, out.chosen, out.rejected) == (
        src.prompt, src.chosen, src.rejected)
    assert out.meta == {"prompt_id": "3", "judge": "lexicon:vader-v1", "iteration": 0,
                        "book": {"workspace": "/w/A", "commit": "c" * 40,
                                 "path": "data/iter_1/pairs_pool.jsonl", "iteration": 1,
                                 "source": "iter_1", "policy": "md5-of-1",
                                 "tokenizer_md5": "tok"}}
    assert out.sampled == src.sampled
    assert pair_book.retag(src, pool, ORIGIN, keep_tokens=False, tokenizer="tok").sampled == {}
    # what the rest of the pipeline reads of it: off-policy, iteration 0
    assert audit.source_iteration(out.source) == 0 and not out.source.startswith("iter_")
    from tasks.policy.pair_reuse import origin_of
    assert origin_of(out, "x") == 0


def test_union_keeps_each_pair_once_from_the_earliest_pool():
    held, duplicates = pair_book.union(list(reversed(pools())))
    assert duplicates == 3 + 5                  # pool 1 repeats 3 of pool 0's, pool 2 all 5
    assert [(p.chosen, pool.iteration) for p, pool in held] == [
        ("Film 0 is wonderful.", 0), ("Film 1 is wonderful.", 0), ("Film 2 is wonderful.", 0),
        ("Film 3 is wonderful.", 1), ("Film 4 is wonderful.", 1), ("Film 5 is wonderful.", 2)]


def test_gather_applies_the_audit_swaps_and_drops():
    labels = {label(POOLS[0][1], "swap").pair_id: label(POOLS[0][1], "swap"),
              label(POOLS[1][3], "drop").pair_id: label(POOLS[1][3], "drop"),
              label(POOLS[2][5], "chosen_ok").pair_id: label(POOLS[2][5], "chosen_ok")}
    book = pair_book.gather(pools(), labels, ORIGIN, keep_tokens=True, tokenizer="tok")
    assert (book.duplicates, book.swapped, book.dropped) == (8, 1, 1)
    assert book.per_iteration == {0: 3, 1: 1, 2: 1}
    swapped = book.pairs[1]
    assert (swapped.chosen, swapped.rejected) == ("Film 1 is bad.", "Film 1 is wonderful.")
    assert swapped.meta["audit"] == "swap" and swapped.meta["book"]["iteration"] == 0
    assert swapped.tokens("Film 1 is bad.").ids == (7, 1)     # each text keeps its tokens
    assert "Film 3 is wonderful." not in [p.chosen for p in book.pairs]
    assert all(pair_book.INDEX not in p.meta for p in book.pairs)


def test_gather_refuses_a_label_that_names_no_pair_of_a_held_source():
    bad = audit.AuditLabel("0" * 32, "drop", source="iter_1", where="A/audit/labels.jsonl:4")
    with pytest.raises(audit.DataError, match=r"^A/audit/labels.jsonl:4: pair_id 0{32} "):
        pair_book.gather(pools(), {bad.pair_id: bad}, ORIGIN, True, None)


def test_tokenizer_md5_names_the_vocabulary_files_only(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(TOKENIZER)
    (tmp_path / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    md5 = hashlib.md5(TOKENIZER).hexdigest()
    expected = hashlib.md5(f"tokenizer.json {md5}\n".encode()).hexdigest()
    assert pair_book.tokenizer_md5_of_dir(tmp_path) == expected
    assert pair_book.tokenizer_md5({"tokenizer.json": md5, "config.json": "x"}) == expected
    assert pair_book.tokenizer_md5({"tokenizer_config.json": "x"}) is None
    assert pair_book.tokenizer_md5_of_dir(tmp_path / "none") is None


def test_read_pairs_keeps_tokens_only_for_a_book_row_of_this_tokenizer(tmp_path):
    book = pair_book.retag(pair(1, "iter_1", 1), pools()[1], ORIGIN, True, "tok")
    user = pair(2, "import", 0)                       # someone else's ids: never kept
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p.to_record()) + "\n" for p in (book, user)))
    same = read_pairs(path, tokenizer="tok").pairs
    assert same[0].sampled == book.sampled and same[0].source == "book"
    assert same[1].sampled == {} and same[1].source == "import"
    assert [p.sampled for p in read_pairs(path, tokenizer="other").pairs] == [{}, {}]
    assert [p.sampled for p in read_pairs(path).pairs] == [{}, {}]


def test_collect_offpolicy_checks_the_book_rows_tokenizer_against_its_own_model(tmp_path):
    from tasks.stages.collect_offpolicy import import_pairs
    (tmp_path / layout.policy(0)).mkdir(parents=True)
    (tmp_path / layout.policy(0) / "tokenizer.json").write_bytes(TOKENIZER)
    ours = pair_book.tokenizer_md5_of_dir(tmp_path / layout.policy(0))
    rows = [pair_book.retag(pair(n, "iter_1", 1), pools()[1], ORIGIN, True, tok)
            for n, tok in ((1, ours), (2, "another tokenizer"))]
    path = tmp_path / layout.IMPORT_PAIRS
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(p.to_record()) + "\n" for p in rows))
    got = import_pairs(path, tmp_path)
    assert [bool(p.sampled) for p in got] == [True, False]
    assert got[0].tokens(got[0].rejected) == Sampled((7, 1), False, (-2.0, -0.125))


def test_the_reward_models_window_keeps_book_pairs_as_off_policy():
    from tasks.stages.train_rm import window
    book = pair_book.retag(pair(9, "iter_3", 3), pools()[0], ORIGIN, False, None)
    pool = [book, pair(1, "iter_1", 1), pair(2, "iter_2", 2)]
    kept, m = window(pool, {}, 1)
    assert [x.source for x in kept] == ["book", "iter_2"] and m["rm/window_oldest"] == 2


def test_only_a_pool_path_as_a_stage_writes_it_names_an_iteration() -> None:
    assert layout.pool_iteration(layout.pairs_pool(0)) == 0
    assert layout.pool_iteration(layout.pairs_pool(12)) == 12
    for other in ("data/iter_01/pairs_pool.jsonl", "data/iter_x/pairs_pool.jsonl",
                  layout.pairs(3), "w/" + layout.pairs_pool(3), layout.pairs_pool(3) + ".tmp"):
        assert layout.pool_iteration(other) is None, other
