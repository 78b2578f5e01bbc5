"""`alignloop import FILE|DIR ... [--workspace W] [--split S]`: bring a user's preference pairs
into a workspace, where `collect_offpolicy` (with `offpolicy.source: import`) reads them.
`alignloop import --from-workspace OTHER [--rev REV]` brings another workspace's pair pools
instead (flows/book.py), with the manifest data/import/book.json; files and --from-workspace
are not taken together (one import replaces the other).

Every row of every input is checked before anything is written (tasks/data/pair_import.py); bad rows
are listed one per line (`file:line: field ...`, up to 20, then a count) and the command exits 2
with nothing written. Rows whose chosen equals rejected are refused and exact duplicates dropped,
both counted. The normalised pairs replace `<workspace>/data/import/pairs.jsonl` atomically; a
workspace that does not exist yet is created (git + DVC) as `alignloop run` creates it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flows import workspace as wsmod
from tasks.config.params import load_params
from tasks.core import jsonl, layout
from tasks.core.errors import InputError
from tasks.data.pair_import import ImportResult, read_pairs

SHOWN_REFUSED = 5        # locations of refused (chosen == rejected) rows printed


def add_parser(sub: argparse._SubParsersAction, default_workspace: str) -> None:
    imp = sub.add_parser("import", help="validate preference pairs (any TRL format: JSONL, "
                                        "JSON, Parquet, a save_to_disk directory) and put them "
                                        "in the workspace's data/import/")
    imp.add_argument("inputs", nargs="*", metavar="FILE|DIR",
                     help="one or more inputs; their pairs are imported together (none with "
                          "--from-workspace)")
    imp.add_argument("--from-workspace", metavar="OTHER", default=None,
                     help="import every pair pool of another alignloop workspace (its "
                          "\"mistake book\": all iterations, its audit verdicts applied) as "
                          "off-policy pairs; refused together with FILE arguments")
    imp.add_argument("--rev", default="HEAD", help="with --from-workspace: the commit, tag "
                                                   "or branch of OTHER to read (default HEAD)")
    imp.add_argument("--workspace", default=default_workspace, help="workspace directory "
                                                                    "(created if needed)")
    imp.add_argument("--split", default="", help="DatasetDict split(s) to read, e.g. train or "
                                                 "train,test (needed when it has several)")
    imp.set_defaults(func=cmd_import)


def cmd_import(args: argparse.Namespace) -> int:
    if args.from_workspace is not None:
        if args.inputs:
            raise InputError(f"{' '.join(args.inputs)}: give files or --from-workspace, not "
                             "both (each import replaces data/import/pairs.jsonl)")
        return cmd_import_book(args)
    if not args.inputs:
        raise InputError("import: name FILE|DIR inputs, or --from-workspace OTHER")
    if args.rev != "HEAD":
        raise InputError(f"--rev {args.rev}: only with --from-workspace")
    results = [read_pairs(Path(p), args.split, label=p) for p in args.inputs]
    errors = [e for r in results for e in r.errors]
    if errors:
        shown = ImportResult(errors=errors).error_lines()
        for line in shown:
            print(f"error: {line}", file=sys.stderr)
        print(f"error: {len(errors)} bad rows; nothing imported", file=sys.stderr)
        return 2
    total = _merge(results)
    if not total.pairs:
        raise InputError(f"{', '.join(args.inputs)}: no preference pairs to import"
                         + (f" ({len(total.identical)} rows with chosen == rejected)"
                            if total.identical else ""))
    root = Path(args.workspace).resolve()
    root.mkdir(parents=True, exist_ok=True)
    ws = wsmod.Workspace(root)
    wsmod.secure_state(ws)
    with wsmod.workspace_lock(ws, "wait"):     # not into a running iteration's inputs
        wsmod.init(root)
        dest = root / layout.IMPORT_PAIRS
        (root / layout.BOOK_MANIFEST).unlink(missing_ok=True)   # these pairs are no book's
        jsonl.write(dest, (p.to_record() for p in total.pairs))
    print(f"imported {len(total.pairs)} pairs into {dest}: {total.rows} rows, {total.prompts} "
          f"prompts, {total.duplicates} duplicates dropped, {len(total.identical)} with "
          "chosen == rejected refused")
    if total.identical:
        more = len(total.identical) - SHOWN_REFUSED
        print("  refused (chosen == rejected): " + ", ".join(total.identical[:SHOWN_REFUSED])
              + (f" and {more} more" if more > 0 else ""))
    print(_next_step(root))
    return 0


def cmd_import_book(args: argparse.Namespace) -> int:
    """Another workspace's pools into this one's data/import/ (flows/book.py)."""
    from flows import book as bookmod
    root = Path(args.workspace).resolve()
    book, info, tokens = bookmod.build(root, args.from_workspace, args.rev)
    root.mkdir(parents=True, exist_ok=True)
    ws = wsmod.Workspace(root)
    wsmod.secure_state(ws)
    with wsmod.workspace_lock(ws, "wait"):     # not into a running iteration's inputs
        wsmod.init(root)
        dest = bookmod.write(root, book, info)
    print(bookmod.summary(book, info, dest))
    print(tokens)
    print(_next_step(root))
    return 0


def _merge(results: list[ImportResult]) -> ImportResult:
    """One result for several inputs; a pair found in two inputs counts as a duplicate."""
    out, seen = ImportResult(), set()
    for r in results:
        out.rows += r.rows
        out.duplicates += r.duplicates
        out.identical += r.identical
        for pair in r.pairs:
            key = (pair.prompt, pair.chosen, pair.rejected)
            if key in seen:
                out.duplicates += 1
            else:
                seen.add(key)
                out.pairs.append(pair)
    return out


def _next_step(root: Path) -> str:
    params = root / layout.PARAMS_FILE
    if params.is_file():
        try:
            off = load_params(params).offpolicy
        except InputError:
            off = None
        if off is not None and off.source == "import" and off.import_path == layout.IMPORT_PAIRS:
            return f"next: alignloop run --workspace {root}"
    return (f"next: set offpolicy.source: import (import_path: {layout.IMPORT_PAIRS}) in your "
            f"params and run: alignloop run --params PARAMS --workspace {root}")
