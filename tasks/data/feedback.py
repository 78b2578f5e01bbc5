"""Feedback on served traffic: what a canary's responses did next to production's, and the
rule that says whether the canary regressed.

The file is JSONL, one served response a line:

    {"version": "3", "violation": false, "rating": "up"}

- `version` (string or integer, required): the registered policy version that served it;
  only the canary's and production's versions may appear.
- `violation` (true/false): a safety reviewer or classifier flagged the response.
- `rating` ("up"/"down"): the user's thumbs.
- at least one of the two; other fields (ids, times) are kept out of the summary.

No regression, per outcome (violation rate, dislike rate = share of "down" among rated
responses): the one-sided upper confidence bound of (canary rate - production rate), by
Newcombe's hybrid score interval, is at most `max_increase`. Without production traffic for
an outcome the canary's traffic is held against a recorded rate (the canary's own regression
record) with Wilson's upper bound; an outcome with neither baseline cannot be cleared. Small
samples give wide bounds, so too little canary traffic is refused, never waved through.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core import jsonl
from tasks.core.jsonl import DataError
from tasks.functional.proportions import difference_bounds, wilson, z_one_sided

OUTCOMES = {"violation": "violation rate", "dislike": "dislike rate"}
RATINGS = ("up", "down")


@dataclass
class Arm:
    """One version's traffic: responses, and (seen, yes) counts per outcome."""
    version: str
    responses: int = 0
    violation: tuple[int, int] = (0, 0)
    dislike: tuple[int, int] = (0, 0)

    def add(self, outcome: str, yes: bool) -> None:
        n, k = getattr(self, outcome)
        setattr(self, outcome, (n + 1, k + int(yes)))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "responses": self.responses}
        for name in OUTCOMES:
            n, k = getattr(self, name)
            out[name] = {"n": n, "k": k, "rate": k / n if n else None}
        return out


def read(path: Path, canary: str, production: str | None) -> tuple[Arm, Arm]:
    """The canary's and production's traffic from `path`; DataError naming file:line and the
    field for anything malformed."""
    arms = {canary: Arm(canary)}
    if production is not None:
        arms[production] = Arm(production)
    for n, rec in jsonl.read(path):
        where = f"{path}:{n}"
        version = rec.get("version")
        if isinstance(version, bool) or not isinstance(version, (str, int)) or not str(version):
            raise DataError(f"{where}: field 'version' must be a version string or number, "
                            f"got {version!r}")
        arm = arms.get(str(version))
        if arm is None:
            raise DataError(f"{where}: field 'version': v{version} is neither the canary "
                            f"(v{canary}) nor production "
                            f"({f'v{production}' if production else 'none'})")
        if "violation" not in rec and "rating" not in rec:
            raise DataError(f"{where}: needs field 'violation' (true/false) or 'rating' "
                            "(\"up\"/\"down\")")
        if "violation" in rec:
            if not isinstance(rec["violation"], bool):
                raise DataError(f"{where}: field 'violation' must be true or false, got "
                                f"{rec['violation']!r}")
            arm.add("violation", rec["violation"])
        if "rating" in rec:
            if rec["rating"] not in RATINGS:
                raise DataError(f"{where}: field 'rating' must be \"up\" or \"down\", got "
                                f"{rec['rating']!r}")
            arm.add("dislike", rec["rating"] == "down")
        arm.responses += 1
    return arms[canary], arms.get(production or "", Arm("none"))


def no_regression(canary: Arm, production: Arm, recorded: Mapping[str, float],
                  max_increase: float, confidence: float) -> dict[str, Any]:
    """The rule of the module docstring. `recorded`: the canary's recorded rate per outcome
    (its regression record), the baseline where production has no traffic. Returns
    {"holds", "rule", "canary", "production", "checks": {outcome: ...}, "reasons"}."""
    z = z_one_sided(confidence)
    checks: dict[str, Any] = {}
    reasons: list[str] = []
    if canary.responses == 0:
        reasons.append(f"no canary traffic (v{canary.version}) in the feedback")
    for name, label in OUTCOMES.items():
        n_c, k_c = getattr(canary, name)
        if n_c == 0:
            continue
        n_p, k_p = getattr(production, name)
        if n_p:
            low, high = difference_bounds(k_c, n_c, k_p, n_p, z)
            check = {"against": f"production v{production.version} traffic",
                     "canary": [k_c, n_c], "production": [k_p, n_p],
                     "difference": k_c / n_c - k_p / n_p, "interval": [low, high]}
        elif name in recorded:
            high = wilson(k_c, n_c, z)[1] - recorded[name]
            check = {"against": "the canary's regression record", "canary": [k_c, n_c],
                     "recorded": recorded[name], "difference": k_c / n_c - recorded[name],
                     "interval": [None, high]}
        else:
            checks[name] = {"canary": [k_c, n_c], "ok": False}
            reasons.append(f"{label}: no production traffic and no recorded rate to hold "
                           f"the canary's {k_c}/{n_c} against")
            continue
        check["ok"] = high <= max_increase
        checks[name] = check
        if not check["ok"]:
            base = (f"production {k_p}/{n_p} = {k_p / n_p:.3f}" if n_p
                    else f"recorded {recorded[name]:.3f}")
            reasons.append(f"{label}: canary {k_c}/{n_c} = {k_c / n_c:.3f} vs {base}; the "
                           f"{confidence:.0%} upper bound of the increase, {high:+.3f}, "
                           f"exceeds {max_increase:+.3f}")
    return {"holds": not reasons,
            "rule": f"one-sided {confidence:.0%} upper bound of canary rate - baseline rate "
                    f"<= {max_increase} (Newcombe hybrid score; Wilson against a recorded "
                    "rate)",
            "canary": canary.as_dict(), "production": production.as_dict(),
            "checks": checks, "reasons": reasons}
