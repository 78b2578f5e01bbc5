"""Measure the violation checker (tasks/evaluation/violations.py) on hand-labelled responses.

    python -m benchmarks.violation_checker [--labels params/redteam/labelled.jsonl]
                                           [--prompts params/redteam/prompts.jsonl] [--seed 0]

Each labelled row is a response written by a person to a prompt of the red-team regression set,
labelled `clean` or with the violation kind it shows (`split`: dev rows were read while the
rules were written and revised; test rows were written after the rules were fixed and are the
honest estimate). Positive = any violation. Prints, per split, precision and recall with 95%
bootstrap intervals over rows (seeded), recall per kind, how often a caught violation is given
its labelled kind, the rows it gets wrong, and, as JSON on the last line, the row it appends to
benchmarks/results/violation_checker.jsonl (commit, CPU model, the test split's figures, seed).
"""
from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tasks.core import jsonl
from tasks.evaluation.violations import KINDS, check, read_probes

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks/results/violation_checker.jsonl"


def cpu_model() -> str:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("Model name")), "unknown")


def precision_recall(flagged: np.ndarray, positive: np.ndarray) -> tuple[float, float]:
    tp = float((flagged & positive).sum())
    return (tp / flagged.sum() if flagged.sum() else float("nan"),
            tp / positive.sum() if positive.sum() else float("nan"))


def measure(rows: Sequence[dict], found: Sequence[tuple[str, ...]], n_boot: int,
            seed: int) -> dict[str, object]:
    """Precision and recall of 'any violation' with 95% bootstrap intervals over rows, recall
    per labelled kind, and the share of caught violations given their labelled kind."""
    flagged = np.array([bool(f) for f in found])
    positive = np.array([r["label"] != "clean" for r in rows])
    prec, rec = precision_recall(flagged, positive)
    rng = np.random.default_rng(seed)
    boots = [precision_recall(flagged[i], positive[i])
             for i in rng.integers(0, len(rows), size=(n_boot, len(rows)))]
    (p_lo, r_lo), (p_hi, r_hi) = np.nanpercentile(np.array(boots), [2.5, 97.5], axis=0)
    caught = [(r["label"], f) for r, f in zip(rows, found) if r["label"] != "clean" and f]
    per_kind = {k: round(float(np.mean([bool(f) for r, f in zip(rows, found)
                                        if r["label"] == k])), 3)
                for k in KINDS if any(r["label"] == k for r in rows)}
    return {"n": len(rows), "violations": int(positive.sum()), "clean": int((~positive).sum()),
            "precision": round(prec, 3), "precision_ci": [round(float(x), 3) for x in (p_lo, p_hi)],
            "recall": round(rec, 3), "recall_ci": [round(float(x), 3) for x in (r_lo, r_hi)],
            "recall_per_kind": per_kind,
            "kind_agreement": round(sum(k in f for k, f in caught) / max(len(caught), 1), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--labels", type=Path, default=ROOT / "params/redteam/labelled.jsonl")
    ap.add_argument("--prompts", type=Path, default=ROOT / "params/redteam/prompts.jsonl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bootstrap", type=int, default=2000)
    args = ap.parse_args()
    probes = {p.prompt_id: p for p in read_probes(args.prompts)}
    rows = [rec for _, rec in jsonl.read(str(args.labels))]
    found = [check(r["text"], probes[r["prompt_id"]]) for r in rows]
    out: dict[str, object] = {}
    for split in ("dev", "test", "all"):
        keep = [i for i, r in enumerate(rows) if split in ("all", r["split"])]
        m = measure([rows[i] for i in keep], [found[i] for i in keep], args.bootstrap, args.seed)
        out[split] = m
        print(f"{split}: {m['n']} responses ({m['violations']} violations): precision "
              f"{m['precision']:.3f} {m['precision_ci']}, recall {m['recall']:.3f} "
              f"{m['recall_ci']}; recall per kind {m['recall_per_kind']}; kind agreement "
              f"{m['kind_agreement']:.3f}")
        for i in keep:
            wrong = bool(found[i]) != (rows[i]["label"] != "clean")
            if wrong and split != "all":
                print(f"  {'missed' if not found[i] else 'false alarm'} ({rows[i]['label']}, "
                      f"found {list(found[i])}): {rows[i]['text']}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    test = out["test"]
    assert isinstance(test, dict)
    row = {"commit": commit, "cpu": cpu_model(), "precision": test["precision"],
           "recall": test["recall"], "precision_ci": test["precision_ci"],
           "recall_ci": test["recall_ci"], "n": test["n"], "seed": args.seed,
           "dev": {k: out["dev"][k] for k in ("n", "precision", "recall")}}  # type: ignore[index]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
