"""Calibrate and measure the gold evaluator's review check (tasks/evaluation/genre.py) on
hand-labelled samples.

    python -m benchmarks.calibrate_genre [--labels benchmarks/data/genre_labels.jsonl]
                                         [--params params/default.yaml]

The labelled set holds reference and policy responses from default-profile runs, each labelled
by a person (`label`: review | correspondence | other; `side`, `source` say where it came
from; `split`: dev rows were read while the check was built and its threshold chosen on them,
test rows were labelled after it was fixed and are the honest estimate). `correspondence` is
what the check must catch: a letter, an assistant's reply, a request
for the reader's opinion, a thank-you note. `other` is neither (a biography, a list, noise): the
on-topic and fluency checks are the ones meant for it, so it is reported apart.

Prints, per threshold of the register score (the highest correspondence probability of a
response's sentences), precision and recall of "not a review" against the correspondence
labels on the dev rows, and, as JSON on the last line, the figures at the profile's
`evaluate.gold.review_threshold` on all rows, per side and per split, and the dev threshold
with the best F1.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from tasks.config.params import load_params
from tasks.core import jsonl
from tasks.evaluation.gold import GoldEvaluator

ROOT = Path(__file__).resolve().parent.parent


def precision_recall(flagged: Sequence[bool], positive: Sequence[bool]) -> dict[str, float]:
    tp = sum(f and p for f, p in zip(flagged, positive))
    fp = sum(f and not p for f, p in zip(flagged, positive))
    fn = sum(p and not f for f, p in zip(flagged, positive))
    prec = tp / (tp + fp) if tp + fp else float("nan")
    rec = tp / (tp + fn) if tp + fn else float("nan")
    f1 = 2 * prec * rec / (prec + rec) if tp else 0.0
    return {"precision": round(prec, 3), "recall": round(rec, 3), "f1": round(f1, 3),
            "tp": tp, "fp": fp, "fn": fn}


def at_threshold(rows: Sequence[dict], scores: Sequence[float],
                 t: float) -> dict[str, dict[str, float]]:
    """Precision/recall of flagging register >= t as not-a-review, on review + correspondence
    rows (all and per side), and how many `other` rows it flags."""
    out = {}
    for group in ("all", "reference", "policy", "dev", "test"):
        keep = [i for i, r in enumerate(rows) if r["label"] != "other"
                and group in ("all", r["side"], r["split"])]
        out[group] = precision_recall([scores[i] >= t for i in keep],
                                     [rows[i]["label"] == "correspondence" for i in keep])
    other = [scores[i] >= t for i, r in enumerate(rows) if r["label"] == "other"]
    out["other"] = {"threshold": t, "flagged": sum(other), "n": len(other)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--labels", type=Path, default=ROOT / "benchmarks/data/genre_labels.jsonl")
    ap.add_argument("--params", type=Path, default=ROOT / "params/default.yaml")
    args = ap.parse_args()
    p = load_params(str(args.params)).evaluate.gold
    rows = [rec for _, rec in jsonl.read(str(args.labels))]
    counts = {f"{split}/{side}/{label}":
              sum(1 for r in rows if (r["split"], r["side"], r["label"]) == (split, side, label))
              for split in ("dev", "test") for side in ("reference", "policy")
              for label in ("review", "correspondence", "other")}
    scores = GoldEvaluator(p, ROOT).register_check.register([r["text"] for r in rows])
    grid = [round(0.05 * k, 2) for k in range(4, 20)]
    sweep = [at_threshold(rows, scores, t) for t in grid]
    for t, s in zip(grid, sweep):
        a, o = s["dev"], s["other"]
        print(f"dev, threshold {t:.2f}: precision {a['precision']:.3f} recall {a['recall']:.3f} "
              f"F1 {a['f1']:.3f}; other flagged {o['flagged']}/{o['n']}")
    best = max(sweep, key=lambda s: s["dev"]["f1"])
    print(json.dumps({"n": len(rows), "counts": counts,
                      "configured": at_threshold(rows, scores, p.review_threshold),
                      "best_f1": best}))


if __name__ == "__main__":
    main()
