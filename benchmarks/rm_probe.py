"""How the reward model reads a response: last token vs mean of the response's states, probe
vs fine-tuning, and how many backbone blocks, on one workspace's own judged rollouts.

    python -m benchmarks.rm_probe --workspace WS [--it 1] [--blocks 6,12,30] [--finetune]

Builds the reward model's pairs from `data/iter_<it>/rollouts.jsonl` exactly as the judge stage
does with the workspace's params (`judge.pool_pairs`, `pool_margin`), splits them by prompt as
`train_rm` does, and prints held-out pairwise accuracy and seconds for: a probe head (L2 logistic
regression on frozen features, `train_rm.probe_l2`) on last-token and on mean-pooled states at
each block count; with --finetune also the whole RM fine-tuned on the last token for one epoch
(`train_rm.lr`, `batch_size`), which takes minutes. JSON on the last line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from tasks.config.params import TrainRMParams, load_params
from tasks.core import jsonl, layout
from tasks.data.records import parse_rollout
from tasks.judging.judge_factory import make_judge
from tasks.judging.labelling import judge_groups, pool_margin, rollout_groups
from tasks.models import lm
from tasks.reward.probe import fit_probe_head
from tasks.reward.reward_model import (
    RewardEnsemble,
    encode_pairs,
    ensemble_metrics,
    heldout_split,
    init_reward_model,
    train_reward,
)
from tasks.runtime import stage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workspace", type=Path, required=True)
    ap.add_argument("--it", type=int, default=1)
    ap.add_argument("--blocks", default="6,12,30", help="backbone blocks kept (0 or 30: all)")
    ap.add_argument("--finetune", action="store_true")
    args = ap.parse_args()
    ws = args.workspace
    p = load_params(str(ws / layout.PARAMS_FILE))
    path = str(ws / layout.rollouts(args.it))
    rollouts = [parse_rollout(rec, path, n) for n, rec in jsonl.read(path)]
    margin = pool_margin(dataclasses.replace(p.judge, pool_pairs="all"))
    _, pool, _ = judge_groups(make_judge(p.judge), rollout_groups(rollouts, args.it),
                              f"iter_{args.it}", p.judge.pairs_per_prompt, margin)
    backbone = ws / layout.policy(0)
    tok = lm.load_tokenizer(backbone)
    train, held = heldout_split(pool, p.train_rm.heldout_fraction)
    enc = [encode_pairs(tok, x, p.model.max_prompt_tokens, p.train_rm.max_length)
           for x in (train, held)]
    pad = tok.pad_token_id
    results: list[dict[str, object]] = []

    def measure(name: str, blocks: int, rp: TrainRMParams, fit: str) -> None:
        t0 = time.perf_counter()
        model = init_reward_model(backbone, stage.generator(p.seed, 2, args.it, 0, 0), blocks)
        if fit == "probe":
            fit_probe_head(model, enc[0], rp, pad)
        else:
            train_reward(model, enc[0], rp, pad, stage.generator(p.seed, 2, args.it, 0, 1))
        m, _ = ensemble_metrics(RewardEnsemble([model], rp.precision, rp.pooling), enc[0],
                                enc[1], pad)
        row = {"variant": name, "blocks": blocks, "heldout_accuracy": round(m["rm/accuracy"], 3),
               "train_accuracy": round(m["rm/train_accuracy"], 3),
               "seconds": round(time.perf_counter() - t0, 1)}
        print(row, flush=True)
        results.append(row)

    for blocks in (int(b) for b in args.blocks.split(",")):
        for pooling in ("last", "mean"):
            rp = dataclasses.replace(p.train_rm, pooling=pooling, head_init="probe", epochs=0)
            measure(f"probe, {pooling}", blocks, rp, "probe")
    if args.finetune:
        rp = dataclasses.replace(p.train_rm, pooling="last", head_init="random", epochs=1)
        measure("fine-tune 1 epoch, last", p.train_rm.num_layers, rp, "finetune")
    print(json.dumps({"workspace": str(ws), "it": args.it, "pairs_train": len(train),
                      "pairs_heldout": len(held), "results": results}))


if __name__ == "__main__":
    main()
