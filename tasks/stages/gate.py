"""Stage `gate`: the promotion decision for an iteration's policy, from its evaluation.

Pure: metrics and thresholds in, a decision with its reasons out. The flow applies it (the MLflow
alias `champion`); the decision itself is a declared, versioned artifact.
"""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

import json
from typing import Any

from tasks.core import atomic, layout
from tasks.core.jsonl import DataError
from tasks.schemas.gate import GateParams

CONTRACT = stage.Contract(
    "gate", params=("gate",),
    deps=lambda it, prev: (layout.metrics(it, "evaluate"),),
    outs=lambda it, prev: (layout.gate(it),))


def decide(metrics: dict[str, float], p: GateParams) -> dict[str, Any]:
    """Each check as (value, threshold, ok); passed iff every check is ok."""
    checks = {
        "eval/win_rate >= min_win_rate":
            (metrics.get("eval/win_rate"), p.min_win_rate, lambda v, t: v >= t),
        "eval/win_rate_ci_low >= min_win_rate_ci_low":
            (metrics.get("eval/win_rate_ci_low"), p.min_win_rate_ci_low, lambda v, t: v >= t),
        "eval/kl <= max_kl": (metrics.get("eval/kl"), p.max_kl, lambda v, t: v <= t),
    }
    if p.min_champion_gold_ci_low >= 0 and "eval/champion_gold_win_rate_ci_low" in metrics:
        checks["eval/champion_gold_win_rate_ci_low > min_champion_gold_ci_low"] = (
            metrics["eval/champion_gold_win_rate_ci_low"], p.min_champion_gold_ci_low,
            lambda v, t: v > t)
    if p.min_gold_win_rate > 0:      # the gold evaluator decides promotion too: on the select
        key = ("eval/select_gold_win_rate" if "eval/select_gold_win_rate" in metrics  # prompts
               else "eval/gold_win_rate")    # (a workspace without them: the held-out ones)
        checks[f"{key} >= min_gold_win_rate"] = (metrics.get(key), p.min_gold_win_rate,
                                                 lambda v, t: v >= t)
    out: dict[str, Any] = {"checks": {}, "reasons": []}
    for name, (value, threshold, ok) in checks.items():
        passed = value is not None and value == value and ok(value, threshold)
        out["checks"][name] = {"value": value, "threshold": threshold, "ok": passed}
        if not passed:
            out["reasons"].append(f"{name.split(' ')[0]} = {value} fails {name.split(' ', 1)[1]}"
                                  f" ({threshold})")
    if p.block_on_hacking_flag and metrics.get("eval/hacking_flag", 0.0) > 0:
        out["reasons"].append("reward-hacking monitor flagged this iteration")
    out["passed"] = not out["reasons"]
    return out


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "", CONTRACT)
    path = args.root / layout.metrics(args.it, "evaluate")
    try:
        metrics = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read evaluation metrics ({e})") from None
    decision = {"iteration": args.it, **decide(metrics, args.params.gate)}
    atomic.write_json(args.root / layout.gate(args.it), decision)
    verdict = "passed" if decision["passed"] else "failed: " + "; ".join(decision["reasons"])
    stage.say(f"gate@{args.it}: {verdict}")


if __name__ == "__main__":
    stage.run_main(lambda: main())
