"""A "mistake book": another workspace's pair pools, carried into this one as off-policy pairs.

`alignloop import --from-workspace OTHER` (flows/book.py) reads every pair pool OTHER's
dvc.lock records at one commit; this module is the pure part: the pools' union (a pair once,
the earliest iteration's copy), OTHER's audit verdicts applied (tasks/data/audit.py: a swap
flips, a drop removes), and each pair re-tagged so that it cannot pass for one of this
workspace's own iterations: `source` "book" (off-policy, like "import" and "cold_start"),
`meta.iteration` 0 (it enters this workspace's pool at iteration 0; tasks/policy/pair_reuse.py
reads it) and `meta.book` naming where it came from.

Token ids and sampler log-probs are kept only when OTHER's tokenizer is this workspace's: an
id means a token only under the tokenizer that made it. The tokenizer is named by
`tokenizer_md5`, an md5 over the names and md5s of its vocabulary files (TOKENIZER_FILES), which
a DVC directory manifest gives without reading the files. `keeps_tokens` is the check the
`collect_offpolicy` stage repeats against the workspace's own initial model at stage time.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tasks.data import audit
from tasks.data.records import PreferencePair

BOOK_SOURCE = "book"

# the files that fix which token an id is (not tokenizer_config.json: it also holds settings
# such as model_max_length that leave the ids alone)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "added_tokens.json", "special_tokens_map.json")

Key = tuple[Any, str, str]
INDEX = "_book_row"       # a pair's place in the union while the audit is applied (then removed)


@dataclass(frozen=True)
class Pool:
    """One pair pool of the other workspace, as its dvc.lock records it, with its pairs."""
    path: str
    iteration: int
    md5: str
    pairs: Sequence[PreferencePair]


@dataclass
class Book:
    """The pairs carried over, and what became of the rest."""
    pairs: list[PreferencePair] = field(default_factory=list)
    per_iteration: dict[int, int] = field(default_factory=dict)   # pool iteration -> pairs
    duplicates: int = 0
    swapped: int = 0
    dropped: int = 0              # by the other workspace's audit (verdict `drop`)


def tokenizer_md5(md5s: Mapping[str, str]) -> str | None:
    """md5 over "name md5" lines of the TOKENIZER_FILES present (file name -> file md5), or
    None when none is: no tokenizer to compare."""
    lines = [f"{name} {md5s[name]}\n" for name in TOKENIZER_FILES if name in md5s]
    return hashlib.md5("".join(lines).encode()).hexdigest() if lines else None


def tokenizer_md5_of_dir(path: Path) -> str | None:
    """tokenizer_md5 of a saved model directory's files (None: no directory or no tokenizer)."""
    md5s = {}
    for name in TOKENIZER_FILES:
        f = path / name
        if f.is_file():
            md5s[name] = hashlib.md5(f.read_bytes()).hexdigest()
    return tokenizer_md5(md5s)


def keeps_tokens(rec: Mapping[str, Any], tokenizer: str | None) -> bool:
    """Whether a stored import row may keep its token ids and log-probs: only a book row whose
    recorded tokenizer is `tokenizer` (the reading workspace's own)."""
    book = rec.get("meta", {}).get("book") if isinstance(rec.get("meta"), dict) else None
    return (tokenizer is not None and rec.get("source") == BOOK_SOURCE
            and isinstance(book, dict) and book.get("tokenizer_md5") == tokenizer)


def _key(pair: PreferencePair) -> Key:
    return (pair.prompt, pair.chosen, pair.rejected)


def union(pools: Sequence[Pool]) -> tuple[list[tuple[PreferencePair, Pool]], int]:
    """Every pair of the pools once, with the earliest-iteration pool that holds it, in pool
    order then row order; and how many copies were left out."""
    seen: set[Key] = set()
    out, duplicates = [], 0
    for pool in sorted(pools, key=lambda p: p.iteration):
        for pair in pool.pairs:
            if _key(pair) in seen:
                duplicates += 1
                continue
            seen.add(_key(pair))
            out.append((pair, pool))
    return out, duplicates


def retag(pair: PreferencePair, pool: Pool, origin: Mapping[str, str], keep_tokens: bool,
          tokenizer: str | None) -> PreferencePair:
    """The pair as this workspace's iteration-0 off-policy pair: `source` "book",
    `meta.iteration` 0, where it came from in `meta.book` (origin: workspace and commit),
    the sampler's version and iteration moved there; tokens kept only with `keep_tokens`."""
    meta = {k: v for k, v in pair.meta.items() if k not in ("iteration", "policy", "book")}
    book = {**origin, "path": pool.path, "iteration": pool.iteration, "source": pair.source,
            "policy": pair.meta.get("policy"), "tokenizer_md5": tokenizer}
    if "book" in pair.meta:               # the other workspace's own book: where it came from
        book["book"] = pair.meta["book"]
    return replace(pair, source=BOOK_SOURCE, meta={**meta, "iteration": 0, "book": book},
                   sampled=dict(pair.sampled) if keep_tokens else {})


def gather(pools: Sequence[Pool], labels: dict[str, audit.AuditLabel],
           origin: Mapping[str, str], keep_tokens: bool, tokenizer: str | None) -> Book:
    """The book: the pools' union, the audit's verdicts applied, every pair re-tagged.

    Raises DataError (tasks/data/audit.py) for a label that names a pair the pools should hold
    and do not, as the other workspace's own train_rm would."""
    held, duplicates = union(pools)
    marked = [replace(p, meta={**p.meta, INDEX: i}) for i, (p, _) in enumerate(held)]
    audited, _ = audit.apply_audit(marked, labels)     # meta is not part of a pair's identity
    book = Book(duplicates=duplicates, dropped=len(held) - len(audited))
    seen: set[Key] = set()
    for pair in audited:
        meta = dict(pair.meta)
        original, pool = held[meta.pop(INDEX)]
        pair = replace(pair, meta=meta)
        if _key(pair) in seen:             # a swap that made a pair the pools already hold
            book.duplicates += 1
            continue
        seen.add(_key(pair))
        book.swapped += pair.chosen != original.chosen
        book.pairs.append(retag(pair, pool, origin, keep_tokens, tokenizer))
        book.per_iteration[pool.iteration] = book.per_iteration.get(pool.iteration, 0) + 1
    return book
