"""Direct Preference Optimisation on preference pairs: the training loop around
tasks/functional/losses.py.

The loss is `update.dpo.loss`: sigmoid (DPO), ipo (on per-token mean log-ratios) or cdpo
(label-smoothed DPO), plus with `sft_weight` w > 0 an SFT anchor: w times the per-token NLL
of the chosen response (RPO, Pang et al. 2024, "Iterative Reasoning Preference Optimization"),
which keeps pulling toward the judge's best sample once the preference term has saturated on
a small pair set (DPO alone drives its loss to ~0 on 48 pairs and can then drift into text the
reference finds unlikely). Pairs are on-policy (best vs worst of the current policy's K
samples, by the judge or by the reward model, `rm_best_vs_worst`), optionally mixed with a
weighted share of off-policy pairs from the previous pool (`offpolicy_indices`).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from tasks.core import progress
from tasks.data.records import Rollout
from tasks.functional.losses import DPO_LOSSES, LENGTH_NORMALISED_LOSSES, dpo_implicit_rewards
from tasks.models import lm
from tasks.policy import kl_budget
from tasks.policy.kl_budget import KLGuard, Snapshot
from tasks.reward.features import EncodedPair
from tasks.reward.reward_model import RewardModel, reward_mean_std
from tasks.runtime.device import device_of
from tasks.runtime.distributed import SINGLE, Group, record_losses
from tasks.schemas.update import DPOParams


def pair_logprobs(model: torch.nn.Module, batch: Sequence[EncodedPair], pad_id: int,
                   per_token_mean: bool = False) -> tuple[Tensor, Tensor]:
    """Completion log-probs of chosen and rejected, each (B,), one forward pass in which each
    pair's prompt is computed once for both sides (`lm.pack`): summed over the completion's
    tokens, or their mean when `per_token_mean` (IPO)."""
    prompts = [e.prompt_ids for e in batch] * 2
    responses = [e.chosen_ids for e in batch] + [e.rejected_ids for e in batch]
    logp, mask = lm.response_logprobs(model, prompts, responses, pad_id)     # (2B, R)
    logp = (logp * mask).sum(-1)                                             # log pi(y|x)
    if per_token_mean:
        logp = logp / mask.sum(-1).clamp(min=1.0)                            # / |y|
    return logp[: len(batch)], logp[len(batch):]


@torch.no_grad()
def reference_logprobs(ref: torch.nn.Module, pairs: Sequence[EncodedPair], pad_id: int,
                       batch_size: int, per_token_mean: bool = False,
                       group: Group = SINGLE) -> tuple[Tensor, Tensor]:
    """The reference's chosen and rejected log-probs over all pairs, each (N,). On several
    ranks each computes every world-th chunk (the same chunks as one process) and shares it."""
    chosen, rejected = [], []
    device = device_of(ref)
    for j, s in enumerate(range(0, len(pairs), batch_size)):
        chunk = pairs[s: s + batch_size]
        c, r = (pair_logprobs(ref, chunk, pad_id, per_token_mean) if group.owns(j)
                else (None, None))
        chosen.append(group.share(c, len(chunk), j, device))
        rejected.append(group.share(r, len(chunk), j, device))
    return torch.cat(chosen), torch.cat(rejected)


def _batch_terms(policy: torch.nn.Module, pairs: Sequence[EncodedPair], idx: Tensor,
                 ref_c: Tensor, ref_r: Tensor, p: DPOParams, pad_id: int
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-pair loss (with the SFT term), chosen NLL and implicit rewards r_c, r_r on the pairs
    `idx` (on the CPU: the generator's order), each (B,)."""
    mean_lp = p.loss in LENGTH_NORMALISED_LOSSES
    with lm.autocast(p.precision, device_of(policy)):
        pi_c, pi_r = pair_logprobs(policy, [pairs[i] for i in idx.tolist()], pad_id, mean_lp)
    at = idx.to(ref_c.device)
    per_pair = DPO_LOSSES[p.loss](pi_c, pi_r, ref_c[at], ref_r[at], p.beta, p.label_smoothing)
    nll = -pi_c if mean_lp else -pi_c / torch.tensor(
        [max(len(pairs[i].chosen_ids), 1) for i in idx.tolist()], dtype=pi_c.dtype,
        device=pi_c.device)
    if p.sft_weight > 0:
        per_pair = per_pair + p.sft_weight * nll                               # (B,)
    with torch.no_grad():
        r_c = dpo_implicit_rewards(pi_c, ref_c[at], p.beta)                   # beta log pi/ref
        r_r = dpo_implicit_rewards(pi_r, ref_r[at], p.beta)
    return per_pair, nll, r_c, r_r


def train_dpo(policy: torch.nn.Module, ref: torch.nn.Module, pairs: Sequence[EncodedPair], *,
              p: DPOParams, pad_id: int, rng: torch.Generator,
              weights: Tensor | None = None, group: Group = SINGLE,
              curve: list[dict[str, float]] | None = None,
              guard: KLGuard | None = None) -> dict[str, float]:
    """Optimise the policy in place on the pairs; returns `update/` metrics, and appends one
    record per optimiser step to `curve` (loss, implicit-reward accuracy and margin, the mean
    log-ratio log pi/pi_ref of the pair's responses, the chosen NLL, the learning rate).

    weights: (N,) per-pair loss weights (default 1); the batch loss is mean_i(w_i * l_i).
    Implicit rewards and their accuracy are measured on the quantities the loss sees (per-token
    means for IPO), before each step. On several ranks (`group`) each takes its shard of every
    global batch and the gradients are summed (tasks/runtime/distributed.py): the same steps.

    With a `guard` (tasks/policy/kl_budget.py) the KL to the reference is measured before the first
    step and every `check_every` steps; at the first measurement past the target training
    stops, keeping the weights of the last one within it or, with `backtrack`, a state part of
    the way from them to the ones past it (kl_budget.check; every rank measures the same).
    """
    if not pairs:
        return {"update/steps": 0.0, "update/n_pairs": 0.0}
    t0 = time.perf_counter()
    device = device_of(policy)
    w = torch.ones(len(pairs), device=device) if weights is None else weights.to(device)  # (N,)
    ref.eval()
    with lm.autocast(p.precision, device):   # as the policy's: pi/ref is exactly 1 while pi = ref
        ref_c, ref_r = reference_logprobs(ref, pairs, pad_id, p.batch_size,
                                          p.loss in LENGTH_NORMALISED_LOSSES, group)  # (N,)
    opt = torch.optim.AdamW(policy.parameters(), lr=p.lr, weight_decay=0.0)
    losses, accs, margins, nlls = [], [], [], []
    snapshot, stopped_at = None, None
    if guard is not None:
        guard.begin()
        if guard.start >= guard.target:          # no room left: the start is kept as it is
            return {"update/steps": 0.0, "update/n_pairs": float(len(pairs)),
                    **guard.metrics(stopped_at=0)}
        snapshot = Snapshot(policy)
    pg = progress.track(p.epochs * -(-len(pairs) // p.batch_size), "steps", "pairs")
    policy.train()
    for _ in range(p.epochs):
        order = torch.randperm(len(pairs), generator=rng)  # cpu: its generator; every rank
        for s in range(0, len(order), p.batch_size):
            if stopped_at is not None:
                break
            batch = order[s: s + p.batch_size]
            idx = group.shard(batch)                          # all of it on one process
            opt.zero_grad()
            if len(idx):
                per_pair, nll, r_c, r_r = _batch_terms(policy, pairs, idx, ref_c, ref_r, p, pad_id)
                loss = group.batch_loss(w[idx.to(device)] * per_pair, len(batch))
                loss.backward()
            else:                                             # a short last batch, many ranks
                loss, (nll, r_c, r_r) = (torch.zeros((), device=device),
                                         (torch.zeros(0, device=device),) * 3)
            group.sum_grads(policy.parameters())
            opt.step()
            acc, margin, nll_mean, logratio = group.means(
                [(r_c > r_r).float(), r_c - r_r, nll, (r_c + r_r) / (2 * p.beta)], len(batch))
            accs.append(acc)
            margins.append(margin)
            nlls.append(nll_mean)
            losses.append(group.total(loss))
            if curve is not None:
                curve.append({"loss": losses[-1], "reward_accuracy": acc, "reward_margin": margin,
                              "logratio": logratio, "chosen_nll": nll_mean,
                              "lr": opt.param_groups[0]["lr"]})
            pg.step(1, work=len(batch))
            if guard is not None and snapshot is not None and (
                    len(losses) % guard.budget.check_every == 0) and \
                    kl_budget.check(guard, snapshot, len(losses)):   # past the target: back
                stopped_at = len(losses)                            # within it, and stop
        if stopped_at is not None:
            break
    pg.close()
    if guard is not None and snapshot is not None and stopped_at is None and \
            len(losses) % guard.budget.check_every != 0 and \
            kl_budget.check(guard, snapshot, len(losses)):        # the steps since the last check
        stopped_at = len(losses)
    policy.eval()
    record_losses(group, losses, time.perf_counter() - t0)
    kl = guard.metrics(stopped_at) if guard is not None else {}
    return {**kl, "update/steps": float(len(losses)), "update/n_pairs": float(len(pairs)),
            "update/loss_first": losses[0], "update/loss_last": losses[-1],
            "update/reward_accuracy_last": accs[-1], "update/reward_margin_last": margins[-1],
            "update/reward_accuracy_mean": sum(accs) / len(accs),
            "update/reward_margin_mean": sum(margins) / len(margins),
            "update/chosen_nll_first": nlls[0], "update/chosen_nll_last": nlls[-1]}


def rm_best_vs_worst(rm: RewardModel, rollouts: Sequence[Rollout], pad_id: int,
                     max_length: int) -> tuple[list[EncodedPair], dict[str, float]]:
    """One pair per prompt: its highest- vs lowest-reward rollout by the (ensemble mean) RM.

    Uses the sampled token ids themselves (no re-tokenisation), responses cut to fit
    max_length. Prompts whose best and worst tie are skipped.
    """
    rollouts = [r for r in rollouts if r.response_ids]
    if not rollouts:
        return [], {"update/rm_pairs": 0.0}
    mean, std = reward_mean_std(rm, [r.prompt_ids for r in rollouts],
                                [r.response_ids for r in rollouts], pad_id)        # (B,), (B,)
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rollouts):
        groups.setdefault(r.prompt_id, []).append(i)
    pairs, gaps, spreads = [], [], []
    for idx in groups.values():
        best = max(idx, key=lambda i: float(mean[i]))                     # argmax_k r(x, y_k)
        worst = min(idx, key=lambda i: float(mean[i]))                    # argmin_k r(x, y_k)
        room = max(max_length - len(rollouts[best].prompt_ids), 1)
        chosen, rejected = rollouts[best].response_ids[:room], rollouts[worst].response_ids[:room]
        # one sample, a tie, or one response twice: its two scores may part in the last bits
        # (rows of one batch round differently on some CPUs), which is no preference
        if float(mean[best]) == float(mean[worst]) or chosen == rejected:
            continue
        pairs.append(EncodedPair(rollouts[best].prompt_ids, chosen, rejected))
        gaps.append(float(mean[best] - mean[worst]))
        spreads.append(float(std[best] + std[worst]) / 2)
    return pairs, {"update/rm_pairs": float(len(pairs)),
                   "update/rm_pair_gap_mean": sum(gaps) / max(len(gaps), 1),
                   "update/rm_pair_std_mean": sum(spreads) / max(len(spreads), 1)}


def offpolicy_indices(n_onpolicy: int, pool_size: int, mix: float,
                      rng: torch.Generator) -> list[int]:
    """Which previous-pool pairs to mix in so that they make up `mix` of the training pairs:
    n_off = round(mix / (1 - mix) * n_on), at most the pool, drawn without replacement."""
    n_off = min(pool_size, round(mix / (1.0 - mix) * n_onpolicy)) if mix > 0 else 0
    return sorted(torch.randperm(pool_size, generator=rng)[:n_off].tolist())  # cpu: its generator
