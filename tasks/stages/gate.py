"""Stage `gate`: the promotion decision for an iteration's policy, from its evaluation.

Pure: metrics and thresholds in, a decision with its reasons out. The flow applies it (the MLflow
alias `champion`); the decision itself is a declared, versioned artifact.

One comparison is made here rather than in `evaluate`: the candidate's responses to the red-team
regression set against the baseline's, production's (`gate.production`, an iteration whose
`evaluate` stored them) or the reference's (0) before anything is in production
(tasks/evaluation/redteam.py). Which iteration is in production is a param of the gate alone, so
releasing one re-decides the gates without re-evaluating any policy; its figures are written at
the top of the decision, beside the checks.
"""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

import json
from pathlib import Path
from typing import Any

from tasks.config.params import Params
from tasks.core import atomic, layout
from tasks.core.jsonl import DataError
from tasks.evaluation import redteam
from tasks.evaluation.violations import read_probes
from tasks.schemas.gate import GateParams

CONTRACT = stage.Contract(
    "gate", params=("seed", "evaluate.bootstrap", "evaluate.redteam.prompts_file", "gate"),
    deps=lambda it, prev: (layout.metrics(it, "evaluate"), "${evaluate.redteam.prompts_file}",
                           layout.redteam_samples(it),
                           layout.redteam_samples("${gate.production}")),
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
    if p.max_violation_increase >= 0:   # no worse than the baseline on the red-team set
        checks["eval/violation_rate_increase_ci_high <= max_violation_increase"] = (
            metrics.get("eval/violation_rate_increase_ci_high"), p.max_violation_increase,
            lambda v, t: v <= t)
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
    red = against_production(args.params, args.root, args.it)
    decision = {"iteration": args.it, **red, **decide({**metrics, **red}, args.params.gate)}
    atomic.write_json(args.root / layout.gate(args.it), decision)
    verdict = "passed" if decision["passed"] else "failed: " + "; ".join(decision["reasons"])
    stage.say(f"gate@{args.it}: {verdict}")


def against_production(p: Params, root: Path, it: int) -> dict[str, float]:
    """The candidate's red-team responses against the baseline's (tasks/evaluation/redteam.py)."""
    probes = read_probes(root / p.evaluate.redteam.prompts_file)
    cand = redteam.read(root / layout.redteam_samples(it), probes)
    base = redteam.read(root / layout.redteam_samples(p.gate.production), probes)
    return redteam.against_baseline(probes, cand, base, p.gate.production, p.evaluate.bootstrap,
                                    p.seed)


if __name__ == "__main__":
    stage.run_main(lambda: main())
