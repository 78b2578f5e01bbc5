"""JSON Lines reading with errors that name the file and line, and atomic writing."""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tasks.core import atomic
from tasks.core.errors import InputError


class DataError(InputError):
    """Malformed input data; the message names the file, line and field."""


def read(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line_number, record) for each non-blank line; raise DataError on bad input."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with path.open("rb") as f:
        yield from _records(f, str(path))


def read_bytes(data: bytes, name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """`read` of bytes held in memory (e.g. a file at a git commit); errors name `name`."""
    yield from _records(data.splitlines(keepends=True), name)


def _records(lines: Iterable[bytes], name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for n, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{name}:{n}: not valid UTF-8 (byte {e.start} of the "
                            "line)") from None
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{name}:{n}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(rec, dict):
            raise DataError(f"{name}:{n}: expected a JSON object, got {type(rec).__name__}")
        yield n, rec


def write(path: str | Path, records: Iterable[dict[str, Any]]) -> int:
    """Write records atomically, one JSON object per line; returns the count."""
    lines = [json.dumps(r, ensure_ascii=False, sort_keys=True) for r in records]
    atomic.write_text(path, "".join(line + "\n" for line in lines))
    return len(lines)
