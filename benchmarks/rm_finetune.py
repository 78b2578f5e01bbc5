"""The reward model as `train_rm` builds it, under `train_rm` settings overlaid one at a time,
on a workspace's own pair pool: held-out accuracy overall and by what separates a pair.

    python -m benchmarks.rm_finetune --workspace WS [--it 2] '{"lr": 1e-4}' '{"epochs": 2}' ...

Each argument is a JSON object of `train_rm` keys overlaid on the workspace's params (none: the
params as they are). Reads what `train_rm@<it>` reads (the pool with the audit verdicts applied,
the window, the held-out split by prompt) and trains the members through the stage's own
`train_members`, with the stage's seeds: the params as they are give the stage's model and its
`rm/accuracy` to the digit on the same machine. Prints per setting the held-out accuracy, the
training pairs' accuracy, seconds, and the held-out accuracy by the judge's components that
tell the pair's sides apart (`lexicon_review` judges): `topic` (one side names the film, the
other does not), `register` (one side reads as correspondence), both, or `sentiment` (neither:
the lexicon's score alone), with the commit, CPU model, precision and seed; JSON lines.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.lora_cost import cpu_model
from tasks.config.params import load_params
from tasks.core import layout
from tasks.data import audit
from tasks.data.records import PreferencePair
from tasks.judging.judges import correspondence, mentions
from tasks.models import lm
from tasks.reward.reward_model import (
    RewardEnsemble,
    encode_pairs,
    ensemble_agreement,
    ensemble_metrics,
    heads,
    heldout_split,
    pair_margins,
)
from tasks.stages.train_rm import read_pool, train_members, window

REPO = Path(__file__).resolve().parent.parent


def kind(pair: PreferencePair) -> str:
    """What tells a pair's sides apart for the review judge."""
    parts = [name for name, differs in (
        ("topic", mentions(pair.prompt, pair.chosen) != mentions(pair.prompt, pair.rejected)),
        ("register", correspondence(pair.chosen) != correspondence(pair.rejected))) if differs]
    return "+".join(parts) or "sentiment"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workspace", type=Path, required=True)
    ap.add_argument("--it", type=int, default=2)
    ap.add_argument("settings", nargs="*", default=["{}"], help="JSON train_rm overlays")
    args = ap.parse_args()
    ws, it = args.workspace, args.it
    try:
        settings = [json.loads(s) for s in args.settings]
    except json.JSONDecodeError as e:
        raise SystemExit(f"settings: not JSON: {e}") from None
    p0 = load_params(str(ws / layout.PARAMS_FILE))
    pool, labels = read_pool(ws, it)
    pairs, _ = window(audit.apply_audit(pool, labels)[0], labels, p0.train_rm.window)
    tok = lm.load_tokenizer(ws / layout.policy(0))
    train, held = heldout_split(pairs, p0.train_rm.heldout_fraction)
    kinds = [kind(x) for x in held]
    head = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                     capture_output=True, text=True).stdout.strip(),
            "cpu": cpu_model(), "seed": p0.seed, "workspace": str(ws), "it": it,
            "train_pairs": len(train), "heldout_pairs": len(held)}
    for overlay in settings:
        p = dataclasses.replace(p0, train_rm=dataclasses.replace(p0.train_rm, **overlay))
        rp = p.train_rm
        enc = lambda ps: encode_pairs(tok, ps, p.model.max_prompt_tokens, rp.max_length)
        enc_train, enc_held = enc(train), enc(held)
        t0 = time.perf_counter()
        members, _, cache = train_members(ws / layout.policy(0), enc_train, p,
                                          tok.pad_token_id, it)
        seconds = time.perf_counter() - t0
        model = RewardEnsemble(members, rp.precision, rp.pooling)
        # the held-out pairs scored once: their margins give the accuracy and its split
        margins = (torch.sub(*cache.pair_rewards(heads(model), enc_held)) if cache is not None
                   else pair_margins(model, enc_held, tok.pad_token_id))
        metrics, _ = ensemble_metrics(model, enc_train, [], tok.pad_token_id, cache,
                                      rp.stats_pairs)
        metrics["rm/accuracy"] = ensemble_agreement(margins)["accuracy"]
        right = (margins.mean(0) > 0).tolist()
        by_kind: dict[str, list[bool]] = collections.defaultdict(list)
        for k, ok in zip(kinds, right):
            by_kind[k].append(ok)
        print(json.dumps({**head, "precision": lm.effective_precision(rp.precision, "cpu"),
                          "overlay": overlay, "heldout_accuracy": round(metrics["rm/accuracy"], 4),
                          "train_accuracy": round(metrics["rm/train_accuracy"], 4),
                          "seconds": round(seconds, 1),
                          "by_kind": {k: {"accuracy": round(sum(v) / len(v), 4), "pairs": len(v)}
                                      for k, v in sorted(by_kind.items())}}), flush=True)


if __name__ == "__main__":
    main()
