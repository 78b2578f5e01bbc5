"""`alignloop import --from-workspace OTHER [--rev REV]`: another workspace's pair pools (its
"mistake book") as this workspace's imported pairs, with a manifest that lineage follows back.

What is read from OTHER, all at one commit (REV, default HEAD): dvc.lock, for every pair pool
(`data/iter_<k>/pairs_pool.jsonl`, every iteration's, those the gate refused included: their
pairs are mistakes worth keeping) and its md5; each pool's bytes from OTHER's DVC cache, or its
default remote when the cache lacks them, checked against that md5; `audit/labels.jsonl`; and
the tokenizer files of OTHER's initial model (`models/iter_0/policy`, through its DVC manifest).
The pairs themselves are made in tasks/data/pair_book.py.

The tokenizer rule: token ids and sampler log-probs are kept when OTHER's initial model has the
tokenizer of this workspace's (the same `pair_book.tokenizer_md5`, this workspace's read from
its `models/iter_0/policy`, on disk or in its DVC cache). A workspace with no initial model yet
decides by the params: the same `model.source` (and, for `gguf`, the same package and file;
for `hf_dir`, the same directory). `collect_offpolicy` checks each row's recorded tokenizer
against the workspace's own initial model again at stage time, so a wrong guess costs the ids,
never their meaning.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flows import shipped
from flows.verify import CACHE, Store, stored, stores
from flows.workspace import git, git_bytes
from tasks.core import atomic, jsonl, layout
from tasks.core.errors import InputError
from tasks.data import audit, pair_book
from tasks.data.records import parse_pair

PREPARE_MODEL = "prepare_model"      # the stage whose out is the initial model


@dataclass(frozen=True)
class Source:
    """The other workspace at one commit, and its dvc.lock's stages there."""
    root: Path
    commit: str
    lock: dict[str, Any]

    def name(self, path: str) -> str:
        """How messages name a file of it: `OTHER/PATH@COMMIT10`."""
        return f"{self.root / path}@{self.commit[:10]}"


def open_source(other: str | Path, rev: str) -> Source:
    """OTHER resolved, REV resolved to a full commit, dvc.lock read there; one-line errors."""
    root = Path(other).expanduser().resolve()
    if not ((root / ".git").exists() and (root / ".dvc").is_dir()):
        raise InputError(f"{root}: not an alignloop workspace (no git repository with DVC "
                         "initialised)")
    try:
        commit = git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except RuntimeError:
        commit = ""
    if not commit:
        raise InputError(f"{root}: unknown revision {rev!r} (a commit, tag such as "
                         "iteration-2, or branch of that workspace)")
    text = git_bytes(root, "show", f"{commit}:dvc.lock")
    if text is None:
        raise InputError(f"{root}: no dvc.lock at {rev} ({commit[:10]}): nothing has run there")
    return Source(root, commit, (yaml.safe_load(text) or {}).get("stages", {}))


def pool_outs(lock: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(path, iteration, md5) of every pair pool the lock records, by iteration."""
    found = {o["path"]: (o["path"], k, o.get("md5", "")) for e in lock.values()
             for o in e.get("outs", []) if (k := layout.pool_iteration(o["path"])) is not None}
    return sorted(found.values(), key=lambda x: x[1])


def read_object(src: Source, kept: list[Store], path: str, md5: str) -> bytes:
    """An out's bytes from the first store that holds them (the cache, then the remote),
    refused unless their md5 is the one dvc.lock records."""
    where = [s.base for s in kept if s.base is not None]
    obj = stored(where, md5)
    if obj is None:
        raise InputError(f"{src.name(path)}: md5 {md5} is in none of its stores "
                         f"({', '.join(str(s.where) for s in kept)}); nothing imported")
    data = obj.read_bytes()
    actual = hashlib.md5(data).hexdigest()
    if actual != md5:
        raise InputError(f"{obj}: md5 {actual}, but {src.name('dvc.lock')} records {md5} for "
                         f"{path}; nothing imported")
    return data


def read_pools(src: Source, kept: list[Store]) -> list[pair_book.Pool]:
    pools = []
    for path, k, md5 in pool_outs(src.lock):
        data = read_object(src, kept, path, md5)
        name = src.name(path)
        pairs = [parse_pair(rec, name, n, "unknown") for n, rec in jsonl.read_bytes(data, name)]
        pools.append(pair_book.Pool(path, k, md5, pairs))
    if not pools:
        raise InputError(f"{src.name('dvc.lock')}: no pair pool (data/iter_<k>/"
                         "pairs_pool.jsonl) recorded: nothing to import")
    return pools


def read_labels(src: Source) -> tuple[dict[str, audit.AuditLabel], str | None]:
    """OTHER's audit verdicts at the commit and the labels file's md5 (None: it has none)."""
    data = git_bytes(src.root, "show", f"{src.commit}:{layout.AUDIT_LABELS}")
    if data is None:
        return {}, None
    name = src.name(layout.AUDIT_LABELS)
    return audit.labels_from(jsonl.read_bytes(data, name), name), hashlib.md5(data).hexdigest()


def locked_tokenizer(root: Path, lock: dict[str, Any], kept: list[Store]) -> str | None:
    """tokenizer_md5 of the initial model a dvc.lock records, from its stored DVC manifest."""
    out = next((o for o in lock.get(PREPARE_MODEL, {}).get("outs", [])
                if o["path"] == layout.policy(0)), None)
    manifest = stored([s.base for s in kept if s.base is not None],
                      out.get("md5", "")) if out else None
    if manifest is None:
        return None
    return pair_book.tokenizer_md5({e["relpath"]: e["md5"] for e in
                                    json.loads(manifest.read_text()) if "/" not in e["relpath"]})


def own_tokenizer(root: Path) -> str | None:
    """This workspace's initial model's tokenizer_md5: on disk, else through its dvc.lock."""
    found = pair_book.tokenizer_md5_of_dir(root / layout.policy(0))
    lock = root / "dvc.lock"
    if found is None and lock.is_file():
        cache = [Store("cache", str(root / CACHE), root / CACHE)]
        found = locked_tokenizer(root, (yaml.safe_load(lock.read_text()) or {}).get(
            "stages", {}), cache)
    return found


def _model_section(root: Path, text: bytes | str | None) -> tuple[str, ...] | None:
    """What names a params file's tokenizer: its model source and that source's origin."""
    model = (yaml.safe_load(text) or {}).get("model") if text else None
    if not isinstance(model, dict):
        return None
    source = str(model.get("source", "tiny"))
    if source == "gguf":
        return source, str(model.get("gguf_package")), str(model.get("gguf_file"))
    if source == "hf_dir":
        return source, str((root / Path(str(model.get("path", ""))).expanduser()).resolve())
    return (source,)


def same_tokenizer(root: Path, src: Source, kept: list[Store]) -> tuple[bool, str | None, str]:
    """(keep tokens?, OTHER's tokenizer_md5, why) by the rule in the module docstring."""
    theirs = locked_tokenizer(src.root, src.lock, kept)
    if theirs is None:
        return False, None, f"{src.root}'s initial model and its tokenizer are in no store"
    ours = own_tokenizer(root)
    if ours is not None:
        return (ours == theirs, theirs, "the same tokenizer files" if ours == theirs else
                f"tokenizer md5 {theirs} there, {ours} here")
    params = root / layout.PARAMS_FILE
    mine = _model_section(root, params.read_text() if params.is_file() else None)
    other = _model_section(src.root, git_bytes(src.root, "show",
                                               f"{src.commit}:{layout.PARAMS_FILE}"))
    if mine is None or mine != other:
        return False, theirs, (f"no initial model here yet, and the params' model sections "
                               f"name other tokenizers ({other} there, {mine} here)")
    return True, theirs, (f"no initial model here yet; the params' model sections name the "
                          f"same one ({'/'.join(mine)}); collect_offpolicy checks it again")


def where_found(src: Source, configured: list[Store]) -> dict[str, str | None]:
    """Where a person finds the source again when its path is gone (a clone of it is named to
    `lineage --book-source`): its git remote `origin` and its default DVC remote as
    configured at import time, one this machine cannot read (a team's s3://...) included."""
    origin = git(src.root, "remote", "get-url", "origin", check=False) or None
    remote = next((s.where for s in configured if s.name != "cache"), None)
    return {"git_remote": origin, "dvc_remote": remote}


def manifest(src: Source, pools: list[pair_book.Pool], labels_md5: str | None,
             book: pair_book.Book, tokens: bool, tokenizer: str | None,
             found: dict[str, str | None]) -> dict[str, Any]:
    return {"workspace": str(src.root), "commit": src.commit, **found,
            "pools": [{"path": p.path, "md5": p.md5, "rows": len(p.pairs),
                       "iteration": p.iteration} for p in pools],
            "audit_labels_md5": labels_md5, "n_pairs": len(book.pairs),
            "dropped_duplicates": book.duplicates, "audit_swapped": book.swapped,
            "audit_dropped": book.dropped, "tokens_kept": tokens, "tokenizer_md5": tokenizer,
            "alignloop_version": shipped.version()}


def build(root: Path, other: str | Path, rev: str) -> tuple[pair_book.Book, dict[str, Any], str]:
    """Everything read and checked, nothing written: the book, its manifest, the token line."""
    src = open_source(other, rev)
    if src.root == root.resolve():
        raise InputError(f"{root}: a workspace's own pools are in its pool already; "
                         "--from-workspace names another workspace")
    try:
        configured = stores(src.root)
        kept = [s for s in configured if s.base is not None]
    except Exception as e:  # noqa: BLE001 (DVC raises several types for a broken repo)
        raise InputError(f"{src.root}: its DVC cache and remote cannot be opened "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                         ) from None
    pools = read_pools(src, kept)
    labels, labels_md5 = read_labels(src)
    tokens, tokenizer, why = same_tokenizer(root, src, kept)
    book = pair_book.gather(pools, labels, {"workspace": str(src.root), "commit": src.commit},
                            tokens, tokenizer)
    if not book.pairs:
        raise InputError(f"{src.name('dvc.lock')}: no pairs left after the audit's drops")
    line = (f"tokens: token ids and sampler log-probs kept ({why})" if tokens else
            f"tokens: dropped, the pairs are imported as text ({why})")
    return book, manifest(src, pools, labels_md5, book, tokens, tokenizer,
                          where_found(src, configured)), line


def write(root: Path, book: pair_book.Book, info: dict[str, Any]) -> Path:
    """The pairs and their manifest, each replaced atomically (call under the workspace lock);
    the old manifest goes first, so a write cut short never names pairs that are not there."""
    dest = root / layout.IMPORT_PAIRS
    (root / layout.BOOK_MANIFEST).unlink(missing_ok=True)
    jsonl.write(dest, (p.to_record() for p in book.pairs))
    atomic.write_json(root / layout.BOOK_MANIFEST, info)
    return dest


def summary(book: pair_book.Book, info: dict[str, Any], dest: Path) -> str:
    per = ", ".join(f"iteration {k}: {n}" for k, n in sorted(book.per_iteration.items()))
    return (f"imported {len(book.pairs)} pairs from {info['workspace']} at "
            f"{info['commit'][:10]} into {dest} ({per}); {book.duplicates} duplicates dropped, "
            f"{book.swapped} swapped and {book.dropped} dropped by its audit")
