"""Stage `train_rm`: the iteration's Bradley-Terry reward model, or an ensemble of K.

It learns from the pair pool: the off-policy pairs plus every on-policy pair the judge has
labelled up to and including this iteration's rollouts, so that it is reliable where the current
policy samples, with the person's audit verdicts (`audit/labels.jsonl`) applied first. Each
member's backbone starts from the initial model; members differ by seed (head init, data
order). Afterwards the pairs to audit next are exported to `audit/iter_k/queue.jsonl`. With
`epochs: 0` (only the heads fitted) the model directory keeps the heads and the backbone's
record, not a copy of its blocks (tasks/reward/reward_model.py).
"""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

from collections.abc import Sequence
from pathlib import Path

import torch
import transformers

from tasks.config.params import Params
from tasks.core import atomic, jsonl, layout
from tasks.core.jsonl import DataError
from tasks.data import audit
from tasks.data.records import PreferencePair, parse_pair
from tasks.models import lm, mlflow_model, model_card
from tasks.reward.features import EncodedPair, FrozenFeatures, depth
from tasks.reward.probe import PROBE_FOLDS, choose_depth, fit_probe_head
from tasks.reward.reward_model import (
    BACKBONE_FILE,
    HEAD_FILE,
    SCORER_MODULE,
    SCORER_SIGNATURE,
    BackboneRef,
    RewardEnsemble,
    encode_pairs,
    ensemble_metrics,
    heads,
    heldout_split,
    init_reward_model,
    pair_margins,
    save_reward_model,
    save_stats,
    train_reward,
)
from tasks.runtime import distributed
from tasks.runtime.device import Device
from tasks.runtime.distributed import SINGLE, Group

CONTRACT = stage.Contract(
    "train_rm", params=("device", "seed", "model.max_prompt_tokens", "train_rm"),
    deps=lambda it, prev: (layout.pairs_pool(it), layout.policy(0), layout.AUDIT_LABELS),
    outs=lambda it, prev: (layout.reward_model(it), layout.audit_queue(it)),
    metrics=lambda it, prev: (layout.metrics(it, "train_rm"),))


def train_members(backbone: Path, train: Sequence[EncodedPair], p: Params, pad_id: int,
                  it: int, group: Group = SINGLE, device: Device = "cpu",
                  curve: list[dict[str, float]] | None = None
                  ) -> tuple[list[transformers.PreTrainedModel], dict[str, float],
                             FrozenFeatures | None]:
    """K members, member i seeded by (seed, it, i); loss stats averaged over members. With
    `head_init: probe` each member's head is first fitted on frozen features: on all pairs at
    K = 1, on its own bootstrap resample of them at K > 1 (so members differ). On several
    ranks every rank fits the probe whole (closed form: nothing to split); the fine-tuning
    epochs are sharded. With `num_layers_grid` the depth is chosen first by the probe's
    cross-validation (`choose_depth`) and every member keeps that many blocks. Without
    fine-tuning (epochs 0) the backbone stays as loaded, and its features (shared by all
    members) come back for scoring; with it (the probe, then the fine-tuning epochs from it:
    linear probing then fine-tuning, LP-FT, Kumar et al. 2022) they are stale once a member
    trains, so every member after the first fits its probe on fresh features and none come
    back."""
    rp = p.train_rm
    members, runs = [], []
    cache, chosen, num_layers = None, {}, rp.num_layers
    choose = (bool(rp.num_layers_grid) and rp.head_init == "probe"
              and len({e.prompt_ids for e in train}) >= PROBE_FOLDS)
    for i in range(rp.ensemble):
        model = init_reward_model(backbone, stage.generator(p.seed, 2, it, i, 0),   # head init
                                  max(rp.num_layers_grid) if choose and i == 0 else num_layers,
                                  device)
        if choose and i == 0:               # the depth with the probe's L2, by CV (truncates)
            cache, chosen = choose_depth(model, train, rp, pad_id)
            num_layers = int(chosen["num_layers"])
        elif rp.epochs == 0 and cache is None:
            cache = FrozenFeatures(model, pad_id, rp.pooling, rp.precision)
        run: dict[str, float] = {}
        if rp.head_init == "probe" and train:
            data = train if rp.ensemble == 1 else [train[j] for j in torch.randint(
                len(train), (len(train),),  # cpu: its generator
                generator=stage.generator(p.seed, 2, it, i, 2))]
            run.update(fit_probe_head(model, data, rp, pad_id, cache=cache))
        if rp.epochs > 0:
            steps: list[dict[str, float]] = []
            run.update(train_reward(model, train, rp, pad_id,
                                    stage.generator(p.seed, 2, it, i, 1), group,   # data order
                                    steps))
            if curve is not None:
                curve.extend({"member": float(i), **st} for st in steps)
            cache = None                        # the backbone moved: its features are stale
        runs.append(run)
        members.append(model)
    metrics = {f"rm/{k}": sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    metrics["rm/num_layers"] = float(depth(members[0]))
    metrics.update({f"rm/{k}": v for k, v in chosen.items() if k != "num_layers"})
    return members, metrics, cache


def backbone_note(ref: BackboneRef) -> str:
    """The model card's word on a head-only reward model."""
    return (f"Only the head is stored here (`{HEAD_FILE}`, per member): the backbone is "
            f"`{ref.base_path}` cut to its first {ref.num_layers} block(s) (weights md5 "
            f"`{ref.base_md5}`, `{BACKBONE_FILE}`), frozen while the head was fitted, and "
            "its tokenizer is that directory's. `tasks.reward.reward_model.load_reward_model` "
            "rebuilds the model (and refuses a backbone with other weights); MLflow loads it as "
            "a python_function model scoring prompt and response texts.")


def window(pairs: list[PreferencePair], labels: dict[str, audit.AuditLabel],
           n: int) -> tuple[list[PreferencePair], dict[str, float]]:
    """The pairs the RM trains on: every off-policy and audited pair, and the on-policy pairs of
    the newest `n` iterations present (n = 0: all); the pool's order is kept."""
    iterations = sorted({i for x in pairs if x.source.startswith("iter_")
                         and (i := audit.source_iteration(x.source)) is not None})
    newest = set(iterations[-n:]) if n > 0 else set(iterations)
    kept = [x for x in pairs
            if not x.source.startswith("iter_") or audit.source_iteration(x.source) in newest
            or "audit_of" in x.meta or audit.pair_id(x) in labels]
    return kept, {"rm/n_pool": float(len(pairs)), "rm/n_aged_out": float(len(pairs) - len(kept)),
                  "rm/window_oldest": float(min(newest, default=0))}


def read_pool(root: Path, it: int) -> tuple[list[PreferencePair], dict[str, audit.AuditLabel]]:
    pool_path = str(root / layout.pairs_pool(it))
    pool = [parse_pair(rec, pool_path, n, "unknown") for n, rec in jsonl.read(pool_path)]
    labels_path = root / layout.AUDIT_LABELS
    audit.ensure_labels_file(labels_path)
    return pool, audit.parse_labels(labels_path)


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "", CONTRACT)
    p, it, root = args.params, args.it, args.root
    # epochs 0 (the probe alone, closed form): nothing to split, one process
    group = distributed.enter("tasks.stages.train_rm", argv,
                              p.train_rm.processes if p.train_rm.epochs > 0 else 1)
    if group is None:                           # ran on N ranks under torchrun
        return
    pool, labels = read_pool(root, it)
    pairs, audit_metrics = audit.apply_audit(pool, labels)
    pairs, window_metrics = window(pairs, labels, p.train_rm.window)
    if len(pairs) < 2:
        raise DataError(f"{root / layout.pairs_pool(it)}: {len(pairs)} pairs after the audit; "
                        "the reward model needs at least 2")
    backbone = root / layout.policy(0)
    tok = lm.load_tokenizer(backbone)
    train, held = heldout_split(pairs, p.train_rm.heldout_fraction)
    enc = lambda ps: encode_pairs(tok, ps, p.model.max_prompt_tokens, p.train_rm.max_length)
    enc_train, enc_held = enc(train), enc(held)
    curve: list[dict[str, float]] = []
    members, metrics, cache = train_members(backbone, enc_train, p, tok.pad_token_id, it, group,
                                            args.device, curve)
    if not group.main:                          # ranks > 0 write nothing
        distributed.close(group)
        return
    ensemble = RewardEnsemble(members, p.train_rm.precision, p.train_rm.pooling)
    rm_metrics, stats = ensemble_metrics(ensemble, enc_train, enc_held, tok.pad_token_id, cache,
                                         p.train_rm.stats_pairs)
    metrics.update(rm_metrics)
    metrics.update(audit_metrics)
    metrics.update(window_metrics)
    metrics["rm/bf16"] = float(lm.effective_precision(p.train_rm.precision, args.device) == "bf16")
    metrics["rm/n_onpolicy"] = float(sum(1 for x in pairs if x.source.startswith("iter_")))

    new = [x for x in pool if x.source == f"iter_{it}"]         # the judge's labels, unaudited

    def margins(idx: Sequence[int]) -> torch.Tensor:             # (K, n): only what the queue needs
        picked = enc([new[i] for i in idx])
        return (cache.margins(heads(ensemble), picked) if cache is not None
                else pair_margins(ensemble, picked, tok.pad_token_id))

    queue = audit.build_queue(new, margins, labels,
                              p.train_rm.audit_top_n, p.train_rm.audit_random_n,
                              stage.generator(p.seed, 6, it), len(members))
    metrics["rm/audit_queue_n"] = float(len(queue))
    frozen = (BackboneRef(layout.policy(0), lm.weights_md5(backbone), depth(members[0]))
              if p.train_rm.epochs == 0 else None)  # only the heads were fitted: keep them
    with atomic.directory(root / layout.reward_model(it)) as tmp:
        save_reward_model(members, tmp, frozen)
        if frozen is None:                  # else the backbone's tokenizer serves (3.5 MB)
            tok.save_pretrained(tmp)
        save_stats(tmp, {**stats, "pooling": p.train_rm.pooling,
                         "precision": lm.effective_precision(p.train_rm.precision, args.device)})
        atomic.write_json(tmp / layout.MODEL_META, {"iteration": it, "role": "reward_model",
                                                    "pairs": len(pairs), "ensemble": len(members)})
        if curve:                               # the fine-tuning steps (the probe has none)
            atomic.write_json(tmp / layout.TRAINING_CURVE, curve)
        info = {"model_path": layout.reward_model(it)}
        if frozen is None:
            mlflow_model.write_mlflow_model(tmp, "text-classification", info)
        else:                                   # no weights here for the transformers flavor
            mlflow_model.write_pyfunc_model(tmp, SCORER_MODULE, SCORER_SIGNATURE,
                                            {**info, "base_path": frozen.base_path})
        model_card.write_model_card(tmp, root, "train_rm", it, p, metrics,
                                    [] if frozen is None else [backbone_note(frozen)])
    jsonl.write(root / layout.audit_queue(it), queue)
    stage.write_metrics(root, layout.metrics(it, "train_rm"), metrics)
    stage.say(f"train_rm@{it}: {len(members)} member(s), {len(train)} train / {len(held)} "
              f"held-out pairs, held-out accuracy {metrics['rm/accuracy']:.3f}, {len(queue)} "
              f"pairs to audit" + (f", on {group.world} processes" if group.world > 1 else ""))
    distributed.close(group)


if __name__ == "__main__":
    stage.run_main(lambda: main())
