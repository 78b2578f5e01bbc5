"""Reading a user's preference pairs from disk, every row validated before any is used.

Inputs: JSON Lines (`.jsonl`, or `.json` holding one object per line, as `Dataset.to_json`
writes), a JSON array of objects (`.json`), Parquet (`.parquet`), or a directory written by HF
`datasets` `save_to_disk` (a Dataset, or a DatasetDict with the splits to read named; one
without named splits is read only when it has a single split). Rows may be in any TRL preference
format (tasks/data/pair_formats.py). Every bad row is reported as `file:line: field ...` (`file (row
N)` where the input has no lines); rows whose chosen equals rejected are refused and exact
duplicates dropped, both counted. Used by `collect_offpolicy` and by `alignloop import`.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.core.jsonl import DataError
from tasks.data.pair_book import BOOK_SOURCE, keeps_tokens
from tasks.data.pair_formats import IdenticalPair
from tasks.data.records import (
    LOGPROB_KEYS,
    SAMPLED_KEYS,
    PreferencePair,
    parse_pair,
    prompt_to_record,
)

MAX_ERRORS = 20          # errors listed in full; the rest are counted

Row = tuple[str, dict[str, Any] | None, str | None]   # (where, record, or None and its error)


@dataclass
class ImportResult:
    pairs: list[PreferencePair] = field(default_factory=list)
    rows: int = 0
    duplicates: int = 0
    identical: list[str] = field(default_factory=list)    # where each refused row was
    errors: list[str] = field(default_factory=list)

    @property
    def prompts(self) -> int:
        return len({json.dumps(prompt_to_record(p.prompt)) for p in self.pairs})

    def error_lines(self, cap: int = MAX_ERRORS) -> list[str]:
        more = len(self.errors) - cap
        return self.errors[:cap] + ([f"... and {more} more bad rows"] if more > 0 else [])


def read_pairs(path: Path, splits: str = "", label: str | None = None,
               tokenizer: str | None = None) -> ImportResult:
    """Every row of `path` parsed; nothing raised for a bad row (see ImportResult.errors).

    A DataError is raised only when the input as a whole cannot be read (missing, not a known
    format, a DatasetDict without a chosen split). `label` names the file in messages. Token
    ids and log-probs are dropped (not our tokenizer's), except a book row's whose recorded
    tokenizer is `tokenizer`, the reading workspace's own (tasks/data/pair_book.py).
    """
    res, seen = ImportResult(), set()
    for where, rec, err in rows(path, splits, label or str(path)):
        res.rows += 1
        if rec is None:
            res.errors.append(err or f"{where}: unreadable row")
            continue
        if not keeps_tokens(rec, tokenizer):                            # not our tokenizer's
            rec = {k: v for k, v in rec.items() if k not in SAMPLED_KEYS + LOGPROB_KEYS}
        if rec.get("source") != BOOK_SOURCE:   # never taken for one of this workspace's iterations
            rec = _as_import(rec)
        try:
            pair = parse_pair(rec, "", 0, "import", where=where)
        except IdenticalPair:
            res.identical.append(where)
            continue
        except DataError as e:
            res.errors.append(str(e))
            continue
        if pair.chosen == pair.rejected:
            res.identical.append(where)
            continue
        key = json.dumps([prompt_to_record(pair.prompt), pair.chosen, pair.rejected])
        if key in seen:
            res.duplicates += 1
            continue
        seen.add(key)
        res.pairs.append(pair)
    return res


def _as_import(rec: dict[str, Any]) -> dict[str, Any]:
    """A user's row as an import: `source` import and no `meta.iteration`, whatever the file
    says (a pool file copied from a workspace names that workspace's iterations, which this
    one would take for its own on-policy pairs); the file's values stay in meta."""
    meta = rec.get("meta")
    if not isinstance(meta, dict):
        return {**rec, "source": "import"}
    kept = {k: v for k, v in meta.items() if k != "iteration"}
    if "iteration" in meta:
        kept["file_iteration"] = meta["iteration"]
    if "source" in rec:
        kept["file_source"] = rec["source"]
    return {**rec, "source": "import", "meta": kept}


def rows(path: Path, splits: str, label: str) -> Iterator[Row]:
    if path.is_dir():
        yield from _dataset_rows(path, splits, label)
    elif not path.is_file():
        raise DataError(f"{label}: file not found")
    elif path.suffix == ".parquet":
        yield from _parquet_rows(path, label)
    elif path.suffix == ".json" and _starts_with(path, b"["):
        yield from _json_array_rows(path, label)
    elif path.suffix in (".jsonl", ".json"):
        yield from _jsonl_rows(path, label)
    else:
        raise DataError(f"{label}: unknown input format (expected .jsonl, .json, .parquet or "
                        "a directory saved by HF datasets)")


def _starts_with(path: Path, prefix: bytes) -> bool:
    with path.open("rb") as f:
        return f.read(4096).lstrip().startswith(prefix)


def _record(value: Any, where: str) -> Row:
    if not isinstance(value, dict):
        return where, None, f"{where}: expected a JSON object, got {type(value).__name__}"
    return where, value, None


def _jsonl_rows(path: Path, label: str) -> Iterator[Row]:
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            where = f"{label}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, None, f"{where}: not valid UTF-8 (byte {e.start} of the line)"
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                yield where, None, f"{where}: invalid JSON: {e.msg} (column {e.colno})"
                continue
            yield _record(value, where)


def _json_array_rows(path: Path, label: str) -> Iterator[Row]:
    """Each element of a top-level JSON array, named by the line it starts on."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{label}: not valid UTF-8 (byte {e.start})") from None
    dec, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        pos = _skip(text, pos)
        if pos < len(text) and text[pos] == "]":
            return
        line = text.count("\n", 0, pos) + 1
        try:
            value, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise DataError(f"{label}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})"
                            ) from None
        yield _record(value, f"{label}:{line}")
        pos = _skip(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos += 1
        elif pos >= len(text) or text[pos] != "]":
            line = text.count("\n", 0, pos) + 1
            raise DataError(f"{label}:{line}: invalid JSON: expected ',' or ']' after an element")


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _parquet_rows(path: Path, label: str) -> Iterator[Row]:
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(path)
    except Exception as e:          # noqa: BLE001 (pyarrow raises several types for a bad file)
        raise DataError(f"{label}: not a readable Parquet file ({e})") from None
    for n, rec in enumerate(table.to_pylist(), start=1):
        yield _record(rec, f"{label} (row {n})")


def _dataset_rows(path: Path, splits: str, label: str) -> Iterator[Row]:
    import datasets
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 (datasets raises several types for a bad dir)
        raise DataError(f"{label}: not a saved HF datasets directory ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        names = choose_splits(list(ds), splits, label)
        for name in names:
            for n, rec in enumerate(ds[name], start=1):
                yield _record(dict(rec), f"{label} (split {name}, row {n})")
    else:
        if splits:
            raise DataError(f"{label}: a Dataset without splits; drop --split {splits}")
        for n, rec in enumerate(ds, start=1):
            yield _record(dict(rec), f"{label} (row {n})")


def choose_splits(have: list[str], splits: str, label: str) -> list[str]:
    """The named splits ("train" or "train,test"); with none named, the only one there is."""
    want = [s.strip() for s in splits.split(",") if s.strip()]
    if not want:
        if len(have) == 1:
            return have
        raise DataError(f"{label}: a DatasetDict with splits {', '.join(have)}; name the ones "
                        "to import with --split (e.g. --split " + ",".join(have) + ")")
    missing = [s for s in want if s not in have]
    if missing:
        raise DataError(f"{label}: no split {missing[0]!r} (splits: {', '.join(have)})")
    return want
