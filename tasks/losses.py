"""The losses, as small pure functions with shapes and the papers' equations beside the lines."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(r_chosen: Tensor, r_rejected: Tensor) -> Tensor:
    """Per-pair reward-model loss. Inputs: scalar rewards, shape (B,). Returns (B,)."""
    return -F.logsigmoid(r_chosen - r_rejected)   # -log sigma(r_w - r_l), Ouyang et al. 2022 Eq. 1


def dpo_sigmoid_loss(pi_c: Tensor, pi_r: Tensor, ref_c: Tensor, ref_r: Tensor,
                     beta: float) -> Tensor:
    """Per-pair DPO loss. Inputs: summed completion log-probs, shape (B,). Returns (B,)."""
    logits = (pi_c - ref_c) - (pi_r - ref_r)      # h_theta(y_w, y_l)
    return -F.logsigmoid(beta * logits)           # Eq. 7, Rafailov et al. 2023


DPO_LOSSES: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]] = {
    "sigmoid": dpo_sigmoid_loss,
}


def dpo_implicit_rewards(pi: Tensor, ref: Tensor, beta: float) -> Tensor:
    """Implicit reward beta * log(pi/ref) of each completion, shape (B,)."""
    return beta * (pi - ref)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k1 estimate of KL(pi || ref) from samples of pi: log pi - log ref. (B, T)."""
    return logprobs - ref_logprobs


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate (unbiased, >= 0): (r - 1) - log r with r = ref/pi. (B, T)."""
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r             # Schulman 2020, "Approximating KL divergence"


def ppo_clip_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                  clip: float) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate, token-mean over the mask.

    Inputs (B, T): current and sampling-time log-probs, advantages, 0/1 mask of response tokens.
    Returns the scalar loss and the fraction of tokens where the clip was active.
    """
    ratio = torch.exp(logprobs - old_logprobs)                             # pi_theta / pi_old
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * advantages
    per_token = -torch.minimum(unclipped, clipped)                         # Eq. 7, Schulman 2017
    n = mask.sum().clamp(min=1.0)
    clipfrac = (((ratio - 1.0).abs() > clip).float() * mask).sum() / n
    return (per_token * mask).sum() / n, clipfrac


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Normalise x to zero mean, unit variance over the masked entries. (B, T) -> (B, T)."""
    n = mask.sum().clamp(min=1.0)
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * mask
