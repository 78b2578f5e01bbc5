"""Direct Preference Optimisation on judged pairs: the training loop around tasks/losses.py."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tasks import lm
from tasks.losses import DPO_LOSSES, dpo_implicit_rewards
from tasks.params import DPOParams
from tasks.reward_model import EncodedPair


def _pair_logprobs(model: torch.nn.Module, batch: Sequence[EncodedPair],
                   pad_id: int) -> tuple[Tensor, Tensor]:
    """Summed log-probs of chosen and rejected completions, each (B,), one forward pass."""
    prompts = [e.prompt_ids for e in batch] * 2
    responses = [e.chosen_ids for e in batch] + [e.rejected_ids for e in batch]
    logp = lm.sequence_logprob(model, prompts, responses, pad_id)
    return logp[: len(batch)], logp[len(batch):]


@torch.no_grad()
def reference_logprobs(ref: torch.nn.Module, pairs: Sequence[EncodedPair], pad_id: int,
                       batch_size: int) -> tuple[Tensor, Tensor]:
    chosen, rejected = [], []
    for s in range(0, len(pairs), batch_size):
        c, r = _pair_logprobs(ref, pairs[s: s + batch_size], pad_id)
        chosen.append(c)
        rejected.append(r)
    return torch.cat(chosen), torch.cat(rejected)


def train_dpo(policy: torch.nn.Module, ref: torch.nn.Module, pairs: Sequence[EncodedPair],
              p: DPOParams, pad_id: int, rng: torch.Generator) -> dict[str, float]:
    """Optimise the policy in place on the pairs; returns `update/` metrics."""
    if not pairs:
        return {"update/steps": 0.0, "update/n_pairs": 0.0}
    ref.eval()
    ref_c, ref_r = reference_logprobs(ref, pairs, pad_id, p.batch_size)     # (N,), (N,)
    loss_fn = DPO_LOSSES[p.loss]
    opt = torch.optim.AdamW(policy.parameters(), lr=p.lr, weight_decay=0.0)
    losses, accs, margins = [], [], []
    policy.train()
    for _ in range(p.epochs):
        order = torch.randperm(len(pairs), generator=rng)
        for s in range(0, len(order), p.batch_size):
            idx = order[s: s + p.batch_size]
            pi_c, pi_r = _pair_logprobs(policy, [pairs[i] for i in idx.tolist()], pad_id)
            loss = loss_fn(pi_c, pi_r, ref_c[idx], ref_r[idx], p.beta).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                r_c = dpo_implicit_rewards(pi_c, ref_c[idx], p.beta)
                r_r = dpo_implicit_rewards(pi_r, ref_r[idx], p.beta)
                accs.append(float((r_c > r_r).float().mean()))
                margins.append(float((r_c - r_r).mean()))
            losses.append(loss.item())
    policy.eval()
    return {"update/steps": float(len(losses)), "update/n_pairs": float(len(pairs)),
            "update/loss_first": losses[0], "update/loss_last": losses[-1],
            "update/reward_accuracy_last": accs[-1], "update/reward_margin_last": margins[-1]}
