"""The reward model's probe head: a closed-form start for its linear head (`head_init: probe`).

An L2 logistic regression on frozen chosen-minus-rejected features, standardised so that one
`probe_l2` fits any width, then folded back into the plain linear head. With `probe_l2_grid` the
L2 is chosen by cross-validation over the training prompts, and with `num_layers_grid` the
backbone's depth too (features of every candidate depth from one forward pass). The features
themselves, and their cache while the backbone no longer changes, are tasks/reward/features.py's.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import transformers
from torch import Tensor

from tasks.core.jsonl import DataError
from tasks.functional.logistic import fit_logistic
from tasks.models import lm
from tasks.reward.features import EncodedPair, FrozenFeatures, Key, depth, pool_states, truncate
from tasks.runtime.device import device_of
from tasks.schemas.train_rm import TrainRMParams

PROBE_FOLDS = 5                 # cross-validation folds of `probe_l2_grid`


def features_at_depths(model: transformers.PreTrainedModel, prompts: Sequence[Sequence[int]],
                       responses: Sequence[Sequence[int]], pad_id: int, pooling: str,
                       depths: Sequence[int]) -> Tensor:
    """(B, D, H): `features` of the model truncated to each of `depths` blocks, from one
    forward pass: the state after block d, through the final norm as a d-block model applies
    it, then pooled."""
    pk = lm.pack(prompts, responses, pad_id, device_of(model))
    backbone = getattr(model, model.base_model_prefix)
    states = backbone(input_ids=pk.ids, attention_mask=lm.attention_mask(model, pk.attention),
                      position_ids=pk.positions, output_hidden_states=True).hidden_states
    last = len(states) - 1                      # states[0]: embeddings; states[last]: normed
    return torch.stack([pool_states(states[d] if d == last else backbone.norm(states[d]), pk,
                                    pooling) for d in depths], dim=1)


def probe_fit(diff: Tensor, l2: float) -> Tensor:
    """The probe's weights on chosen-minus-rejected features `diff` (N, H), in the features'
    own units: fitted on them standardised by their std (so one L2 fits any width), both
    orientations of each pair (so no bias is needed)."""
    scale = diff.std(0) + 1e-6 if len(diff) > 1 else torch.ones_like(diff[0])
    x = torch.cat([diff / scale, -diff / scale])
    y = torch.cat([torch.ones(len(diff), device=diff.device),
                   torch.zeros(len(diff), device=diff.device)])
    w, _ = fit_logistic(x, y, l2)
    return w / scale


def probe_fold(prompt_ids: Sequence[int], folds: int) -> int:
    """A prompt's cross-validation fold: a hash of its tokens (not the held-out split's hash
    of its messages), so a prompt's pairs stay in one fold and a rerun draws the same folds."""
    return int(hashlib.md5(repr(tuple(prompt_ids)).encode()).hexdigest()[-8:], 16) % folds


def probe_cv(diff: Tensor, prompts: Sequence[Sequence[int]], grid: Sequence[float],
             folds: int = 5) -> tuple[dict[float, float], dict[float, float]]:
    """K-fold cross-validation of the probe at each L2 of `grid` over the training pairs grouped
    by prompt: the mean Bradley-Terry log-loss and the accuracy of the left-out folds."""
    fold = torch.tensor([probe_fold(x, folds) for x in prompts], device=diff.device)
    losses, accuracy = {}, {}
    for l2 in grid:
        loss = correct = 0.0
        for k in range(folds):
            out = fold == k
            if not bool(out.any()) or bool(out.all()):
                continue
            m = diff[out] @ probe_fit(diff[~out], l2)
            loss += float(torch.nn.functional.softplus(-m).sum())
            correct += float((m > 0).sum())
        losses[l2], accuracy[l2] = loss / len(diff), correct / len(diff)
    return losses, accuracy


def choose_probe_l2(diff: Tensor, prompts: Sequence[Sequence[int]], grid: Sequence[float],
                    folds: int = 5) -> tuple[float, dict[float, float]]:
    """The L2 of `grid` whose probe predicts unseen prompts' pairs best (`probe_cv`), by the
    left-out folds' log-loss (smoother than accuracy on a few hundred pairs); ties go to the
    larger L2. Only training pairs are read: the held-out pairs measure the result. Returns
    the choice and every candidate's cross-validated accuracy."""
    losses, accuracy = probe_cv(diff, prompts, grid, folds)
    return min(grid, key=lambda l2: (losses[l2], -l2)), accuracy


def depth_features(model: transformers.PreTrainedModel, pairs: Sequence[EncodedPair],
                   pad_id: int, p: TrainRMParams, depths: Sequence[int], batch_size: int = 32
                   ) -> tuple[list[Key], Tensor]:
    """Each distinct (prompt, response) of the pairs, in first-seen order, and its frozen
    features (p.pooling, p.precision) after each of `depths` blocks, (U, D, H) in fp32: one
    forward pass per batch through max(depths) blocks (`features_at_depths`)."""
    keys = list(dict.fromkeys((e.prompt_ids, side) for e in pairs
                              for side in (e.chosen_ids, e.rejected_ids)))
    model.eval()
    with torch.no_grad(), lm.autocast(p.precision, device_of(model)):
        feats = torch.cat([features_at_depths(
            model, [k[0] for k in keys[s: s + batch_size]], [k[1] for k in keys[s: s + batch_size]],
            pad_id, p.pooling, depths).float() for s in range(0, len(keys), batch_size)])
    return keys, feats


def pair_diffs(keys: Sequence[Key], feats: Tensor, pairs: Sequence[EncodedPair]) -> Tensor:
    """h(chosen) - h(rejected) of each pair from `depth_features`' output, (N, D, H)."""
    index = {k: i for i, k in enumerate(keys)}
    pick = torch.tensor([[index[(e.prompt_ids, side)] for side in (e.chosen_ids, e.rejected_ids)]
                         for e in pairs], device=feats.device)                           # (N, 2)
    return feats[pick[:, 0]] - feats[pick[:, 1]]


def choose_depth(model: transformers.PreTrainedModel, train: Sequence[EncodedPair],
                 p: TrainRMParams, pad_id: int, batch_size: int = 32
                 ) -> tuple[FrozenFeatures, dict[str, float]]:
    """How many backbone blocks the probe reads (`num_layers_grid`), chosen with its L2 by the
    same cross-validation over the training prompts (lowest left-out log-loss; ties go to the
    shallower, cheaper model): one forward pass through max(grid) blocks gives every depth's
    features. On seed 0 / 1's second iterations the 12th block's probe held out 0.734 / 0.692,
    the 14th-23rd blocks' 0.71-0.76 (`benchmarks/rm_depth.py`). `model` must hold at least
    max(grid) blocks; it is truncated to the choice, and the FrozenFeatures of it that come
    back already hold the training responses' features (the same batches `fit_probe_head`
    would compute them in)."""
    grid = sorted(set(p.num_layers_grid))
    if grid[-1] > depth(model):
        raise DataError(f"train_rm.num_layers_grid: {grid[-1]} blocks asked for, the backbone "
                        f"has {depth(model)}")
    keys, feats = depth_features(model, train, pad_id, p, grid, batch_size)
    diffs = pair_diffs(keys, feats, train)                                          # (N, D, H)
    prompts = [e.prompt_ids for e in train]
    l2s = p.probe_l2_grid or (p.probe_l2,)
    scores = {}
    for j, d in enumerate(grid):
        losses, _ = probe_cv(diffs[:, j], prompts, l2s, PROBE_FOLDS)
        scores[d] = min(losses.values())
    best = min(grid, key=lambda d: (scores[d], d))
    truncate(model, best)
    cache = FrozenFeatures(model, pad_id, p.pooling, p.precision, batch_size)
    cache.rows.update(zip(keys, feats[:, grid.index(best)].clone()))
    return cache, {"num_layers": float(best), "depth_cv_loss": scores[best]}


def fit_probe_head(model: transformers.PreTrainedModel, train: Sequence[EncodedPair],
                   p: TrainRMParams, pad_id: int, batch_size: int = 32,
                   cache: FrozenFeatures | None = None) -> dict[str, float]:
    """Set the head to the Bradley-Terry logistic regression on frozen features: w minimising
    -log sigma(w . (h_c - h_r)) + l2 |w|^2 over the pairs, on features standardised by their
    std (so one `probe_l2` fits any width), then folded back into the plain linear head. With
    `probe_l2_grid` the L2 is chosen from it by cross-validation over the training prompts
    (`choose_probe_l2`; `probe_l2` where they are fewer than the folds).
    `cache`: the features from there (model's backbone must be the cache's)."""
    model.eval()
    index: dict[Key, int] = {}
    for e in train:
        for side in (e.chosen_ids, e.rejected_ids):
            index.setdefault((e.prompt_ids, side), len(index))
    keys = list(index)
    cache = cache or FrozenFeatures(model, pad_id, p.pooling, p.precision, batch_size)
    feats = cache.get(keys)                                                            # (U, H)
    diff = torch.stack([feats[index[(e.prompt_ids, e.chosen_ids)]]
                        - feats[index[(e.prompt_ids, e.rejected_ids)]] for e in train])  # (N, H)
    l2, out = p.probe_l2, {}
    if p.probe_l2_grid and len({e.prompt_ids for e in train}) >= PROBE_FOLDS:
        l2, cv = choose_probe_l2(diff, [e.prompt_ids for e in train], p.probe_l2_grid,
                                 PROBE_FOLDS)
        out["probe_cv_accuracy"] = cv[l2]
    w = probe_fit(diff, l2)
    with torch.no_grad():
        model.score.weight.copy_(w[None].to(model.score.weight.dtype))
    return {"probe_train_accuracy": float((diff @ w > 0).float().mean()),
            "probe_responses": float(len(keys)), "probe_l2": l2, **out}
