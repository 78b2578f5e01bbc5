"""The reward model's probe at every backbone depth, on one workspace's own pair pool: which
blocks' mean states read the judge's preference best, and what `num_layers_grid`'s
cross-validation would pick among them.

    python -m benchmarks.rm_depth --workspace WS [--it 2] [--depths 1-30 | 12,16,20,24]

Reads `data/iter_<it>/pairs_pool.jsonl` (what `train_rm@<it>` trains on, audit verdicts not
applied), splits it by prompt as `train_rm` does, computes every depth's features in one pass
through the initial model (`features_at_depths`) and prints per depth: the L2 the CV picks, the
CV log-loss and accuracy over the training prompts, and the held-out accuracy (read only here,
never by the choice). JSON on the last line.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tasks.config.params import load_params
from tasks.core import jsonl, layout
from tasks.data.records import parse_pair
from tasks.models import lm
from tasks.reward.probe import PROBE_FOLDS, depth_features, pair_diffs, probe_cv, probe_fit
from tasks.reward.reward_model import encode_pairs, heldout_split, init_reward_model


def depths_arg(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi) + 1)) if hi else [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workspace", type=Path, required=True)
    ap.add_argument("--it", type=int, default=2)
    ap.add_argument("--depths", type=depths_arg, default=depths_arg("1-30"))
    args = ap.parse_args()
    ws = args.workspace
    p = load_params(str(ws / layout.PARAMS_FILE))
    rp = p.train_rm
    path = str(ws / layout.pairs_pool(args.it))
    pool = [parse_pair(rec, path, n, "unknown") for n, rec in jsonl.read(path)]
    tok = lm.load_tokenizer(ws / layout.policy(0))
    train, held = (encode_pairs(tok, x, p.model.max_prompt_tokens, rp.max_length)
                   for x in heldout_split(pool, rp.heldout_fraction))
    model = init_reward_model(ws / layout.policy(0))
    t0 = time.perf_counter()
    keys, feats = depth_features(model, train + held, tok.pad_token_id, rp, args.depths)
    d_train, d_held = pair_diffs(keys, feats, train), pair_diffs(keys, feats, held)  # (N, D, H)
    rows = {}
    for j, d in enumerate(args.depths):
        losses, acc = probe_cv(d_train[:, j], [e.prompt_ids for e in train],
                               rp.probe_l2_grid or (rp.probe_l2,), PROBE_FOLDS)
        l2 = min(losses, key=lambda x: (losses[x], -x))
        held_acc = float((d_held[:, j] @ probe_fit(d_train[:, j], l2) > 0).float().mean())
        rows[d] = {"l2": l2, "cv_loss": round(losses[l2], 4), "cv_accuracy": round(acc[l2], 4),
                   "heldout_accuracy": round(held_acc, 4)}
        print(f"{d:>3} blocks: {rows[d]}", flush=True)
    pick = min(rows, key=lambda d: (rows[d]["cv_loss"], d))
    print(json.dumps({"train_pairs": len(train), "heldout_pairs": len(held),
                      "features_s": round(time.perf_counter() - t0, 1), "cv_pick": pick,
                      "depths": rows}))


if __name__ == "__main__":
    main()
