"""The mistake book: `alignloop import --from-workspace OTHER` carries another workspace's pair
pools in as off-policy pairs (re-tagged, deduplicated, its audit applied, tokens kept only for
the same tokenizer), refuses what it cannot check in one line, and lineage follows the pairs
back into OTHER, where `--verify` re-hashes them (and fails, naming OTHER, when it is gone)."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import TINY, copy_workspace, run_cli, set_params
from flows import cli
from flows import workspace as wsmod
from flows.verify import CACHE, object_path, stores
from tasks.core import layout
from tasks.data import pair_book
from tasks.data.records import PreferencePair, Sampled, parse_pair
from test_pair_book import POOLS, TOKENIZER, label, pair

# ---- a small workspace A made by hand: pools in its DVC cache, dvc.lock, labels, params ----

def _store(base: Path, data: bytes, suffix: str = "") -> str:
    md5 = hashlib.md5(data).hexdigest() + suffix       # a directory's manifest: md5.dir
    obj = object_path(base, md5)
    obj.parent.mkdir(parents=True, exist_ok=True)
    obj.write_bytes(data)
    return md5


def _pool_bytes(ps: list[PreferencePair]) -> bytes:
    return "".join(json.dumps(p.to_record(), sort_keys=True) + "\n" for p in ps).encode()


def make_other(root: Path, tokenizer: bytes = TOKENIZER, labels: str = "") -> Path:
    """A workspace whose dvc.lock records prepare_model, collect_offpolicy and judge@1..2 (the
    pools of POOLS), their objects in its cache, audit labels and the tiny profile's params."""
    wsmod.init(root)
    cache = root / CACHE
    tok = _store(cache, tokenizer)
    manifest = json.dumps([{"md5": tok, "relpath": "tokenizer.json"}]).encode()
    stages: dict[str, Any] = {"prepare_model": {"cmd": "python -m tasks.stages.prepare_model",
                                                "outs": [{"path": layout.policy(0),
                                                          "md5": _store(cache, manifest, ".dir"),
                                                          "size": 1, "nfiles": 1}]}}
    for k, ps in POOLS.items():
        data = _pool_bytes(ps)
        name = "collect_offpolicy" if k == 0 else f"judge@{k}"
        deps = [{"path": layout.policy(0), "md5": stages["prepare_model"]["outs"][0]["md5"]}]
        if k:
            prev = "collect_offpolicy" if k == 1 else f"judge@{k - 1}"
            deps.append({"path": layout.pairs_pool(k - 1),
                         "md5": stages[prev]["outs"][0]["md5"]})
        stages[name] = {"cmd": f"python -m tasks.stages.{name.split('@')[0]}", "deps": deps,
                        "outs": [{"path": layout.pairs_pool(k), "md5": _store(cache, data),
                                  "size": len(data)}]}
    (root / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": stages}))
    shutil.copy(TINY, root / layout.PARAMS_FILE)
    (root / layout.AUDIT_LABELS).write_text(labels)
    wsmod.git(root, "add", "-A")
    wsmod.git(root, "commit", "-q", "-m", "a workspace")
    return root


def cache_object(root: Path, path: str) -> Path:
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    md5 = next(o["md5"] for e in lock.values() for o in e.get("outs", []) if o["path"] == path)
    return object_path(root / CACHE, md5)


def import_book(*argv: str) -> tuple[int, str, str]:
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            pytest.raises(SystemExit) as e:
        cli.main(["import", *argv])
    return int(e.value.code), out.getvalue(), err.getvalue()


def stored_pairs(ws: Path) -> list[PreferencePair]:
    path = ws / layout.IMPORT_PAIRS
    return [parse_pair(json.loads(line), str(path), n, "unknown")
            for n, line in enumerate(path.read_text().splitlines(), start=1)]


def test_import_from_workspace_writes_the_book_and_its_manifest(tmp_path):
    swap = label(POOLS[1][4], "swap")
    a = make_other(tmp_path / "A", labels=json.dumps({"pair_id": swap.pair_id, "verdict": "swap",
                                                      "source": "iter_1"}) + "\n")
    head = wsmod.git(a, "rev-parse", "HEAD")
    code, out, err = import_book("--from-workspace", str(a), "--workspace", str(tmp_path / "B"))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (f"imported 6 pairs from {a} at {head[:10]} into "
                        f"{tmp_path / 'B' / layout.IMPORT_PAIRS} (iteration 0: 3, iteration 1: "
                        "2, iteration 2: 1); 8 duplicates dropped, 1 swapped and 0 dropped by "
                        "its audit")
    assert lines[1].startswith("tokens: dropped, the pairs are imported as text (no initial "
                               "model here yet")    # B has no params: nothing says it is tiny
    assert lines[2].startswith("next: set offpolicy.source: import")
    got = stored_pairs(tmp_path / "B")
    assert [p.source for p in got] == ["book"] * 6 and all(not p.sampled for p in got)
    assert [p.meta["book"]["iteration"] for p in got] == [0, 0, 0, 1, 1, 2]
    assert got[4].chosen == "Film 4 is bad." and got[4].meta["audit"] == "swap"
    info = json.loads((tmp_path / "B" / layout.BOOK_MANIFEST).read_text())
    lock = yaml.safe_load((a / "dvc.lock").read_text())["stages"]
    assert info["pools"] == [{"path": layout.pairs_pool(k), "iteration": k, "rows": len(ps),
                              "md5": next(o["md5"] for e in lock.values() for o in e["outs"]
                                          if o["path"] == layout.pairs_pool(k))}
                             for k, ps in POOLS.items()]
    assert {k: info[k] for k in ("workspace", "commit", "n_pairs", "dropped_duplicates",
                                 "tokens_kept")} == {"workspace": str(a), "commit": head,
                                                     "n_pairs": 6, "dropped_duplicates": 8,
                                                     "tokens_kept": False}
    assert info["audit_labels_md5"] == hashlib.md5((a / layout.AUDIT_LABELS).read_bytes()
                                                   ).hexdigest()
    assert info["alignloop_version"]
    # an ordinary import afterwards: its pairs are no book's
    user = tmp_path / "user.jsonl"
    user.write_text(json.dumps({"prompt": "p", "chosen": "good", "rejected": "bad"}) + "\n")
    assert import_book(str(user), "--workspace", str(tmp_path / "B"))[0] == 0
    assert not (tmp_path / "B" / layout.BOOK_MANIFEST).exists()


def test_tokens_are_kept_for_the_same_tokenizer_only(tmp_path):
    """By the initial model's tokenizer files when the workspace has one, by the params'
    model sections when it has none yet."""
    a = make_other(tmp_path / "A")
    b = tmp_path / "B"
    (b / layout.policy(0)).mkdir(parents=True)
    (b / layout.policy(0) / "tokenizer.json").write_bytes(TOKENIZER)
    code, out, _ = import_book("--from-workspace", str(a), "--workspace", str(b))
    assert code == 0 and "tokens: token ids and sampler log-probs kept (the same tokenizer " \
                         "files)" in out
    got = stored_pairs(b)
    assert got[0].tokens(got[0].chosen) == Sampled((5, 0, 2), True, (-0.5, -1.0, -0.25))
    theirs = pair_book.tokenizer_md5_of_dir(b / layout.policy(0))
    assert {p.meta["book"]["tokenizer_md5"] for p in got} == {theirs}
    assert json.loads((b / layout.BOOK_MANIFEST).read_text())["tokens_kept"] is True

    (b / layout.policy(0) / "tokenizer.json").write_bytes(b'{"other": 1}')
    code, out, _ = import_book("--from-workspace", str(a), "--workspace", str(b))
    assert code == 0 and "tokens: dropped, the pairs are imported as text (tokenizer md5 " in out
    assert all(not p.sampled for p in stored_pairs(b))

    c = tmp_path / "C"                                # no model yet: the params decide
    c.mkdir()
    shutil.copy(TINY, c / layout.PARAMS_FILE)
    assert "tokens: token ids and sampler log-probs kept (no initial model here yet; the " \
           "params' model sections name the same one (tiny)" in import_book(
               "--from-workspace", str(a), "--workspace", str(c))[1]
    set_params(c / layout.PARAMS_FILE, model__source="gguf")
    assert "tokens: dropped" in import_book("--from-workspace", str(a), "--workspace",
                                            str(c))[1]


def test_a_pool_from_the_remote_when_the_cache_lacks_it(tmp_path):
    a = make_other(tmp_path / "A")
    obj = cache_object(a, layout.pairs_pool(1))
    remote = next(s.base for s in stores(a) if s.name != "cache")
    moved = object_path(remote, obj.parent.name + obj.name)
    moved.parent.mkdir(parents=True)
    obj.rename(moved)
    code, out, err = import_book("--from-workspace", str(a), "--workspace", str(tmp_path / "B"))
    assert (code, err) == (0, "") and out.startswith("imported 6 pairs")


def test_an_altered_or_missing_pool_is_refused_in_one_line(tmp_path):
    a = make_other(tmp_path / "A")
    obj = cache_object(a, layout.pairs_pool(2))
    md5 = obj.parent.name + obj.name
    obj.write_bytes(obj.read_bytes().replace(b"Film 5", b"Film 6"))
    code, out, err = import_book("--from-workspace", str(a), "--workspace", str(tmp_path / "B"))
    assert (code, out) == (2, "") and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: {obj}: md5 {hashlib.md5(obj.read_bytes()).hexdigest()}, "
                          f"but {a}/dvc.lock@") and f"records {md5} for " \
        f"{layout.pairs_pool(2)}; nothing imported" in err
    obj.unlink()
    code, _, err = import_book("--from-workspace", str(a), "--workspace", str(tmp_path / "B"))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {a / layout.pairs_pool(2)}@") and \
        f"md5 {md5} is in none of its stores" in err
    assert not (tmp_path / "B").exists()


def test_not_a_workspace_and_an_unknown_rev_are_one_line_errors(tmp_path):
    (tmp_path / "plain").mkdir()
    proc = run_cli("import", "--from-workspace", str(tmp_path / "plain"), "--workspace",
                   str(tmp_path / "B"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr == (f"error: {tmp_path / 'plain'}: not an alignloop workspace (no git "
                           "repository with DVC initialised)\n")
    a = make_other(tmp_path / "A")
    code, _, err = import_book("--from-workspace", str(a), "--rev", "iteration-9",
                               "--workspace", str(tmp_path / "B"))
    assert code == 2 and err == (f"error: {a}: unknown revision 'iteration-9' (a commit, tag "
                                 "such as iteration-2, or branch of that workspace)\n")
    code, _, err = import_book(str(tmp_path / "x.jsonl"), "--from-workspace", str(a))
    assert code == 2 and err.count("\n") == 1 and "give files or --from-workspace" in err
    assert not (tmp_path / "B").exists()


def test_the_rev_picks_the_pools_of_that_commit(tmp_path):
    a = make_other(tmp_path / "A")
    first = wsmod.git(a, "rev-parse", "HEAD")
    lock = yaml.safe_load((a / "dvc.lock").read_text())
    del lock["stages"]["judge@2"]
    (a / "dvc.lock").write_text(yaml.safe_dump(lock))
    wsmod.git(a, "commit", "-qam", "iteration 2 undone")
    code, out, _ = import_book("--from-workspace", str(a), "--workspace", str(tmp_path / "B"))
    assert code == 0 and "imported 5 pairs" in out
    code, out, _ = import_book("--from-workspace", str(a), "--rev", first[:12], "--workspace",
                               str(tmp_path / "B"))
    assert code == 0 and f"imported 6 pairs from {a} at {first[:10]}" in out


def test_lineage_crosses_into_the_book_and_verify_names_a_gone_source(tmp_path):
    """The lineage half without a loop run: B's commit holds the book's manifest; its
    collect_offpolicy input data/import gains the book, traced through A's dvc.lock; A's
    objects are re-hashed from A's stores, and a moved A is a problem naming it."""
    from flows import lineage
    from flows.cli_views import _book_problems
    a = make_other(tmp_path / "A")
    b = tmp_path / "B"
    assert import_book("--from-workspace", str(a), "--workspace", str(b))[0] == 0
    lock = {"collect_offpolicy": {"cmd": "x", "deps": [{"path": layout.IMPORT_DIR,
                                                        "md5": "d.dir"}], "outs": []}}
    wsmod.git(b, "add", "-A")
    wsmod.git(b, "commit", "-qm", "import")
    tree = lineage.stage_tree(b, lock, "collect_offpolicy", set(),
                              wsmod.git(b, "rev-parse", "HEAD"))
    book = tree["inputs"][0]["book"]
    a_lock = yaml.safe_load((a / "dvc.lock").read_text())["stages"]
    assert [(p["path"], p["md5"], p["produced_by"]["stage"]) for p in book["pools"]] == [
        (o["path"], o["md5"], s) for s in ("collect_offpolicy", "judge@1", "judge@2")
        for o in a_lock[s]["outs"]]
    assert book["pools"][2]["produced_by"]["inputs"][1]["produced_by"]["stage"] == "judge@1"
    assert lineage.iter_artifacts(tree) == []          # A's outs are verified in A
    assert lineage.iter_books(tree) == [book]
    n, problems = _book_problems(book, skip_remote=True)
    assert (n, problems) == (4, [])       # 3 pools + the initial model, from A's cache
    cache_object(a, layout.pairs_pool(0)).unlink()
    n, problems = _book_problems(book, skip_remote=True)
    assert len(problems) == 1 and problems[0].startswith(
        f"book source {a} (commit {book['commit'][:10]}): data/iter_0/pairs_pool.jsonl")
    a.rename(tmp_path / "A-moved")
    gone = lineage.stage_tree(b, lock, "collect_offpolicy", set(),
                              wsmod.git(b, "rev-parse", "HEAD"))["inputs"][0]["book"]
    assert gone["source_workspace"] == "not found"
    assert _book_problems(gone, skip_remote=True)[1] == [
        f"book source {a} (commit {book['commit'][:10]}): workspace not found; its pools "
        "data/iter_0/pairs_pool.jsonl, data/iter_1/pairs_pool.jsonl, "
        "data/iter_2/pairs_pool.jsonl cannot be re-hashed (name a clone of it with "
        f"--book-source PATH; its dvc remote was {a / '.alignloop' / 'dvc-remote'})"]


def test_a_clone_of_the_source_named_by_book_source_verifies_the_book(tmp_path):
    """A team's audit where A's path is not there (another machine, a moved disk): A's manifest
    says where A was kept; a clone of A (`git clone`, its remote named as the docs say) given
    to `--book-source` is where the lineage and the re-hash are read, and the message says so;
    a clone without the objects is a problem, never an ok."""
    from flows import lineage
    from flows.cli_views import _book_problems
    a = make_other(tmp_path / "A")
    wsmod.git(a, "remote", "add", "origin", "git@example.org:team/A.git")
    b = tmp_path / "B"
    assert import_book("--from-workspace", str(a), "--workspace", str(b))[0] == 0
    info = json.loads((b / layout.BOOK_MANIFEST).read_text())
    assert info["git_remote"] == "git@example.org:team/A.git"
    assert info["dvc_remote"] == str(a / ".alignloop" / "dvc-remote")
    lock = {"collect_offpolicy": {"cmd": "x", "deps": [{"path": layout.IMPORT_DIR,
                                                        "md5": "d.dir"}], "outs": []}}
    wsmod.git(b, "add", "-A")
    wsmod.git(b, "commit", "-qm", "import")
    at = wsmod.git(b, "rev-parse", "HEAD")
    team_remote = tmp_path / "team-remote" / "files" / "md5"
    shutil.copytree(a / CACHE, team_remote)          # what A pushed to the team's remote
    clone = tmp_path / "A-clone"
    subprocess.run(["git", "clone", "-q", str(a), str(clone)], check=True)
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "--local", "-d", "origin",
                    str(tmp_path / "team-remote")], cwd=clone, check=True, capture_output=True)
    shutil.rmtree(a)
    gone = lineage.stage_tree(b, lock, "collect_offpolicy", set(), at)["inputs"][0]["book"]
    assert gone["source_workspace"] == "not found" and "read_from" not in gone
    assert _book_problems(gone, skip_remote=False)[1][0].endswith(
        "cannot be re-hashed (name a clone of it with --book-source PATH; its git remote was "
        f"git@example.org:team/A.git; its dvc remote was {a / '.alignloop' / 'dvc-remote'})")
    wrong = lineage.stage_tree(b, lock, "collect_offpolicy", set(), at,
                               (tmp_path / "B",))["inputs"][0]["book"]      # not A's clone
    assert wrong["source_workspace"] == (f"not found, nor has --book-source {tmp_path / 'B'} "
                                         f"(no git history holding commit {info['commit'][:10]})")
    book = lineage.stage_tree(b, lock, "collect_offpolicy", set(), at,
                              (tmp_path / "elsewhere", clone))["inputs"][0]["book"]
    assert book["read_from"] == str(clone.resolve()) and "source_workspace" not in book
    assert [p["produced_by"]["stage"] for p in book["pools"]] == [
        "collect_offpolicy", "judge@1", "judge@2"]
    assert _book_problems(book, skip_remote=False) == (4, [])   # from the clone's remote
    n, problems = _book_problems(book, skip_remote=True)           # its cache is empty
    assert n == 4 and len(problems) == 4 and problems[0].startswith(
        f"book source {a} (commit {info['commit'][:10]}), read from {clone.resolve()}: ")


def test_the_manifest_records_a_team_remote_this_machine_cannot_read(tmp_path):
    """A source whose default DVC remote is a team's bucket: the pools come from its cache,
    and the manifest names the bucket, where a clone's objects are pulled from."""
    a = make_other(tmp_path / "A")
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "--local", "-d", "-f", "team",
                    "s3://team-bucket/alignloop"], cwd=a, check=True, capture_output=True)
    assert import_book("--from-workspace", str(a), "--workspace", str(tmp_path / "B"))[0] == 0
    info = json.loads((tmp_path / "B" / layout.BOOK_MANIFEST).read_text())
    assert (info["git_remote"], info["dvc_remote"]) == (None, "s3://team-bucket/alignloop")


@pytest.mark.slow      # two loop runs of the tiny profile through the CLI: minutes
def test_a_book_from_a_tiny_run_trains_b_and_lineage_reaches_a(tiny_run, tmp_path):
    a = copy_workspace(tiny_run["ws"], tmp_path / "A")
    b = tmp_path / "B"
    run_cli("init", str(b), "--profile", "tiny")
    out = run_cli("import", "--from-workspace", str(a), "--workspace", str(b)).stdout
    assert "tokens: token ids and sampler log-probs kept" in out
    # B re-aligned as default-book does: iteration 1 offline, on the book alone
    set_params(b / layout.PARAMS_FILE, offpolicy__source="import", rollout__offline=[1])
    data = yaml.safe_load((b / layout.PARAMS_FILE).read_text())
    data["update"]["dpo"].update(offline_pairs=6, offpolicy_weighting="is")
    (b / layout.PARAMS_FILE).write_text(yaml.safe_dump(data, sort_keys=False))
    run_cli("run", "--workspace", str(b))
    pool0 = [json.loads(x) for x in (b / layout.pairs_pool(0)).read_text().splitlines()]
    assert {r["source"] for r in pool0} == {"book"}
    assert all("chosen_ids" in r and "chosen_logprobs" in r for r in pool0)
    metrics = lambda it, st: json.loads((b / layout.metrics(it, st)).read_text())
    assert metrics(1, "rollout")["rollout/offline"] == 1.0 and metrics(1, "rollout")[
        "rollout/n"] == 0.0
    assert (b / layout.pairs(1)).read_text() == ""                   # nothing judged
    assert len((b / layout.pairs_pool(1)).read_text().splitlines()) == len(pool0)
    up = metrics(1, "update")
    assert up["update/offline"] == 1.0 and up["update/n_onpolicy_pairs"] == 0.0
    assert up["update/n_offpolicy_pairs"] == 6.0 and up["update/steps"] > 0
    per_book = {k: v for k, v in up.items()
                if k.startswith("update/offpolicy/book_iter_") and k.endswith("/n")}
    assert per_book and sum(per_book.values()) == 6.0       # weights reported per A iteration
    assert 0 < up["update/offpolicy_ess"] <= 6.0
    assert metrics(2, "update")["update/n_onpolicy_pairs"] > 0      # iteration 2 online
    a_lock = yaml.safe_load((a / "dvc.lock").read_text())["stages"]
    a_pools = sorted((o["path"], o["md5"]) for e in a_lock.values() for o in e.get("outs", [])
                     if layout.pool_iteration(o["path"]) is not None)
    tree = json.loads(run_cli("lineage", "models:/alignloop-policy@champion", "--workspace",
                              str(b), "--json").stdout)
    (book,) = [x for x in _books(tree) if x["workspace"] == str(a)]
    assert sorted((p["path"], p["md5"]) for p in book["pools"]) == a_pools
    assert all(isinstance(p["produced_by"], dict) for p in book["pools"])
    text = run_cli("lineage", "models:/alignloop-policy@champion", "--workspace", str(b)).stdout
    assert f"<- book of {a} at commit " in text
    ok = run_cli("lineage", "models:/alignloop-policy@champion", "--workspace", str(b),
                 "--verify")
    assert "verify: ok" in ok.stdout and f"of the book's source {a} re-hashed" in ok.stdout
    a.rename(tmp_path / "A-moved")
    bad = run_cli("lineage", "models:/alignloop-policy@champion", "--workspace", str(b),
                  "--verify", check=False)
    assert bad.returncode == 1 and "verify: ok" not in bad.stdout
    assert f"verify: FAILED book source {a} " in bad.stderr and "workspace not found" in bad.stderr
    subprocess.run(["git", "status"], cwd=b, check=True, capture_output=True)
    # a clone of B (its registry record in git, B's remote named) audits the book from the
    # moved A named as the book's source
    b2 = tmp_path / "B-clone"
    subprocess.run(["git", "clone", "-q", str(b), str(b2)], check=True)
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "--local", "-d", "origin",
                    str(b / ".alignloop" / "dvc-remote")], cwd=b2, check=True)
    again = run_cli("lineage", "models:/alignloop-policy@champion", "--workspace", str(b2),
                    "--verify", "--book-source", str(tmp_path / "A-moved"))
    assert "verify: ok" in again.stdout and (f"of the book's source {a} re-hashed from its "
                                             f"stores (its clone {tmp_path / 'A-moved'})"
                                             ) in again.stdout


def _books(tree: Any) -> list[dict]:
    from flows.lineage import iter_books
    return iter_books(tree)


def test_a_pool_file_imported_by_hand_never_passes_for_this_workspaces_iterations(tmp_path):
    """A plain `alignloop import` of a copied pool file: its rows name the other workspace's
    iterations (source iter_3, meta.iteration 3), which this one would take for its own
    on-policy pairs (the reward model's window, staleness); they become imports, the file's
    values kept under other names. A bad row is one line naming file, line and field."""
    rec = pair(1, "iter_3", 3, tokens=False).to_record()
    path, ws = tmp_path / "pool.jsonl", tmp_path / "W"
    path.write_text(json.dumps(rec) + "\n")
    code, out, _ = import_book(str(path), "--workspace", str(ws))
    assert code == 0 and "imported 1 pairs" in out
    (stored,) = stored_pairs(ws)
    assert stored.source == "import" and "iteration" not in stored.meta
    assert stored.meta["file_iteration"] == 3 and stored.meta["file_source"] == "iter_3"
    assert stored.meta["prompt_id"] == "1"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rec, "meta": "not an object"}) + "\n")
    code, _, err = import_book(str(bad), "--workspace", str(ws))
    assert code == 2 and f"error: {bad}:1: field 'meta' must be an object" in err
    assert stored_pairs(ws) == [stored]                          # nothing written
