"""The report's data: per-iteration metrics read from the files the stages wrote (metrics, gate
decisions), as rows, and what is computed across them (the judge-gold divergence). The page
(tasks/evaluation/report.py) and its plots (tasks/evaluation/report_plots.py) both read these;
neither imports the other for them.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tasks.core import layout
from tasks.core.jsonl import DataError

JUDGE, GOLD = "eval/win_rate", "eval/gold_win_rate"
Row = dict[str, Any]
DIVERGENCE_EPS = 0.01            # a win-rate change below this is "did not rise"


def collect_report(root: Path) -> dict[str, dict[str, Any]]:
    """Per-iteration metrics from the metrics files that DVC tracks ("0": off-policy)."""
    out: dict[str, dict[str, Any]] = {}
    offpolicy = root / layout.OFFPOLICY_METRICS
    if offpolicy.is_file():
        out["0"] = read_json(offpolicy)
    for d in sorted((root / layout.METRICS_DIR).glob("iter_*"), key=lambda p: int(p.name[5:])):
        merged: dict[str, Any] = {}
        for f in sorted(d.glob("*.json")):
            merged.update(read_json(f))
        out[d.name[5:]] = with_intervals(merged)
    return out


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a JSON object ({e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: not a JSON object (a {type(data).__name__})")
    return data


def with_intervals(m: dict[str, Any]) -> dict[str, Any]:
    """Each `X_ci_low` / `X_ci_high` pair also as `X_ci`: [low, high] (e.g. eval/win_rate_ci)."""
    out = dict(m)
    for key in m:
        if key.endswith("_ci_low") and key.removesuffix("_low") + "_high" in m:
            base = key.removesuffix("_low")
            out[base] = [m[key], m[base + "_high"]]
    return out


def load_rows(root: Path) -> list[Row]:
    """One row per iteration >= 1: its namespaced numeric metrics, `iteration` and `gate`."""
    rows = []
    for key, merged in collect_report(root).items():
        if key == "0":
            continue
        it = int(key)
        row: Row = {k: v for k, v in merged.items()
                    if "/" in k and isinstance(v, (int, float)) and not isinstance(v, bool)}
        gate = root / layout.gate(it)
        row["iteration"], row["gate"] = it, read_json(gate) if gate.is_file() else None
        rows.append(row)
    return rows


def value(row: Mapping[str, Any], key: str) -> float | None:
    """The metric as a float, or None when absent or NaN."""
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and v == v else None


def judge_gold_divergence(rows: Sequence[Mapping[str, Any]],
                          eps: float = DIVERGENCE_EPS) -> list[int]:
    """Iterations whose judge win rate rose by more than `eps` over the previous evaluated
    iteration's while the gold win rate did not (rose by less than `eps`, or fell): the loop
    gains on the judge, not on the task (reward hacking). A pair of rows lacking either win
    rate is not judged."""
    ordered = sorted(rows, key=lambda r: r["iteration"])
    out = []
    for prev, cur in zip(ordered, ordered[1:]):
        pj, pg, cj, cg = (value(r, k) for r in (prev, cur) for k in (JUDGE, GOLD))
        if None in (pj, pg, cj, cg):
            continue
        if cj - pj > eps and cg - pg < eps:        # type: ignore[operator]
            out.append(int(cur["iteration"]))
    return out
