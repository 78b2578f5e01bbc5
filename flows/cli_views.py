"""The CLI's views: commands that read a workspace (or the params schema) and print, never
changing results: `status`, `report`, `lineage`, `dag`, `params`. (`report --html` may build
the report page, the `report` stage's output, as DVC decides.)"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from flows import archived
from flows import workspace as wsmod
from flows.run import RunFailed
from tasks.core import layout
from tasks.core.errors import InputError
from tasks.evaluation.report_data import collect_report


def cmd_status(args: argparse.Namespace) -> int:
    from flows import dag
    from flows.cli_workspace import upgrade_notice
    root = wsmod.existing_workspace(args.workspace).root
    notice = upgrade_notice(root)
    if notice:
        print(notice, file=sys.stderr if args.json else sys.stdout)
    gone = archived.archived(root)
    states = [(s.name, *_state(s.state, s.reasons, gone)) for s in dag.stage_states(root)]
    if args.json:
        print(json.dumps([{"stage": name, "state": state, "reasons": reasons}
                          for name, state, reasons in states], indent=2))
    else:
        for name, state, reasons in states:
            why = f"  ({'; '.join(reasons)})" if reasons else ""
            print(f"{state:<11} {name}{why}")
    return 0 if all(state in ("up-to-date", "archived") for _, state, _ in states) else 1


def _state(state: str, reasons: list[str], gone: dict[tuple[str, str], Any]
           ) -> tuple[str, list[str]]:
    """A stage instance whose only change is weights `alignloop gc` archived is `archived`
    (`alignloop run` passes it), not missing or changed."""
    if gone and state != "up-to-date" and archived.archived_reasons(reasons, gone):
        return "archived", [*reasons, f"weights archived: {archived.LEDGER}"]
    return state, reasons


REPORT_COLUMNS = (("judge", "eval/win_rate"), ("lo", "eval/win_rate_ci_low"),
                  ("gold", "eval/gold_win_rate"), ("lo", "eval/gold_win_rate_ci_low"),
                  ("rm", "eval/rm_win_rate"), ("bon-gold", "eval/bon_gold_win_rate"),
                  ("kl", "eval/kl"), ("topic", "eval/on_topic_rate"),
                  ("ref-topic", "eval/ref_on_topic_rate"), ("review", "eval/review_rate"),
                  ("ref-rev", "eval/ref_review_rate"), ("len", "eval/length_ratio"),
                  ("nll", "eval/fluency_nll"), ("rm-acc", "rm/accuracy"),
                  ("hack", "eval/hacking_flag"))


def _report_page(ws: wsmod.Workspace) -> Path:
    """The `report` stage's page, brought up to date as DVC decides (under the workspace lock,
    like a run); a page built here is in dvc.lock, committed by the next `alignloop run`."""
    from flows import dag
    from tasks.evaluation.report import HTML_NAME
    if not (ws.root / layout.PARAMS_FILE).is_file():
        raise InputError(f"{ws.root}: no params.yaml; run it first")
    try:
        logging.getLogger("dvc").setLevel(logging.WARNING)   # stdout is the path alone
        with wsmod.workspace_lock(ws):
            done = dag.reproduce(ws.root, "report")
    except dag.StageFailed as e:
        raise RunFailed(str(e), 1) from None
    if done.outcome != "cached":
        print(f"report: {done.outcome} ({done.seconds:.1f} s); dvc.lock names it, the next "
              f"`alignloop run` commits it", file=sys.stderr)
    return ws.root / layout.REPORT_DIR / HTML_NAME


def print_report(root: Path) -> None:
    """Win rates (judge, gold, RM, Best-of-N by gold) with interval lows, and the monitors."""
    report = collect_report(root)
    rows = [(k, v) for k, v in report.items() if k != "0"]
    if not rows:
        return
    print("iter  " + " ".join(f"{name:>9}" for name, _ in REPORT_COLUMNS))
    for it, m in rows:
        print(f"{it:>4}  " + " ".join(f"{m.get(k, float('nan')):>9.3f}"
                                      for _, k in REPORT_COLUMNS))


def cmd_report(args: argparse.Namespace) -> int:
    root = Path(args.workspace).resolve()
    if args.html:
        print(_report_page(wsmod.existing_workspace(args.workspace)))
    elif args.json:
        print(json.dumps(collect_report(root), indent=2, sort_keys=True))
    else:
        print_report(root)
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    from mlflow.tracking import MlflowClient

    from flows import lineage, verify
    from flows.registry_record import Record
    ws = wsmod.existing_workspace(args.workspace)
    root = ws.root
    own_store = os.environ["MLFLOW_TRACKING_URI"] == ws.mlflow_uri
    client: Any
    if own_store and not (ws.state / "mlflow.db").is_file():
        if not Record.available(root):
            raise InputError(f"{root}: no MLflow store (.alignloop/mlflow.db) and no registry "
                             "record (registry/versions.json): nothing registered to trace")
        client = Record(root)       # a clone: no MLflow store, the registry's record in git
        print(f"lineage: from the registry record {client.where} (no MLflow store in this "
              "workspace)", file=sys.stderr)
    else:
        client = MlflowClient()
    sources = tuple(Path(p).expanduser() for p in args.book_source or ())
    tree = lineage.model_lineage(root, client, lineage.resolve(client, args.model),
                                 sources=sources)
    if args.json:
        print(json.dumps(tree, indent=2, default=str))
    else:
        _print_lineage(tree)
    if not args.verify:
        return 0
    artifacts: dict[tuple[str, str], tuple[dict, str]] = {}
    bases: list[dict] = []
    node: object = tree
    while isinstance(node, dict):          # this version and every parent policy
        for a in lineage.iter_artifacts(node["produced_by"]):
            artifacts.setdefault((a["path"], a["md5"]), (a, node["git_commit"]))
        if node.get("base"):
            bases.append(node["base"])
        node = node.get("parent_policy")
    kept = verify.stores(root, args.skip_remote)
    readable = [s.base for s in kept if s.base is not None]
    gone = archived.archived(root)
    left_out = [k for k in artifacts if k in gone and not verify.present(readable, k[1])]
    problems = verify.verify(root, [v for k, v in artifacts.items() if k not in left_out], kept)
    problems += [p for b in bases for p in _base_problems(b, readable)]
    books = [(b, *_book_problems(b, args.skip_remote)) for b in lineage.iter_books(tree)]
    problems += [p for _, _, found in books for p in found]
    for p in problems:
        print(f"verify: FAILED {p}", file=sys.stderr)
    checked = " and ".join(f"{s.name} ({s.where})" for s in kept if s.base is not None)
    skipped = "; the remote skipped (--skip-remote)" if args.skip_remote else ""
    gc_note = (f"; {len(left_out)} archived by `alignloop gc` (weights removed, recorded in "
               f"{archived.LEDGER}): {', '.join(p for p, _ in left_out)}") if left_out else ""
    book_note = "".join(f"; {n} of the book's source {b['workspace']} re-hashed from its stores"
                        + (f" (its clone {b['read_from']})" if b.get("read_from") else "")
                        for b, n, _ in books)
    print(f"verify: {'FAILED' if problems else 'ok'}: {len(artifacts) - len(left_out)} "
          f"artifacts re-hashed from the {checked}{skipped}{book_note}"
          f"{', ' + str(len(problems)) + ' problems' if problems else ''}{gc_note}")
    return 1 if problems else 0


def _book_problems(book: dict, skip_remote: bool) -> tuple[int, list[str]]:
    """The artifacts of an imported book, re-hashed from its source workspace's own stores
    (where lineage read it: the recorded path, or a clone named by `--book-source`): (how
    many, problems). A source that is not here, or holds no dvc.lock at the book's commit, is
    a problem naming it and where it was kept: nothing of it was re-hashed. Weights `alignloop
    gc` archived there and no store holds are left out, as for this workspace's own."""
    from flows import lineage, verify
    other = Path(book.get("read_from") or book["workspace"])
    where = f"book source {book['workspace']} (commit {book['commit'][:10]})"
    if book.get("read_from"):
        where += f", read from {other}"
    if book.get("source_workspace"):
        kept_at = "".join(f"; its {k.replace('_', ' ')} was {book[k]}"
                          for k in ("git_remote", "dvc_remote") if book.get(k))
        return 0, [f"{where}: workspace {book['source_workspace']}; its pools "
                   f"{', '.join(p['path'] for p in book['pools'])} cannot be re-hashed "
                   f"(name a clone of it with --book-source PATH{kept_at})"]
    try:
        kept = verify.stores(other, skip_remote)
    except Exception as e:  # noqa: BLE001 (DVC raises several types for a broken repo)
        return 0, [f"{where}: its DVC stores cannot be opened ({type(e).__name__}: {e})"]
    readable = [s.base for s in kept if s.base is not None]
    gone = archived.archived(other)
    found = [(a, c) for a, c in lineage.book_artifacts(book)
             if (a["path"], a["md5"]) not in gone or verify.present(readable, a["md5"])]
    return len(found), [f"{where}: {p}" for p in verify.verify(other, found, kept)]


def _base_problems(base: dict, readable: list[Path]) -> list[str]:
    """An adapter's base: the out dvc.lock records at its path must hold the weights whose md5
    the adapter names."""
    from flows import verify
    where = f"adapter base {base['path']}"
    if not base.get("dvc_md5"):
        return [f"{where}: no stage output at that path in dvc.lock"]
    actual = verify.weights_md5(readable, base["dvc_md5"])
    if actual is None:
        return [f"{where} ({base['dvc_md5']}): its weights are in no store"]
    if actual != base["weights_md5"]:
        return [f"{where}: weights md5 {actual}, but the adapter names {base['weights_md5']}"]
    return []


def _print_lineage(node: dict, indent: int = 0) -> None:
    pad = "  " * indent
    print(f"{pad}{node['model']} v{node['version']} {node['aliases'] or ''} "
          f"md5 {node['model_md5']} commit {node['git_commit'][:10]} "
          f"flow-run {node['prefect_flow_run_id']}")
    if node.get("archived"):
        print(f"{pad}  weights archived ({node['archived']})")
    if node.get("base"):
        b = node["base"]
        print(f"{pad}  LoRA adapter on base {b['path']} (weights md5 {b['weights_md5']}, "
              f"dvc md5 {b['dvc_md5']})")
    if node.get("reward_model"):
        rm = node["reward_model"]
        gone = ", weights archived" if rm.get("archived") else ""
        print(f"{pad}  reward model v{rm['version']} ({rm['dvc_stage']}, md5 {rm['model_md5']}"
              f"{gone})")

    def stage(n: dict, depth: int) -> None:
        p = "  " * depth
        print(f"{p}<- {n['stage']}  params md5 {n['params_md5'][:10]}")
        for i in n["inputs"]:
            rows = f", {i['rows']} rows" if "rows" in i else ""
            print(f"{p}   input {i['path']} md5 {i['md5']} ({i.get('size')} bytes{rows})")
            if isinstance(i["produced_by"], dict) and "inputs" in i["produced_by"]:
                stage(i["produced_by"], depth + 2)
            if isinstance(i.get("book"), dict):
                book(i["book"], depth + 2)

    def book(b: dict, depth: int) -> None:
        p = "  " * depth
        gone = (f" (source workspace {b['source_workspace']})" if b.get("source_workspace")
                else f" (read from its clone {b['read_from']})" if b.get("read_from") else "")
        print(f"{p}<- book of {b['workspace']} at commit {b['commit'][:10]}{gone}: "
              f"{b['n_pairs']} pairs, tokens {'kept' if b['tokens_kept'] else 'dropped'}")
        for pool in b["pools"]:
            print(f"{p}   pool {pool['path']} md5 {pool['md5']} (iteration {pool['iteration']}, "
                  f"{pool['rows']} rows)")
            if isinstance(pool.get("produced_by"), dict) and "inputs" in pool["produced_by"]:
                stage(pool["produced_by"], depth + 2)
    stage(node["produced_by"], indent + 1)
    if isinstance(node.get("parent_policy"), dict):
        print(f"{pad}  parent policy:")
        _print_lineage(node["parent_policy"], indent + 2)
    else:
        print(f"{pad}  parent policy: {node.get('parent_policy')} (the initial model)")


def cmd_dag(args: argparse.Namespace) -> int:
    from flows import dag
    root = wsmod.existing_workspace(args.workspace).root
    if args.mermaid or args.dot:
        import subprocess
        out = subprocess.run([sys.executable, "-m", "dvc", "dag", "--mermaid" if args.mermaid
                              else "--dot"], cwd=root, capture_output=True, text=True)
        print(out.stdout, end="")
        return out.returncode
    for line in dag.outline(root):
        print(line)
    return 0


def cmd_params(args: argparse.Namespace) -> int:
    from flows import params_doc
    from tasks.config.params import load_params
    params = load_params(Path(args.params)) if args.params else None
    lines = params_doc.render(params, args.key or "")
    if not lines:
        raise InputError(f"{args.key}: no such params key (alignloop params lists them all)")
    print("\n".join(lines))
    return 0
