"""A copied or moved workspace takes its MLflow store with it.

MLflow names places by absolute path: the experiment's artifact location and so every run's
artifact URI, each model version's `source`, each dataset input's source, the `workspace` tag.
In a copy (`cp -a W W2`) or after `mv W W2` those paths still name W, and the copy would load
W's models and write W's artifact store. So before a command opens the workspace's own store
(`.alignloop/mlflow.db`, not a team's tracking server), the root the store was last used at
is read from the store itself (the experiment's artifact location,
`<root>/.alignloop/mlflow-artifacts`); when it is another directory, every text field of the
store that names it is rewritten to this workspace's root, in one transaction. The original
is never touched: its files are only ever read by the copy's `cp`.
"""
from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from urllib.parse import unquote, urlparse

ARTIFACTS = "mlflow-artifacts"   # beside the store: <root>/.alignloop/{mlflow.db, mlflow-artifacts}


def _path_of(location: str) -> Path | None:
    if location.startswith("file://"):
        return Path(unquote(urlparse(location).path))
    return Path(location) if location.startswith("/") else None


def recorded_root(db: Path) -> Path | None:
    """The workspace root the store was last used at, or None (no store yet, or no experiment
    whose artifact location is a workspace's own, `<root>/.alignloop/mlflow-artifacts`)."""
    if not db.is_file():
        return None
    with closing(sqlite3.connect(db)) as con:
        try:
            rows = con.execute("SELECT artifact_location FROM experiments").fetchall()
        except sqlite3.DatabaseError:             # no tables yet
            return None
    for (location,) in rows:
        where = _path_of(location or "")
        if where is not None and where.name == ARTIFACTS and where.parent.name == db.parent.name:
            return where.parent.parent
    return None


def follow(db: Path, root: Path) -> int:
    """Rewrite the store at `db` from the root it names to `root`; the number of fields
    rewritten (0 when it names `root` already, or nothing of a workspace's)."""
    old = recorded_root(db)
    if old is None or old == root:
        return 0
    # a path names the old root where a field starts with it (or is it); inside a field (JSON)
    # only after a quote or as a file URI, so /data/old/... is not /old/...
    inside = [(f'"{old}/', f'"{root}/'), (f"{old.as_uri()}/", f"{root.as_uri()}/")]
    changed = 0
    with closing(sqlite3.connect(db)) as con, con:
        for table, column in text_columns(con):
            t, c = f'"{table}"', f'"{column}"'
            changed += con.execute(f"UPDATE {t} SET {c} = ? WHERE {c} = ?",
                                   (str(root), str(old))).rowcount
            start = f"{old}/"
            changed += con.execute(
                f"UPDATE {t} SET {c} = ? || substr({c}, ?) WHERE substr({c}, 1, ?) = ?",
                (f"{root}/", len(start) + 1, len(start), start)).rowcount
            for a, b in inside:
                changed += con.execute(
                    f"UPDATE {t} SET {c} = replace({c}, ?, ?) WHERE instr({c}, ?) > 0",
                    (a, b, a)).rowcount
    return changed


def text_columns(con: sqlite3.Connection) -> list[tuple[str, str]]:
    tables = [r[0] for r in con.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
    return [(t, col[1]) for t in tables for col in con.execute(f'PRAGMA table_info("{t}")')
            if any(k in str(col[2]).upper() for k in ("CHAR", "TEXT", "CLOB"))]

