"""A persistent verdict cache: (judge identity, prompt, first, second) -> verdict, in SQLite.

Each batch of verdicts is one transaction, so a stage killed midway keeps every batch it
finished and the rerun asks only for the rest. It lives under the workspace's `.alignloop/`
(machine state, like the stores: not an artifact, never a DVC out); DVC still decides whether
a stage runs, the cache only avoids paying twice for one comparison.
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path

from tasks.data.records import Prompt, prompt_to_record


def cache_key(identity: str, prompt: Prompt, first: str, second: str) -> str:
    blob = json.dumps([identity, prompt_to_record(prompt), first, second], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


class VerdictCache:
    def __init__(self, path: Path, identity: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, timeout=60, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        with self._db:
            self._db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, "
                             "verdict TEXT NOT NULL, reply TEXT)")
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('identity', ?)", (identity,))

    def get_many(self, keys: Sequence[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for s in range(0, len(keys), 500):          # SQLite's bound-variable limit
            chunk = list(keys[s: s + 500])
            q = f"SELECT key, verdict FROM verdicts WHERE key IN ({','.join('?' * len(chunk))})"
            out.update(dict(self._db.execute(q, chunk).fetchall()))
        return out

    def put_many(self, rows: Sequence[tuple[str, str, str]]) -> None:
        """(key, verdict, raw reply) rows, in one transaction."""
        with self._db:
            self._db.executemany("INSERT OR REPLACE INTO verdicts VALUES (?, ?, ?)", rows)

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0])

    def close(self) -> None:
        self._db.close()
