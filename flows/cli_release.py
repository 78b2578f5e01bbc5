"""The CLI's release commands: `deploy` (production, or with --canary the canary), `promote`
(canary to production, on its evidence) and `rollback`."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flows import workspace as wsmod


def _evidence_line(e: dict[str, Any]) -> str:
    """What a release move rested on, in a few words."""
    ev = e.get("evidence") or {}
    parts = []
    if "gate" in ev:
        g = ev["gate"]
        parts.append(f"gate@{g['iteration']} passed ({len(g['checks'])} checks"
                     + (f"; {', '.join(g['violation_checks'])}" if "violation_checks" in g
                        else "") + ")")
    rec = ev.get("regression_record")
    if rec and rec.get("canary_violation_rate") is not None:
        parts.append(f"recorded violation rate {rec['canary_violation_rate']:.3f}")
    fb = ev.get("feedback")
    if fb:
        arms = ", ".join(f"{name} {c['canary'][0]}/{c['canary'][1]}"
                         f" (upper bound of the increase {c['interval'][1]:+.3f})"
                         for name, c in fb["checks"].items())
        parts.append(f"feedback {fb['canary']['responses']} canary / "
                     f"{fb['production']['responses']} production responses: {arms}")
    return "; ".join(parts)


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows import aliases, release
    root = wsmod.existing_workspace(args.workspace).root
    if args.canary:
        e = release.deploy_canary(root, args.version, args.reason)
    else:
        e = aliases.deploy(root, args.version, args.reason)
    print(f"{e['alias']}: v{e['from']} -> v{e['to']} ({e['who']}, {e['time']}: {e['why']})"
          + (f"\n  evidence: {_evidence_line(e)}" if "evidence" in e else ""))
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    from flows import release
    root = wsmod.existing_workspace(args.workspace).root
    fb = Path(args.feedback) if args.feedback else None
    e = release.promote(root, fb, args.reason, args.max_increase, args.confidence)
    print(f"production promoted: v{e['from']} -> v{e['to']} (the canary; {e['who']}, "
          f"{e['time']}: {e['why']})\n  evidence: {_evidence_line(e)}")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from flows import aliases
    root = wsmod.existing_workspace(args.workspace).root
    e = aliases.rollback(root, args.reason)
    print(f"production rolled back: v{e['from']} -> v{e['to']} ({e['who']}, {e['time']})")
    return 0


def add_parsers(sub: argparse._SubParsersAction, default_workspace: str) -> None:
    dep = sub.add_parser("deploy", help="move the `production` alias (default: the champion), "
                                        "or with --canary the `canary` alias")
    dep.add_argument("version", nargs="?")
    dep.add_argument("--canary", action="store_true",
                     help="move `canary` instead, only to a version whose iteration passed "
                          "its gate (the decision's checks go to the ledger)")
    dep.add_argument("--reason", default="deploy", help="why (recorded with the move)")
    dep.add_argument("--workspace", default=default_workspace)
    dep.set_defaults(func=cmd_deploy)
    pr = sub.add_parser("promote", help="move `production` to the canary's version if its "
                                        "gate, its violation record and canary traffic "
                                        "show no regression")
    pr.add_argument("--feedback", metavar="FILE",
                    help="JSONL of served responses: {\"version\", \"violation\": bool, "
                         "\"rating\": \"up\"|\"down\"} (docs/operations.md)")
    pr.add_argument("--max-increase", type=float, default=0.02, metavar="RATE",
                    help="how much higher than production's the canary's violation and "
                         "dislike rates may be, at the upper confidence bound (default 0.02)")
    pr.add_argument("--confidence", type=float, default=0.95,
                    help="the one-sided confidence of that bound (default 0.95)")
    pr.add_argument("--reason", default="promote", help="why (recorded with the move)")
    pr.add_argument("--workspace", default=default_workspace)
    pr.set_defaults(func=cmd_promote)
    rb = sub.add_parser("rollback", help="move `production` back to its previous version")
    rb.add_argument("--reason", default="rollback", help="why (recorded with the move)")
    rb.add_argument("--workspace", default=default_workspace)
    rb.set_defaults(func=cmd_rollback)
