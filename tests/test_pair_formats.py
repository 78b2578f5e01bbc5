"""TRL's preference formats on canned rows: the extracted prompt and completions, exactly; the
reading of every input kind with every bad row reported (tasks/data/pair_formats.py,
tasks/data/pair_import.py, through records.parse_pair)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tasks.core.jsonl import DataError
from tasks.data.pair_formats import IdenticalPair, common_prefix_length, explicit, hh_messages
from tasks.data.pair_import import read_pairs
from tasks.data.records import Message, parse_pair
from tasks.stages.collect_offpolicy import import_pairs, inside_import_dir

HH_PROMPT = ("\n\nHuman: Recommend a film.\n\nAssistant: Alien is good.\n\nHuman: Why?"
             "\n\nAssistant:")
HH = {"chosen": HH_PROMPT + " Alien is tense and well made.",
      "rejected": HH_PROMPT + " Alien is dull."}
CONV_IMPLICIT = {
    "chosen": [{"role": "user", "content": "Review Alien."},
               {"role": "assistant", "content": "Tense and superb."}],
    "rejected": [{"role": "user", "content": "Review Alien."},
                 {"role": "assistant", "content": "Dull."}]}


def pair_error(rec: dict[str, Any]) -> str:
    with pytest.raises(DataError) as e:
        parse_pair(rec, "pairs.jsonl", 4, "import")
    return str(e.value)


# --- prompt extraction, exact values ----------------------------------------------------------

def test_trl_text_implicit_prompt_gives_the_space_to_the_completions() -> None:
    out = explicit({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "w")
    assert (out["prompt"], out["chosen"], out["rejected"]) == ("The sky is", " blue.", " green.")
    assert common_prefix_length("abc", "abd") == 2
    assert common_prefix_length("ab", "abc") == 2          # a prefix of the other: its length


def test_hh_dialogue_becomes_chat_messages_cut_at_the_last_assistant_turn() -> None:
    p = parse_pair(HH, "hh.jsonl", 1, "import")
    # both replies start with "Alien is ": the prompt still ends at "\n\nAssistant:"
    assert p.prompt == (Message("user", "Recommend a film."),
                        Message("assistant", "Alien is good."), Message("user", "Why?"))
    assert (p.chosen, p.rejected) == ("Alien is tense and well made.", "Alien is dull.")


def test_hh_without_leading_newlines_and_one_turn() -> None:
    rec = {"chosen": "Human: Hi there\n\nAssistant: Hello!",
           "rejected": "Human: Hi there\n\nAssistant: Go away."}
    p = parse_pair(rec, "hh.jsonl", 1, "import")
    assert p.prompt == (Message("user", "Hi there"),)
    assert (p.chosen, p.rejected) == ("Hello!", "Go away.")


def test_hh_messages_exact() -> None:
    assert hh_messages("\n\nHuman: a \n\nAssistant: b\n\nHuman: c", "w") == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}]


def test_implicit_conversation_prompt_is_the_shared_messages() -> None:
    p = parse_pair(CONV_IMPLICIT, "c.jsonl", 1, "import")
    assert p.prompt == (Message("user", "Review Alien."),)
    assert (p.chosen, p.rejected) == ("Tense and superb.", "Dull.")


def test_text_prompt_beside_whole_conversations_is_extracted_again_as_trl_does() -> None:
    p = parse_pair({"prompt": "Review Alien.", **CONV_IMPLICIT}, "c.jsonl", 1, "import")
    assert p.prompt == (Message("user", "Review Alien."),) and p.chosen == "Tense and superb."


def test_none_valued_extra_message_keys_are_tolerated() -> None:
    rec = {k: [{**m, "name": None, "tool_calls": None} for m in v]
           for k, v in CONV_IMPLICIT.items()}
    assert parse_pair(rec, "d", 1, "import") == parse_pair(CONV_IMPLICIT, "d", 1, "import")


def test_unknown_non_null_message_key_is_named() -> None:
    rec = {**CONV_IMPLICIT, "rejected": [{"role": "user", "content": "Review Alien.",
                                          "name": "bob"}]}
    assert pair_error(rec) == ("pairs.jsonl:4: field 'rejected[0].name': unknown message key "
                               "(a message holds only role and content; got 'bob')")


@pytest.mark.parametrize("rec, message", [
    ({"chosen": "Good.", "rejected": "Bad."},
     "pairs.jsonl:4: missing field 'prompt' ('chosen' and 'rejected' share no beginning"),
    ({"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: c\n\nAssistant: b"},
     "pairs.jsonl:4: field 'chosen': the two dialogues differ before their first 'Assistant:'"),
    ({"chosen": "\n\nHuman: a\n\nAssistant: b\n\nHuman: more\n\nAssistant: c",
      "rejected": "\n\nHuman: a\n\nAssistant: d"},
     "pairs.jsonl:4: field 'chosen': more than one turn after the shared prompt"),
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
     "pairs.jsonl:4: missing field 'prompt' ('chosen' and 'rejected' share no leading message"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
                 {"role": "user", "content": "more"}, {"role": "assistant", "content": "y"}],
      "rejected": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "z"}]},
     "pairs.jsonl:4: field 'chosen' must hold exactly one assistant message"),
    ({"prompt": "Review Alien.", "rejected": "Dull."}, "pairs.jsonl:4: missing field 'chosen'"),
], ids=["no-shared-text", "hh-differs-in-first-turn", "hh-two-turns-left", "no-shared-message",
        "conversation-two-turns-left", "missing-chosen"])
def test_implicit_prompt_failures_name_file_line_and_field(rec: dict[str, Any],
                                                           message: str) -> None:
    assert pair_error(rec).startswith(message)


def test_identical_sides_of_implicit_pairs_raise_identical_pair() -> None:
    with pytest.raises(IdenticalPair, match="^w: 'chosen' == 'rejected'"):
        explicit({"chosen": HH["chosen"], "rejected": HH["chosen"]}, "w")
    with pytest.raises(IdenticalPair):
        explicit({"chosen": CONV_IMPLICIT["chosen"], "rejected": CONV_IMPLICIT["chosen"]}, "w")


# --- reading every input kind -----------------------------------------------------------------

def write_jsonl(path: Path, recs: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_counts_identical_refused_and_duplicates_dropped(tmp_path: Path) -> None:
    std = {"prompt": "Review Jaws.", "chosen": "Great.", "rejected": "Bad."}
    path = write_jsonl(tmp_path / "p.jsonl", [std, HH, std, {**std, "rejected": "Great."},
                                              {"chosen": "x y", "rejected": "x y"}])
    res = read_pairs(path)
    assert (res.rows, len(res.pairs), res.duplicates, res.prompts) == (5, 2, 1, 2)
    assert res.identical == [f"{path}:4", f"{path}:5"] and res.errors == []


def test_every_bad_row_is_listed_up_to_the_cap_then_counted(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(f'{{"prompt": "p{i}", "chosen": "c"}}\n' for i in range(25))
                    + "{not json\n")
    res = read_pairs(path)
    assert len(res.errors) == 26
    lines = res.error_lines()
    assert lines[0] == f"{path}:1: missing field 'rejected'"
    assert lines[19] == f"{path}:20: missing field 'rejected'"
    assert lines[20:] == ["... and 6 more bad rows"]


def test_json_array_rows_are_named_by_their_line(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text('[\n  {"prompt": "a", "chosen": "b", "rejected": "c"},\n'
                    '  {"prompt": "a",\n   "chosen": 3, "rejected": "c"}\n]\n')
    res = read_pairs(path)
    assert len(res.pairs) == 1
    assert res.errors == [f"{path}:3: field 'chosen' must be a non-empty list of messages"]


def test_parquet_and_json_lines_in_a_json_file(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([HH, {"chosen": "Good.", "rejected": "Bad."}]),
                   tmp_path / "p.parquet")
    res = read_pairs(tmp_path / "p.parquet")
    assert len(res.pairs) == 1
    assert res.errors[0].startswith(f"{tmp_path / 'p.parquet'} (row 2): missing field 'prompt'")
    write_jsonl(tmp_path / "lines.json", [HH])        # what Dataset.to_json writes
    assert read_pairs(tmp_path / "lines.json").pairs == res.pairs


def test_dataset_dict_needs_its_splits_named(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict
    conv = [{k: [{**m, "name": None} for m in v] for k, v in CONV_IMPLICIT.items()}]
    DatasetDict({"train": Dataset.from_list([HH]), "test": Dataset.from_list(conv)}
                ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: a DatasetDict with splits train, test; name the "
                                        r"ones to import with --split"):
        read_pairs(tmp_path / "dd")
    with pytest.raises(DataError, match=r"no split 'valid' \(splits: train, test\)"):
        read_pairs(tmp_path / "dd", "valid")
    assert len(read_pairs(tmp_path / "dd", "train").pairs) == 1
    both = read_pairs(tmp_path / "dd", "train,test")
    assert [p.chosen for p in both.pairs] == ["Alien is tense and well made.", "Tense and superb."]


def test_unknown_input_kind(tmp_path: Path) -> None:
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown input format"):
        read_pairs(tmp_path / "p.csv")


def test_stage_reads_imports_only_from_inside_data_import(tmp_path: Path) -> None:
    root, outside = tmp_path / "ws", tmp_path / "outside.jsonl"
    (root / "data" / "import").mkdir(parents=True)
    write_jsonl(outside, [HH])
    (root / "data" / "import" / "link.jsonl").symlink_to(outside)
    for path in (root / "data" / "import" / "link.jsonl", root / "data" / "import" / ".." / "x"):
        with pytest.raises(DataError, match="bring the file in with `alignloop import FILE"):
            inside_import_dir(path, root)
    write_jsonl(root / "data" / "import" / "pairs.jsonl", [HH])
    assert len(import_pairs(root / "data" / "import" / "pairs.jsonl", root)) == 1


def test_stage_names_the_first_bad_row_in_one_line_with_a_count(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    (root / "data" / "import").mkdir(parents=True)
    path = write_jsonl(root / "data" / "import" / "p.jsonl",
                       [{"prompt": "a", "chosen": "b"}, HH, {"chosen": 1}])
    with pytest.raises(DataError) as e:
        import_pairs(path, root)
    assert str(e.value) == (f"{path}:1: missing field 'rejected' (and 1 more bad rows: "
                            f"`alignloop import {path}` lists them)")
