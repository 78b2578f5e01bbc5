"""Strict reading of stored records: JSONL errors name file and line, pairs name the field;
atomic writes never leave a half-written artifact or lose the old one."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tasks.core import atomic, jsonl
from tasks.core.jsonl import DataError
from tasks.data.records import Message, PreferencePair, Rollout, parse_pair, parse_rollout
from tasks.schemas.generation import GenerationParams
from tasks.stages.collect_offpolicy import import_pairs

STANDARD = {"prompt": "Review Alien.", "chosen": "A superb, tense classic.",
            "rejected": "Dull."}
CONVERSATIONAL = {
    "prompt": [{"role": "user", "content": "Review Alien."}],
    "chosen": [{"role": "assistant", "content": "A superb, tense classic."}],
    "rejected": [{"role": "assistant", "content": "Dull."}],
}


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def read_error(path: Path) -> str:
    with pytest.raises(DataError) as e:
        list(jsonl.read(path))
    return str(e.value)


# --- jsonl.read -------------------------------------------------------------------------------

def test_read_yields_line_numbers_and_skips_blank_lines(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "ok.jsonl", [b'{"a": 1}', b"", b'{"a": "\xc3\xa9"}'])
    assert list(jsonl.read(path)) == [(1, {"a": 1}), (3, {"a": "\u00e9"})]


def test_read_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [b'{"a": 1}', b'{"a": 2}', b'{"a": 3,', b'{}'])
    msg = read_error(path)
    assert msg.startswith(f"{path}:3: invalid JSON"), msg


def test_read_non_utf8_names_file_and_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "latin1.jsonl", [b'{"a": 1}', b'{"a": "caf\xe9"}'])
    msg = read_error(path)
    assert msg.startswith(f"{path}:2: not valid UTF-8"), msg


def test_read_array_instead_of_object(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "arr.jsonl", [b'{"a": 1}', b'[1, 2]'])
    msg = read_error(path)
    assert msg.startswith(f"{path}:2: expected a JSON object, got list"), msg


def test_read_missing_file(tmp_path: Path) -> None:
    assert read_error(tmp_path / "none.jsonl").startswith(f"{tmp_path / 'none.jsonl'}: ")


def test_write_then_read_roundtrip(tmp_path: Path) -> None:
    recs = [{"b": 1, "a": "\u00e9\n"}, {"x": [1, 2]}]
    assert jsonl.write(tmp_path / "out" / "r.jsonl", recs) == 2
    assert [r for _, r in jsonl.read(tmp_path / "out" / "r.jsonl")] == recs


# --- parse_pair -------------------------------------------------------------------------------

def pair_error(rec: dict[str, Any]) -> str:
    with pytest.raises(DataError) as e:
        parse_pair(rec, "pairs.jsonl", 7, "import")
    return str(e.value)


def test_standard_and_conversational_pairs_normalise_equal() -> None:
    a = parse_pair(STANDARD, "s.jsonl", 1, "import")
    b = parse_pair(CONVERSATIONAL, "c.jsonl", 1, "import")
    assert a == b
    assert a.prompt == (Message("user", "Review Alien."),)
    assert (a.chosen, a.rejected, a.source) == ("A superb, tense classic.", "Dull.", "import")


def test_pair_keeps_multi_message_prompt_and_source() -> None:
    rec = {**CONVERSATIONAL, "source": "cold_start", "meta": {"k": 1},
           "prompt": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Review Alien."}]}
    p = parse_pair(rec, "c.jsonl", 1, "import")
    assert [m.role for m in p.prompt] == ["system", "user"]
    assert p.source == "cold_start" and p.meta == {"k": 1}
    assert parse_pair(p.to_record(), "x", 1, "other") == p      # round trip


def test_pair_missing_chosen() -> None:
    rec = {k: v for k, v in STANDARD.items() if k != "chosen"}
    assert pair_error(rec) == "pairs.jsonl:7: missing field 'chosen'"


def test_pair_empty_rejected() -> None:
    assert pair_error({**STANDARD, "rejected": "  "}) == "pairs.jsonl:7: field 'rejected' is empty"


def test_pair_wrong_type() -> None:
    msg = pair_error({**STANDARD, "chosen": 3})
    assert msg.startswith("pairs.jsonl:7: field 'chosen' must be"), msg


def test_pair_bad_role() -> None:
    rec = {**CONVERSATIONAL, "prompt": [{"role": "human", "content": "Review Alien."}]}
    msg = pair_error(rec)
    assert msg.startswith("pairs.jsonl:7: field 'prompt[0].role' must be one of"), msg
    assert "'human'" in msg


def test_pair_chosen_with_two_messages() -> None:
    rec = {**CONVERSATIONAL, "chosen": [{"role": "assistant", "content": "Good."},
                                        {"role": "assistant", "content": "Really."}]}
    msg = pair_error(rec)
    assert msg.startswith("pairs.jsonl:7: field 'chosen' must hold exactly one assistant"), msg


def test_pair_chosen_message_from_user() -> None:
    rec = {**CONVERSATIONAL, "rejected": [{"role": "user", "content": "Dull."}]}
    assert pair_error(rec).startswith("pairs.jsonl:7: field 'rejected' must hold exactly one")


def test_pair_message_with_empty_content() -> None:
    rec = {**CONVERSATIONAL, "prompt": [{"role": "user", "content": ""}]}
    assert pair_error(rec).startswith("pairs.jsonl:7: field 'prompt[0].content'")


# --- parse_rollout ----------------------------------------------------------------------------

def test_rollout_roundtrip_and_logprob_count_check() -> None:
    r = Rollout("p1", (Message("user", "hi"),), (5, 6), (7, 3), (-1.5, -0.2), True, "x",
                "md5", 1, GenerationParams(temperature=1.0))
    assert parse_rollout(r.to_record(), "r.jsonl", 1) == r
    bad = {**r.to_record(), "logprobs": [-1.5]}
    with pytest.raises(DataError, match=r"^r.jsonl:4: field 'logprobs' has 1 entries for 2"):
        parse_rollout(bad, "r.jsonl", 4)
    missing = {k: v for k, v in r.to_record().items() if k != "policy"}
    with pytest.raises(DataError, match=r"^r.jsonl:5: missing field 'policy'"):
        parse_rollout(missing, "r.jsonl", 5)


def test_rollout_sampling_settings_read_back_typed_and_whole() -> None:
    """The settings a rollout was drawn with come back as GenerationParams, each field checked:
    none read back with a silent default (PPO scores at the stored temperature)."""
    gen = GenerationParams(max_new_tokens=40, temperature=0.7, top_p=0.9, batch_size=8)
    r = Rollout("p1", (Message("user", "hi"),), (5,), (7,), (-1.5,), True, "x", "md5", 1, gen)
    rec = json.loads(json.dumps(r.to_record()))            # as the JSONL file holds it
    assert rec["sampling"] == {"max_new_tokens": 40, "temperature": 0.7, "top_p": 0.9,
                               "batch_size": 8}
    assert parse_rollout(rec, "r.jsonl", 1).sampling == gen
    assert parse_rollout({**rec, "sampling": {**rec["sampling"], "temperature": 1}},
                         "r.jsonl", 1).sampling.temperature == 1.0
    cases = {"missing field 'sampling.temperature'":
             {k: v for k, v in rec["sampling"].items() if k != "temperature"},
             "field 'sampling.temperature' must be a number, got 'hot'":
             {**rec["sampling"], "temperature": "hot"},
             "field 'sampling.batch_size' must be an integer, got 8.5":
             {**rec["sampling"], "batch_size": 8.5},
             "field 'sampling.seed' is not a sampling setting": {**rec["sampling"], "seed": 1},
             "field 'sampling' must be a mapping": [0.7]}
    for msg, sampling in cases.items():
        with pytest.raises(DataError, match=r"^r\.jsonl:3: " + re.escape(msg)):
            parse_rollout({**rec, "sampling": sampling}, "r.jsonl", 3)
    with pytest.raises(DataError, match=r"^r\.jsonl:3: missing field 'sampling'$"):
        parse_rollout({k: v for k, v in rec.items() if k != "sampling"}, "r.jsonl", 3)


def test_ppo_refuses_a_batch_sampled_at_two_temperatures() -> None:
    from tasks.core.errors import InputError
    from tasks.policy.ppo import sampled_temperature
    one = Rollout("p1", (Message("user", "hi"),), (5,), (7,), (-1.5,), True, "x", "md5", 1,
                  GenerationParams(temperature=0.7))
    assert sampled_temperature([one, one]) == 0.7
    other = Rollout("p1", (Message("user", "hi"),), (5,), (7,), (-1.5,), True, "x", "md5", 0,
                    GenerationParams(temperature=1.0))
    with pytest.raises(InputError, match=r"different temperatures \[0\.7, 1\.0\]"):
        sampled_temperature([one, other])


# --- import_pairs -----------------------------------------------------------------------------

def test_import_pairs_jsonl_and_hf_datasets_dir_agree(tmp_path: Path) -> None:
    from datasets import Dataset

    second = {"prompt": "Review Heat.", "chosen": "Brilliant.", "rejected": "Too long."}
    jsonl.write(tmp_path / "pairs.jsonl", [STANDARD, second])
    conv2 = {"prompt": [{"role": "user", "content": second["prompt"]}],
             "chosen": [{"role": "assistant", "content": second["chosen"]}],
             "rejected": [{"role": "assistant", "content": second["rejected"]}]}
    Dataset.from_list([CONVERSATIONAL, conv2]).save_to_disk(str(tmp_path / "pairs_ds"))
    from_jsonl = import_pairs(tmp_path / "pairs.jsonl")
    from_dir = import_pairs(tmp_path / "pairs_ds")
    assert len(from_jsonl) == 2
    assert from_jsonl == from_dir
    assert all(isinstance(p, PreferencePair) and p.source == "import" for p in from_dir)


def test_import_pairs_malformed_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(STANDARD) + "\n" + json.dumps({"prompt": "x", "chosen": "y"})
                    + "\n")
    with pytest.raises(DataError, match="^" + re.escape(f"{path}:2: missing field 'rejected'")):
        import_pairs(path)


def test_import_pairs_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match="no preference pairs"):
        import_pairs(path)


def test_import_pairs_not_a_dataset_dir(tmp_path: Path) -> None:
    (tmp_path / "junk").mkdir()
    with pytest.raises(DataError, match="not a saved HF datasets directory"):
        import_pairs(tmp_path / "junk")


# --- atomic writes ----------------------------------------------------------------------------

def test_directory_failure_leaves_existing_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "models" / "policy"
    target.mkdir(parents=True)
    (target / "weights.bin").write_bytes(b"old weights")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic.directory(target) as tmp:
            (tmp / "weights.bin").write_bytes(b"half-written")
            raise RuntimeError("boom")
    assert (target / "weights.bin").read_bytes() == b"old weights"
    assert sorted(p.name for p in target.iterdir()) == ["weights.bin"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["policy"]   # no temp dir left


def test_directory_success_replaces_target(tmp_path: Path) -> None:
    target = tmp_path / "policy"
    target.mkdir()
    (target / "stale.bin").write_bytes(b"old")
    with atomic.directory(target) as tmp:
        assert tmp != target and not (tmp / "stale.bin").exists()
        (tmp / "weights.bin").write_bytes(b"new")
    assert sorted(p.name for p in target.iterdir()) == ["weights.bin"]
    assert (target / "weights.bin").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]


def test_directory_creates_new_target(tmp_path: Path) -> None:
    with atomic.directory(tmp_path / "a" / "b") as tmp:
        (tmp / "f").write_text("x")
    assert (tmp_path / "a" / "b" / "f").read_text() == "x"


def test_write_text_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "out.json"
    atomic.write_text(path, "first\n")
    atomic.write_text(path, "second\n")
    atomic.write_json(tmp_path / "sub" / "m.json", {"b": 1.0, "a": 2})
    assert path.read_text() == "second\n"
    assert json.loads((tmp_path / "sub" / "m.json").read_text()) == {"a": 2, "b": 1.0}
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["m.json", "out.json"]


def test_write_text_failure_keeps_old_file_and_no_temp(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "out.txt"
    atomic.write_text(path, "old\n")

    def fail(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(atomic.os, "replace", fail)
    with pytest.raises(OSError, match="disk gone"):
        atomic.write_text(path, "new\n")
    monkeypatch.undo()
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


# --- audit labels whose pair_id matches nothing -----------------------------------------------

def test_audit_label_with_an_unknown_pair_id_is_an_error_naming_file_and_line(
        tmp_path: Path) -> None:
    from tasks.data import audit
    pool = [PreferencePair((Message("user", f"Review movie {i}."),), f"great {i}", f"bad {i}",
                           src) for i, src in enumerate(["import", "iter_1", "iter_2"])]
    known = audit.pair_id(pool[1])
    path = tmp_path / "labels.jsonl"
    path.write_text(json.dumps({"pair_id": known, "verdict": "swap", "source": "iter_1"}) + "\n"
                    + json.dumps({"pair_id": "0" * 32, "verdict": "drop", "source": "iter_2"})
                    + "\n")
    with pytest.raises(DataError, match="^" + re.escape(
            f"{path}:2: pair_id {'0' * 32} matches no pair of the pool, which holds every "
            "iter_2 pair")):
        audit.apply_audit(pool, audit.parse_labels(path))
    # without a source nothing tells a pair still to come from a mistyped id: refused too
    path.write_text(json.dumps({"pair_id": known, "verdict": "swap", "source": "iter_1"}) + "\n"
                    + json.dumps({"pair_id": "2" * 32, "verdict": "drop"}) + "\n")
    with pytest.raises(DataError, match="^" + re.escape(
            f"{path}:2: pair_id {'2' * 32} matches no pair of the pool, and the label has no "
            "'source'")):
        audit.apply_audit(pool, audit.parse_labels(path))
    # a source the pool does not hold: a later iteration's pair (or a refused branch's)
    path.write_text(json.dumps({"pair_id": "1" * 32, "verdict": "drop", "source": "iter_3"})
                    + "\n" + json.dumps({"pair_id": known, "verdict": "swap"}) + "\n")
    out, m = audit.apply_audit(pool, audit.parse_labels(path))
    assert m["rm/audit_n"] == 1 and m["rm/audit_n_unmatched"] == 1
    assert out[1].chosen == "bad 1"
