"""What `train_rm.freeze_layers` and `freeze_embeddings` save: the reward model's fine-tuning
step with every weight training, with the embeddings alone kept, and with the embeddings and
the first N blocks frozen, side by side in one run, on a workspace's own pair pool.

    python -m benchmarks.rm_freeze --workspace WS [--it 2] [--freeze 0,e,3,6] [--steps 6]

A setting is a number of blocks N (`freeze_layers: N`; above 0 the embeddings are frozen with
them) or `e`, the embeddings alone (`freeze_embeddings: true`).

Builds one reward model per setting as `train_rm@<it>` does (its params' depth, pooling and
learning rate; the head from the same seed), then takes the same batches of the pool's
training pairs (`prompt_batches`, seeded) through every setting in turn, step by step, so that
a machine whose speed drifts slows every setting alike. Prints per setting the mean seconds of
the forward pass, the backward pass and the AdamW step (the first step, a warm-up, is left
out) and the ratio to the first setting, with the commit, CPU model and precision; JSON on the
last line. Held-out accuracy is not measured here: rerun the stage in a copy of the workspace
with the setting overlaid (docs/algorithms.md#freezing-lower-blocks).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.lora_cost import cpu_model
from tasks.config.params import load_params
from tasks.core import jsonl, layout
from tasks.data.records import parse_pair
from tasks.functional.losses import bradley_terry_margin_loss
from tasks.models import lm
from tasks.reward.reward_model import (
    encode_pairs,
    freeze_lower,
    heldout_split,
    init_reward_model,
    member_margins,
    prompt_batches,
)

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workspace", type=Path, required=True)
    ap.add_argument("--it", type=int, default=2)
    ap.add_argument("--freeze", default="0,e,3,6",
                    help="settings: freeze_layers N, or e (the embeddings alone); first = base")
    ap.add_argument("--steps", type=int, default=6, help="steps per setting, the first a warm-up")
    args = ap.parse_args()
    ws, settings = args.workspace, args.freeze.split(",")
    if any(x != "e" and not x.isdigit() for x in settings):
        raise SystemExit(f"--freeze: settings are block counts or e, got {args.freeze!r}")
    p = load_params(str(ws / layout.PARAMS_FILE))
    rp = p.train_rm
    path = str(ws / layout.pairs_pool(args.it))
    pool = [parse_pair(rec, path, n, "unknown") for n, rec in jsonl.read(path)]
    tok = lm.load_tokenizer(ws / layout.policy(0))
    train, _ = heldout_split(pool, rp.heldout_fraction)
    enc = encode_pairs(tok, train, p.model.max_prompt_tokens, rp.max_length)
    batches = list(prompt_batches(enc, rp.batch_size, torch.Generator().manual_seed(p.seed)))
    batches = batches[: args.steps]
    precision = lm.effective_precision(rp.precision, "cpu")
    runs = []
    for n in settings:
        model = init_reward_model(ws / layout.policy(0), torch.Generator().manual_seed(p.seed),
                                  rp.num_layers)
        model.train()
        trained = freeze_lower(model, 0, True) if n == "e" else freeze_lower(model, int(n))
        runs.append((model, torch.optim.AdamW(trained, lr=rp.lr)))
    times = {n: {"forward": 0.0, "backward": 0.0, "optimiser": 0.0} for n in settings}
    for i, batch in enumerate(batches):
        for n, (model, opt) in zip(settings, runs):
            t0 = time.perf_counter()
            opt.zero_grad()
            with lm.autocast(rp.precision, "cpu"):
                margins = member_margins(model, batch, tok.pad_token_id, rp.pooling)[0]
            loss = bradley_terry_margin_loss(margins, torch.zeros_like(margins), rp.margin).mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if i:                                   # the first step warms up
                for key, dt in (("forward", t1 - t0), ("backward", t2 - t1),
                                ("optimiser", t3 - t2)):
                    times[n][key] += dt / (len(batches) - 1)
    head = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                     capture_output=True, text=True).stdout.strip(),
            "cpu": cpu_model(), "precision": precision, "seed": p.seed,
            "blocks": rp.num_layers, "batch_size": rp.batch_size, "steps": len(batches) - 1}
    print(f"{head['commit']} · {head['cpu']} · {precision} · seed {p.seed} · "
          f"{rp.num_layers} blocks, {rp.batch_size} pairs a step")
    base = sum(times[settings[0]].values())
    rows = {}
    for n in settings:
        step = sum(times[n].values())
        rows[n] = {**{k: round(v, 3) for k, v in times[n].items()},
                   "step": round(step, 3), "ratio": round(step / base, 3)}
        label = "embeddings only " if n == "e" else f"freeze_layers {n:>2}"
        print(f"{label}: forward {times[n]['forward']:.2f} s, backward "
              f"{times[n]['backward']:.2f} s, AdamW {times[n]['optimiser']:.2f} s, step "
              f"{step:.2f} s ({step / base:.2f}x)")
    print(json.dumps({**head, "settings": rows}))


if __name__ == "__main__":
    main()
