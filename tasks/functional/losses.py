"""The losses, as small pure functions with shapes and the papers' equations beside the lines."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(r_chosen: Tensor, r_rejected: Tensor) -> Tensor:
    """Per-pair reward-model loss. Inputs: scalar rewards, shape (B,). Returns (B,)."""
    return -F.logsigmoid(r_chosen - r_rejected)   # -log sigma(r_w - r_l), Ouyang et al. 2022 Eq. 1


def bradley_terry_margin_loss(r_chosen: Tensor, r_rejected: Tensor, margin: float) -> Tensor:
    """Bradley-Terry with a margin: the chosen must win by at least `margin`. (B,) -> (B,)."""
    return -F.logsigmoid(r_chosen - r_rejected - margin)   # Llama 2 (Touvron et al. 2023) Eq. 2


def dpo_sigmoid_loss(pi_c: Tensor, pi_r: Tensor, ref_c: Tensor, ref_r: Tensor,
                     beta: float) -> Tensor:
    """Per-pair DPO loss. Inputs: summed completion log-probs, shape (B,). Returns (B,)."""
    logits = (pi_c - ref_c) - (pi_r - ref_r)      # h_theta(y_w, y_l)
    return -F.logsigmoid(beta * logits)           # Eq. 7, Rafailov et al. 2023


def ipo_loss(pi_c: Tensor, pi_r: Tensor, ref_c: Tensor, ref_r: Tensor, beta: float) -> Tensor:
    """Per-pair IPO loss. Returns (B,).

    Normalisation: the inputs are PER-TOKEN MEAN completion log-probs, shape (B,) (the log-ratio
    h is averaged over each completion's tokens, not summed), so that the fixed target 1/(2 beta)
    means the same for short and long completions. The stage passes means when `loss: ipo`
    (see LENGTH_NORMALISED_LOSSES).
    """
    h = (pi_c - ref_c) - (pi_r - ref_r)           # h_pi(y_w, y_l), Azar et al. 2023
    return (h - 1.0 / (2.0 * beta)) ** 2          # Eq. 17, Azar et al. 2023 (tau = beta)


def cdpo_loss(pi_c: Tensor, pi_r: Tensor, ref_c: Tensor, ref_r: Tensor, beta: float,
              label_smoothing: float) -> Tensor:
    """Conservative DPO: labels flipped with probability eps. Summed log-probs (B,) -> (B,)."""
    logits = beta * ((pi_c - ref_c) - (pi_r - ref_r))                       # beta * h
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) \
        - label_smoothing * F.logsigmoid(-logits)  # Mitchell 2023, "A note on DPO with noisy prefs"


DPOLoss = Callable[[Tensor, Tensor, Tensor, Tensor, float, float], Tensor]
"""(pi_c, pi_r, ref_c, ref_r, beta, label_smoothing) -> per-pair loss (B,)."""

DPO_LOSSES: dict[str, DPOLoss] = {     # `update.dpo.loss` selects one
    "sigmoid": lambda pi_c, pi_r, ref_c, ref_r, beta, _eps: dpo_sigmoid_loss(
        pi_c, pi_r, ref_c, ref_r, beta),
    "ipo": lambda pi_c, pi_r, ref_c, ref_r, beta, _eps: ipo_loss(pi_c, pi_r, ref_c, ref_r, beta),
    "cdpo": cdpo_loss,
}
LENGTH_NORMALISED_LOSSES = frozenset({"ipo"})   # losses fed per-token mean log-probs, not sums


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


def ppo_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                   clip: float) -> tuple[Tensor, Tensor]:
    """Clipped value loss, token-mean over the mask.

    Inputs (B, T): current values, rollout-time values, return targets, 0/1 mask.
    Returns the scalar loss and the fraction of tokens where the clipped branch was larger.
    """
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)   # V_old + clip(V - V_old)
    loss_u, loss_c = (values - returns) ** 2, (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(loss_u, loss_c)   # PPO2 value clipping (baselines, 2017)
    n = mask.sum().clamp(min=1.0)
    return (per_token * mask).sum() / n, ((loss_c > loss_u).float() * mask).sum() / n


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Normalise x to zero mean, unit variance over the masked entries. (B, T) -> (B, T)."""
    n = mask.sum().clamp(min=1.0)
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * mask
