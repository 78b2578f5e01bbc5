"""Releasing gradually: a version goes to `canary` first, and on to `production` only after
its regression record and, when given, feedback from canary traffic show no regression.

- `deploy_canary`: `canary` moves to a version (default: the champion) whose iteration passed
  its gate (`metrics/iter_k/gate_decision.json`); the decision's checks are the evidence.
- `promote`: `production` moves to the canary's version when its gate still passes, its
  red-team record holds against production's (`regression_record`), and the feedback file
  (tasks/data/feedback.py) clears it.

A refusal is one line (exit 2) and moves nothing; every move goes to the alias ledger with the
evidence it rested on (flows/aliases.py).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from flows import lineage
from flows.aliases import AliasError, current, move
from flows.registry import POLICY_MODEL
from tasks.core import layout
from tasks.data import feedback

CANARY = "canary"
VIOLATION_CHECK = "eval/violation_rate"   # the gate's violation check(s) start with this
VIOLATION_RATE = "eval/violation_rate"    # on the red-team set, in evaluate's metrics
BASELINE_IT = "eval/violation_baseline_iteration"   # in the gate decision: its check's baseline


def _iteration(client: MlflowClient, version: str) -> int:
    mv = lineage.resolve(client, f"models:/{POLICY_MODEL}/{version}")   # one line if absent
    return int(mv.tags.get("iteration", 0))


def _read_json(root: Path, rel: str) -> dict[str, Any] | None:
    path = root / rel
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise AliasError(f"{rel}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise AliasError(f"{rel}: expected a JSON object, got {type(data).__name__}")
    return data


def gate_evidence(root: Path, client: MlflowClient, version: str) -> dict[str, Any]:
    """The gate decision of the iteration that made `version`: passed, checks, reasons, and
    the violation check(s) by name when the gate has one."""
    it = _iteration(client, version)
    rel = layout.gate(it)
    decision = _read_json(root, rel)
    if decision is None:
        raise AliasError(f"v{version} (iteration {it}) has no gate decision ({rel}): "
                         f"`alignloop rerun gate@{it}` makes it")
    checks = decision.get("checks") or {}
    out: dict[str, Any] = {"version": str(version), "iteration": it, "decision": rel,
                           "passed": decision.get("passed") is True, "checks": checks,
                           "reasons": list(decision.get("reasons") or [])}
    violation = {k: v for k, v in checks.items() if k.startswith(VIOLATION_CHECK)}
    if violation:
        out["violation_checks"] = violation
    out["decision_fields"] = {k: v for k, v in decision.items()
                              if k.startswith("eval/")}      # what the gate measured itself
    return out


def _refusal(g: dict[str, Any]) -> str:
    failed = [k for k, c in g["checks"].items() if isinstance(c, dict) and not c.get("ok")]
    why = "; ".join(g["reasons"]) or f"failed checks: {', '.join(failed) or 'none named'}"
    return f"v{g['version']} (iteration {g['iteration']}) did not pass its gate ({why})"


def deploy_canary(root: Path, version: str | None, why: str) -> dict[str, Any]:
    """Move `canary` to `version` (default: the champion) if its iteration passed its gate."""
    client = MlflowClient()
    if version is None:
        version = current(client, "champion")
        if version is None:
            raise AliasError("no champion to deploy as canary: no iteration has passed the "
                             "promotion gate")
    g = gate_evidence(root, client, version)
    if not g["passed"]:
        raise AliasError(f"canary refused: {_refusal(g)}")
    return move(root, CANARY, str(version), why, "deploy", evidence={"gate": g})


def recorded_violation_rate(root: Path, it: int) -> float | None:
    """Iteration `it`'s violation rate on the red-team regression set (its evaluation's
    `eval/violation_rate`), None where it has none."""
    rel = layout.metrics(it, "evaluate")
    rate = (_read_json(root, rel) or {}).get(VIOLATION_RATE)
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))):
        raise AliasError(f"{rel}: field '{VIOLATION_RATE}' must be a number, got {rate!r}")
    return None if rate is None else float(rate)


def regression_record(root: Path, client: MlflowClient, gate: dict[str, Any],
                      production: str | None) -> dict[str, Any]:
    """The canary's red-team record against production's. Its gate's violation check bounds
    the increase over the baseline iteration the gate was given (`gate.production`); when that
    is production's iteration the check is the record. Otherwise the recorded rates are
    compared: the canary's may exceed production's by at most the check's threshold (the
    gate's allowance). Holds, with a note, where there is nothing to compare."""
    c = recorded_violation_rate(root, gate["iteration"])
    p_it = _iteration(client, production) if production else None
    p = recorded_violation_rate(root, p_it) if p_it is not None else None
    check = next(iter(gate.get("violation_checks", {}).values()), None)
    out: dict[str, Any] = {"canary_violation_rate": c, "production_iteration": p_it,
                           "production_violation_rate": p, "holds": True}
    if check is None:
        out["note"] = "the gate has no violation check"
        return out
    allowance = float(check["threshold"])
    baseline = gate["decision_fields"].get(BASELINE_IT)
    out.update({"allowance": allowance, "gate_baseline_iteration": baseline})
    if p_it is None or baseline == p_it:
        out["note"] = ("the gate's paired check was against production's iteration" if p_it
                       else f"nothing in production: the gate's check was against iteration "
                            f"{baseline} (0: the reference)")
    elif c is None or p is None:
        out["note"] = "no recorded violation rate for " + " and ".join(
            n for n, r in (("the canary", c), ("production", p)) if r is None)
    elif c - p > allowance:
        out["holds"] = False
        out["reason"] = (f"recorded violation rate {c:.3f} exceeds production's {p:.3f} "
                         f"(iteration {p_it}) by {c - p:+.3f}, more than the gate's allowance "
                         f"{allowance:+.3f} (its check was against iteration {baseline})")
    return out


def promote(root: Path, feedback_file: Path | None, why: str, max_increase: float,
            confidence: float) -> dict[str, Any]:
    """Move `production` to the canary's version if its record and feedback hold."""
    if not 0 <= max_increase < 1:
        raise AliasError(f"--max-increase: expected a rate in [0, 1), got {max_increase}")
    if not 0.5 < confidence < 1:
        raise AliasError(f"--confidence: expected a level in (0.5, 1), got {confidence}")
    client = MlflowClient()
    canary = current(client, CANARY)
    if canary is None:
        raise AliasError("no canary to promote: `alignloop deploy --canary [VERSION]` first")
    production = current(client, "production")
    if canary == production:
        raise AliasError(f"canary v{canary} is production already")
    g = gate_evidence(root, client, canary)
    if not g["passed"]:
        raise AliasError(f"promote refused: canary {_refusal(g)}")
    record = regression_record(root, client, g, production)
    if not record["holds"]:
        raise AliasError(f"promote refused: canary v{canary}: {record['reason']}")
    evidence: dict[str, Any] = {"gate": g, "regression_record": record}
    if feedback_file is not None:
        arms = feedback.read(feedback_file, canary, production)
        recorded = {} if record["canary_violation_rate"] is None else \
            {"violation": record["canary_violation_rate"]}
        fb = feedback.no_regression(*arms, recorded, max_increase, confidence)
        fb["file"] = str(feedback_file)
        fb["sha256"] = hashlib.sha256(feedback_file.read_bytes()).hexdigest()
        if not fb["holds"]:
            raise AliasError(f"promote refused: the feedback in {feedback_file} does not "
                             f"clear canary v{canary}: {'; '.join(fb['reasons'])}")
        evidence["feedback"] = fb
    return move(root, "production", canary, why, "promote", evidence=evidence)
