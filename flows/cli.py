"""`alignloop`: run the loop, show each stage's state, report per-iteration metrics."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from flows import workspace as wsmod
from tasks.errors import InputError

DEFAULT_WORKSPACE = "workspace"
DEFAULT_PARAMS = wsmod.PROJECT_ROOT / "params" / "default.yaml"


def cmd_run(args: argparse.Namespace) -> int:
    params = Path(args.params) if args.params else None
    root = Path(args.workspace)
    if params is None and not (root / "params.yaml").is_file():
        params = DEFAULT_PARAMS
    ws, changed = wsmod.prepare(root, params)
    wsmod.apply_environment(ws)
    print(f"workspace {ws.root}" + (f" (synced: {', '.join(changed)})" if changed else ""))
    _quiet_prefect()
    from flows.pipeline import alignloop
    t0 = time.perf_counter()
    summaries = alignloop(str(ws.root))
    ran = [s["name"] for it in summaries for s in it["stages"] if s["outcome"] != "cached"]
    total = sum(len(it["stages"]) for it in summaries)
    print(f"done in {time.perf_counter() - t0:.1f} s: {len(ran)} of {total} stages "
          f"{'ran or were restored' if ran else 'ran; everything was cached'}")
    for it in summaries:
        if it.get("policy_version"):
            print(f"  iteration {it['iteration']}: policy v{it['policy_version']}, "
                  f"reward model v{it['reward_model_version']}, commit {it['git_commit'][:10]}")
    _print_report(ws.root)
    return 0


def _quiet_prefect() -> None:
    """Prefect's ephemeral server prints CancelledError tracebacks on shutdown: harmless,
    and confusing to users, so those loggers are quieted."""
    import os
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    for name in ("uvicorn", "uvicorn.error", "prefect.server", "asyncio", "httpx"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def cmd_status(args: argparse.Namespace) -> int:
    from flows import dag
    root = Path(args.workspace).resolve()
    wsmod.apply_environment(wsmod.Workspace(root))
    states = dag.stage_states(root)
    if args.json:
        print(json.dumps([{"stage": s.name, "state": s.state, "reasons": s.reasons}
                          for s in states], indent=2))
    else:
        for s in states:
            why = f"  ({'; '.join(s.reasons)})" if s.reasons else ""
            print(f"{s.state:<11} {s.name}{why}")
    return 0 if all(s.state == "up-to-date" for s in states) else 1


def collect_report(root: Path) -> dict[str, dict[str, float]]:
    """Per-iteration metrics from the metrics files that DVC tracks."""
    out: dict[str, dict[str, float]] = {}
    offpolicy = root / "metrics" / "offpolicy.json"
    if offpolicy.is_file():
        out["0"] = json.loads(offpolicy.read_text())
    for d in sorted((root / "metrics").glob("iter_*"), key=lambda p: int(p.name[5:])):
        merged: dict[str, float] = {}
        for f in sorted(d.glob("*.json")):
            merged.update(json.loads(f.read_text()))
        out[d.name[5:]] = merged
    return out


REPORT_KEYS = ("eval/win_rate", "eval/win_rate_ci_low", "eval/win_rate_ci_high",
               "eval/rm_win_rate", "eval/kl", "eval/length_ratio", "rm/accuracy",
               "judge/n_pairs")


def _print_report(root: Path) -> None:
    report = collect_report(root)
    rows = [(k, v) for k, v in report.items() if k != "0"]
    if not rows:
        return
    print("iteration  " + "  ".join(f"{k:>20}" for k in REPORT_KEYS))
    for it, m in rows:
        print(f"{it:>9}  " + "  ".join(f"{m.get(k, float('nan')):>20.3f}" for k in REPORT_KEYS))


def cmd_report(args: argparse.Namespace) -> int:
    root = Path(args.workspace).resolve()
    if args.json:
        print(json.dumps(collect_report(root), indent=2, sort_keys=True))
    else:
        _print_report(root)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="alignloop", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the loop (creates the workspace if needed)")
    run.add_argument("--params", help="params profile (default: the workspace's params.yaml, "
                                      "or params/default.yaml for a new workspace)")
    run.add_argument("--workspace", default=DEFAULT_WORKSPACE, help="workspace directory")
    run.set_defaults(func=cmd_run)
    for name, func, text in (("status", cmd_status, "state of every stage instance, from DVC"),
                             ("report", cmd_report, "per-iteration metrics")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--workspace", default=DEFAULT_WORKSPACE, help="workspace directory")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from flows.dag import StageFailed
    try:
        code = args.func(args)
    except (InputError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except StageFailed as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    raise SystemExit(code)


if __name__ == "__main__":
    main()
