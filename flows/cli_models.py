"""The CLI's commands on registered models' bytes: `gc` (archive old iterations' weights) and
`export` (a version as a standalone Hugging Face directory)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from flows import workspace as wsmod
from flows.run import RunFailed
from tasks.core.errors import InputError

if TYPE_CHECKING:
    from flows.gc import Plan


def _own_store(ws: wsmod.Workspace) -> None:
    if os.environ["MLFLOW_TRACKING_URI"] == ws.mlflow_uri and \
            not (ws.state / "mlflow.db").is_file():
        raise InputError(f"{ws.root}: no MLflow store (.alignloop/mlflow.db): nothing "
                         "registered here")


def cmd_gc(args: argparse.Namespace) -> int:
    from mlflow.tracking import MlflowClient

    from flows import aliases, gc
    ws = wsmod.existing_workspace(args.workspace)
    if args.keep_last < 0:
        raise InputError(f"--keep-last: expected 0 or more, got {args.keep_last}")
    _own_store(ws)
    try:
        with wsmod.workspace_lock(ws, "skip"):
            for line in gc.finish_interrupted(ws.root, ws.state):
                print(line)
            client = MlflowClient()
            p = gc.plan(ws.root, client, args.keep_last)
            _print_plan(p, args.dry_run)
            if p.problems:
                return 1
            if not p.outs or args.dry_run:
                return 0
            gc.apply(ws.root, ws.state, p, client, aliases.who(ws.root))
    except wsmod.Busy as e:
        raise RunFailed(f"{e}; gc changes nothing while it runs", 1) from None
    print(f"gc: archived; the record is in {gc.archived.LEDGER}")
    return 0


def _print_plan(p: Plan, dry: bool) -> None:
    from flows.gc import MODEL_OUT, human
    for problem in p.problems:
        print(f"gc: cannot plan: {problem}")
    for path, why in sorted(p.kept.items()):
        if MODEL_OUT.match(path):
            print(f"  keep    {path}: {'; '.join(why)}")
    for out in p.outs:
        sizes = ", ".join(f"{k} {human(v)}" for k, v in out.bytes.items())
        print(f"  archive {out.path} md5 {out.md5} "
              f"({', '.join(out.versions) or 'no registered version'}): {sizes}")
    if not p.outs:
        print("gc: nothing to archive")
        return
    places = ["workspace", *(s.label for s in p.stores)]
    total = ", ".join(f"{k} {human(p.total(k))}" for k in places)
    verb = "would free (dry run: nothing removed)" if dry else "frees"
    print(f"gc: {len(p.outs)} model directories ({total}); {verb} "
          f"{human(p.freed)} of this machine's disk (a hard link counted once)")


def cmd_export(args: argparse.Namespace) -> int:
    from mlflow.tracking import MlflowClient

    from flows import export, lineage
    ws = wsmod.existing_workspace(args.workspace)
    dest = Path(args.directory).resolve()
    export.check_destination(dest)                 # before anything is loaded
    _own_store(ws)
    mv = lineage.resolve(MlflowClient(), args.model)
    what = export.export_version(ws.root, ws.state, mv, dest, args.merge)
    print(f"exported {mv.name} v{mv.version} ({args.model}, md5 {mv.tags.get('model_md5')}) "
          f"to {dest}: {what}")
    return 0


def add_parsers(sub: argparse._SubParsersAction, default_workspace: str) -> None:
    gcp = sub.add_parser("gc", help="remove old iterations' model weights from the workspace, "
                                    "the DVC cache and the remote (data, aliased versions and "
                                    "the last N iterations are kept)")
    gcp.add_argument("--keep-last", type=int, required=True, metavar="N",
                     help="keep the models of the last N iterations")
    gcp.add_argument("--dry-run", action="store_true",
                     help="print what would go and how many bytes; remove nothing")
    gcp.add_argument("--workspace", default=default_workspace)
    gcp.set_defaults(func=cmd_gc)
    ex = sub.add_parser("export", help="a registered version as a standalone Hugging Face "
                                       "directory (save_pretrained layout)")
    ex.add_argument("model", help="models:/NAME@ALIAS or models:/NAME/VERSION")
    ex.add_argument("directory", help="where (must not exist, or be empty)")
    ex.add_argument("--merge", action="store_true",
                    help="a LoRA adapter merged into its base's weights (else the adapter "
                         "with its base beside it)")
    ex.add_argument("--workspace", default=default_workspace)
    ex.set_defaults(func=cmd_export)
