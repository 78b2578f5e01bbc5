"""`alignloop import` as a user runs it: TRL-format files in, validated pairs into the
workspace's data/import/, then a loop run that trains on them; bad input named file, line and
field with exit 2 and no traceback; imports from outside the workspace refused."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import TINY, copy_workspace, read_json, run_cli, set_params
from flows import cli
from flows import workspace as wsmod
from tasks.core import layout

MOVIES = ["Alien", "Jaws", "Heat", "Up", "Big", "Rocky", "Fargo", "Psycho"]


def hh(movie: str, good: str, bad: str) -> dict[str, str]:
    prompt = f"\n\nHuman: What do you think of {movie}?\n\nAssistant:"
    return {"chosen": f"{prompt} {good}", "rejected": f"{prompt} {bad}"}


def conv(movie: str, good: str, bad: str) -> dict[str, Any]:
    user = {"role": "user", "content": f"Review {movie} in one line.", "name": None}
    return {"chosen": [user, {"role": "assistant", "content": good, "name": None}],
            "rejected": [user, {"role": "assistant", "content": bad, "name": None}]}


def write_jsonl(path: Path, recs: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """One input of each kind: HH JSONL (with a duplicate and a chosen == rejected row),
    implicit conversational JSONL, Parquet, and a DatasetDict with train and test splits."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict
    d = tmp_path_factory.mktemp("inputs")
    rows = [hh(m, f"{m} is a wonderful, gripping film.", f"{m} is awful.") for m in MOVIES[:4]]
    write_jsonl(d / "hh.jsonl", rows + [rows[0], hh("Up", "Same.", "Same.")])
    write_jsonl(d / "conv.jsonl", [conv(m, "Great fun.", "Boring.") for m in MOVIES[4:]])
    pq.write_table(pa.Table.from_pylist(
        [{"prompt": f"Describe {m}.", "chosen": "A lovely, moving story.", "rejected": "Bad."}
         for m in MOVIES[:3]]), d / "pairs.parquet")
    DatasetDict({"train": Dataset.from_list([conv(m, "Superb.", "Weak.") for m in MOVIES[:2]]),
                 "test": Dataset.from_list([conv(m, "Superb.", "Weak.") for m in MOVIES[2:4]])}
                ).save_to_disk(str(d / "dd"))
    return [str(d / "hh.jsonl"), str(d / "conv.jsonl"), str(d / "pairs.parquet"), str(d / "dd")]


N_PAIRS = 4 + 4 + 3 + 4            # rows 4 + 1 duplicate + 1 chosen == rejected, 4, 3, 2 + 2


@pytest.mark.slow      # a whole extra loop through the CLI: minutes
def test_import_then_run_trains_the_policy_on_the_imported_pairs(tiny_run, tmp_path, inputs):
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    out = run_cli("import", *inputs, "--split", "train,test", "--workspace", str(ws)).stdout
    assert (f"imported {N_PAIRS} pairs into {ws.resolve() / layout.IMPORT_PAIRS}: 17 rows, "
            f"{N_PAIRS} prompts, 1 duplicates dropped, 1 with chosen == rejected refused") in out
    assert f"refused (chosen == rejected): {inputs[0]}:6" in out
    stored = [json.loads(x) for x in (ws / layout.IMPORT_PAIRS).read_text().splitlines()]
    assert stored[0]["prompt"] == [{"role": "user", "content": "What do you think of Alien?"}]
    assert stored[0]["chosen"] == "Alien is a wonderful, gripping film."
    set_params(ws / "params.yaml", offpolicy__source="import", iterations={"1": {"prev": 0}})
    run_cli("run", "--workspace", str(ws))
    pool = [json.loads(x) for x in (ws / layout.pairs_pool(0)).read_text().splitlines()]
    assert [(r["prompt"], r["chosen"]) for r in pool] == [(r["prompt"], r["chosen"])
                                                          for r in stored]
    assert {r["source"] for r in pool} == {"import"}
    m = read_json(ws / layout.metrics(1, "update"))
    cold = read_json(tiny_run["ws"] / layout.metrics(1, "update"))
    assert cold["update/n_offpolicy_pairs"] == 0              # a cold start mixes nothing in
    assert m["update/n_offpolicy_pairs"] == min(N_PAIRS, m["update/n_onpolicy_pairs"]) > 0

    def pool_dep(root: Path) -> str | None:
        lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
        return next((d["md5"] for d in lock["update@1"]["deps"]
                     if d["path"] == layout.pairs_pool(0)), None)
    # the update read the imported pool; the cold start's (offpolicy_mix 0) read none, so it
    # does not depend on one (tasks/config/conditions.py)
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    imported = next(o["md5"] for o in lock["collect_offpolicy"]["outs"]
                    if o["path"] == layout.pairs_pool(0))
    assert pool_dep(ws) == imported and pool_dep(tiny_run["ws"]) is None


def test_import_is_a_valid_first_command_and_run_keeps_its_pairs(tmp_path, inputs, capsys):
    ws = tmp_path / "new" / "ws"
    with pytest.raises(SystemExit) as e:
        cli.main(["import", inputs[1], "--workspace", str(ws)])
    assert e.value.code == 0
    assert "next: set offpolicy.source: import" in capsys.readouterr().out
    assert (ws / ".git").is_dir() and (ws / ".dvc").is_dir()
    assert (ws / layout.AUDIT_LABELS).is_file()
    data = (ws / layout.IMPORT_PAIRS).read_bytes()
    assert len(data.splitlines()) == 4
    wsmod.prepare(ws, TINY)                      # what `alignloop run --params` does first
    assert (ws / "dvc.yaml").is_file() and (ws / layout.IMPORT_PAIRS).read_bytes() == data


BAD_ROWS = [
    ({"chosen": "Good.", "rejected": "Bad."}, ":1: missing field 'prompt'"),
    ({"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: c\n\nAssistant: d"},
     ":2: field 'chosen': the two dialogues differ before their first 'Assistant:' turn"),
    (conv("Up", "Fine.", "Bad.") | {"rejected": [{"role": "user", "content": "x",
                                                  "name": "bob"}]},
     ":3: field 'rejected[0].name': unknown message key"),
    ({"prompt": "Review Up.", "chosen": "Fine."}, ":4: missing field 'rejected'"),
    ({"prompt": "Review Up.", "chosen": "", "rejected": "Bad."}, ":5: field 'chosen' is empty"),
    ({"prompt": [{"role": "human", "content": "Hi"}], "chosen": "a", "rejected": "b"},
     ":6: field 'prompt[0].role' must be one of"),
]


def test_each_bad_row_is_one_line_exit_2_no_traceback_nothing_written(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [r for r, _ in BAD_ROWS])
    with bad.open("a") as f:
        f.write("{not json\n")
    proc = run_cli("import", str(bad), "--workspace", str(tmp_path / "ws"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == len(BAD_ROWS) + 2, proc.stderr
    for line, (_, expected) in zip(lines, BAD_ROWS):
        assert line.startswith(f"error: {bad}{expected}"), line
    assert lines[-2].startswith(f"error: {bad}:7: invalid JSON")
    assert lines[-1] == "error: 7 bad rows; nothing imported"
    assert not (tmp_path / "ws").exists()


@pytest.mark.parametrize("argv, message", [
    (["--split", ""], "dd: a DatasetDict with splits train, test; name the ones to import"),
    (["--split", "valid"], "dd: no split 'valid' (splits: train, test)"),
], ids=["no-split", "unknown-split"])
def test_dataset_dict_split_errors_name_the_splits(tmp_path, inputs, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["import", inputs[3], *argv, "--workspace", str(tmp_path / "ws")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.splitlines()) == 1


def test_only_identical_rows_is_an_error(tmp_path, capsys):
    path = write_jsonl(tmp_path / "same.jsonl", [hh("Up", "Same.", "Same."),
                                                 {"prompt": "p", "chosen": "x", "rejected": "x"}])
    with pytest.raises(SystemExit) as e:
        cli.main(["import", str(path), "--workspace", str(tmp_path / "ws")])
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"error: {path}: no preference pairs to import "
                                       "(2 rows with chosen == rejected)\n")


def test_import_path_outside_the_workspace_is_refused_in_one_line(tmp_path):
    params = tmp_path / "p.yaml"
    params.write_text(TINY.read_text().replace("source: cold_start", "source: import")
                      .replace("import_path: data/import/pairs.jsonl",
                               "import_path: ../outside/pairs.jsonl"))
    proc = run_cli("run", "--params", str(params), "--workspace", str(tmp_path / "ws"),
                   check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stdout + proc.stderr
    assert line.count("\n") == 1 and line.startswith(f"error: {params}:")
    assert ("offpolicy.import_path: '../outside/pairs.jsonl' is not inside the workspace's "
            "data/import/; bring the file in with `alignloop import FILE") in line
    assert not (tmp_path / "ws").exists()
