"""How a pairwise LLM judge agrees with the lexicon judge and with gold, on a workspace's own
evaluation pairs (the final policy vs the reference on held-out prompts).

    python -m benchmarks.judge_agreement --workspace WS [--it 2] [--n 100]
        [--model models/iter_0/policy] [--decoding logprob|greedy]

Reads `data/iter_<it>/eval_samples.jsonl` (each row: prompt, policy, reference and the
verdicts the loop's judge and gold gave, policy shown first), asks the `llm` judge (a local
model, `params/judges/pairwise_review.txt`, both orders) about the first N rows, and prints its
invalid, tie and position-bias rates, and how often its verdict matches the lexicon judge's and
gold's among the rows where both are decided (A or B). JSON on the last line. The verdicts are
cached under the workspace, so a second call costs nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

from tasks.config.params import load_params
from tasks.core import jsonl, layout
from tasks.data.records import parse_prompt
from tasks.judging.judge_factory import make_judge
from tasks.judging.judges import judge_pairs, position_flipped


def agreement(ours: Sequence[str], theirs: Sequence[str]) -> dict[str, float]:
    """Share of rows where both verdicts are decided (A/B) and equal, over those rows."""
    both = [(a, b) for a, b in zip(ours, theirs) if a in ("A", "B") and b in ("A", "B")]
    return {"agreement": round(sum(a == b for a, b in both) / len(both), 3) if both else
            float("nan"), "n_decided": len(both)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workspace", type=Path, required=True)
    ap.add_argument("--it", type=int, default=2)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--model", default=layout.policy(0))
    ap.add_argument("--decoding", choices=("logprob", "greedy"), default="logprob")
    args = ap.parse_args()
    ws = args.workspace
    p = load_params(str(ws / layout.PARAMS_FILE))
    jp = dataclasses.replace(p.judge, kind="llm", model=args.model, decoding=args.decoding)
    path = str(ws / layout.eval_samples(args.it))
    rows = [(n, rec) for n, rec in jsonl.read(path)][: args.n]
    items = [(parse_prompt(rec, f"{path}:{n}"), rec["policy"], rec["reference"])
             for n, rec in rows]
    judge = make_judge(jp, ws)
    t0 = time.perf_counter()
    results = judge_pairs(judge, items)
    seconds = time.perf_counter() - t0
    verdicts = [v for v, _, _ in results]
    answered = [(f, r) for _, f, r in results if "invalid" not in (f, r)]
    out = {"workspace": str(ws), "it": args.it, "n": len(items), "judge": judge.version,
           "seconds": round(seconds, 1),
           "rates": {v: round(verdicts.count(v) / len(verdicts), 3)
                     for v in ("A", "B", "tie", "invalid")},
           "position_bias_rate": round(sum(position_flipped(f, r) for f, r in answered)
                                       / max(len(answered), 1), 3),
           "vs_lexicon_judge": agreement(verdicts, [rec["judge_verdict"] for _, rec in rows]),
           "vs_gold": agreement(verdicts, [rec["gold_verdict"] for _, rec in rows]),
           "lexicon_vs_gold": agreement([rec["judge_verdict"] for _, rec in rows],
                                        [rec["gold_verdict"] for _, rec in rows])}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
