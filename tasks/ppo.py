"""A first PPO update: clipped surrogate on this iteration's rollouts, RM score as reward,
a per-token KL penalty to the reference, and a leave-one-out baseline over each prompt's K
samples (a critic with GAE replaces the baseline later).

The ratio pi_theta / pi_old uses the log-probs the sampler stored: the rollouts come from the
policy being updated, so the ratio starts at 1 and a few clipped epochs keep it near 1.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tasks import lm
from tasks.losses import kl_k1, ppo_clip_loss, whiten
from tasks.params import PPOParams
from tasks.records import Rollout


def _pad(rows: Sequence[Sequence[float]]) -> Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [0.0] * (width - len(r)) for r in rows])


def leave_one_out_baseline(scores: Tensor, groups: Sequence[str]) -> Tensor:
    """Mean score of the *other* samples of the same prompt, shape (B,)."""
    base = torch.zeros_like(scores)
    for g in set(groups):
        idx = torch.tensor([i for i, x in enumerate(groups) if x == g])
        s = scores[idx]
        base[idx] = (s.sum() - s) / max(len(idx) - 1, 1) if len(idx) > 1 else 0.0
    return base


def token_advantages(scores: Tensor, kl: Tensor, mask: Tensor, baseline: Tensor,
                     kl_coef: float) -> Tensor:
    """Return-to-go of r_t = -kl_coef * kl_t (+ score at the last token), minus the baseline.

    scores, baseline: (B,); kl, mask: (B, T). Returns (B, T), zero outside the mask.
    """
    rewards = -kl_coef * kl * mask                                         # (B, T)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(len(scores)), last] += scores
    returns = rewards.flip(-1).cumsum(-1).flip(-1)                         # G_t, gamma = 1
    return (returns - baseline[:, None]) * mask


def train_ppo(policy: torch.nn.Module, ref: torch.nn.Module, rollouts: Sequence[Rollout],
              scores: Tensor, p: PPOParams, pad_id: int, rng: torch.Generator
              ) -> dict[str, float]:
    """Optimise the policy in place on its own rollouts; returns `update/` metrics."""
    prompts = [r.prompt_ids for r in rollouts]
    responses = [r.response_ids for r in rollouts]
    temperature = float(rollouts[0].sampling.get("temperature", 1.0))
    old_logprobs = _pad([r.logprobs for r in rollouts])                    # (B, T)
    with torch.no_grad():
        ref_logprobs, mask = lm.response_logprobs(ref.eval(), prompts, responses, pad_id,
                                                  temperature)
    kl = kl_k1(old_logprobs, ref_logprobs) * mask                          # (B, T)
    baseline = leave_one_out_baseline(scores, [r.prompt_id for r in rollouts])
    advantages = whiten(token_advantages(scores, kl, mask, baseline, p.kl_coef), mask)
    opt = torch.optim.AdamW(policy.parameters(), lr=p.lr, weight_decay=0.0)
    losses, clipfracs, approx_kls = [], [], []
    policy.train()
    for _ in range(p.epochs):
        order = torch.randperm(len(rollouts), generator=rng)
        for s in range(0, len(order), p.minibatch_size):
            idx = order[s: s + p.minibatch_size]
            logprobs, m = lm.response_logprobs(policy, [prompts[i] for i in idx],
                                               [responses[i] for i in idx], pad_id, temperature)
            w = m.shape[1]
            loss, clipfrac = ppo_clip_loss(logprobs, old_logprobs[idx, :w],
                                           advantages[idx, :w], m, p.clip)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                approx_kls.append(float(((old_logprobs[idx, :w] - logprobs) * m).sum()
                                        / m.sum().clamp(min=1)))
            losses.append(loss.item())
            clipfracs.append(float(clipfrac))
    policy.eval()
    n = mask.sum().clamp(min=1)
    return {"update/steps": float(len(losses)), "update/n_rollouts": float(len(rollouts)),
            "update/loss_last": losses[-1], "update/clipfrac_mean": sum(clipfracs) / len(clipfracs),
            "update/approx_kl_last": approx_kls[-1], "update/score_mean": float(scores.mean()),
            "update/kl_to_ref_per_token": float(kl.sum() / n)}
