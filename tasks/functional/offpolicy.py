"""Off-policy estimators for reusing earlier rollouts: truncated importance weights, the
pessimistic truncated surrogate, effective sample size and staleness.

A reused sample y ~ mu (the behaviour policy that sampled it, whose per-token log-probs the
rollout stores) is reweighted towards the current policy pi by w = pi(y) / mu(y), truncated to
[lo, hi] (truncation trades a bias for a bounded variance; Ionides 2008, Espeholt et al. 2018).
Pure tensor functions: no model, no I/O.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

Level = Literal["token", "sequence"]


def log_ratios(logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor,
               level: Level) -> Tensor:
    """log pi/mu per token (B, T), or summed over each response and broadcast to (B, T)."""
    per_token = (logprobs - behaviour_logprobs) * mask               # log pi(y_t) - log mu(y_t)
    if level == "token":
        return per_token
    return per_token.sum(-1, keepdim=True) * mask                    # log prod_t pi/mu


def truncated_is_weights(logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor,
                         lo: float, hi: float, level: Level) -> tuple[Tensor, Tensor]:
    """Truncated importance weights w~ = clip(pi/mu, lo, hi) and the raw weights pi/mu.

    Inputs (B, T): current and behaviour log-probs, 0/1 response mask. Returns two (B, T)
    tensors, zero outside the mask (at sequence level every token carries its sequence's weight).
    """
    raw = torch.exp(log_ratios(logprobs, behaviour_logprobs, mask, level)) * mask
    return torch.clamp(raw, lo, hi) * mask, raw                      # w~ = min(max(w, lo), hi)


def truncated_is_estimate(f: Tensor, logprobs: Tensor, behaviour_logprobs: Tensor,
                          lo: float, hi: float) -> Tensor:
    """(1/N) sum_i clip(pi(y_i)/mu(y_i), lo, hi) f(y_i) for y_i ~ mu: estimates E_pi[f].

    Inputs (..., N): f(y_i) and the log-densities of y_i under pi and mu; the mean is over the
    last axis, so (S, N) gives S independent estimates, shape (S,).
    """
    w = torch.clamp(torch.exp(logprobs - behaviour_logprobs), lo, hi)
    return (w * f).mean(-1)                                          # unbiased when lo=0, hi=inf


def truncated_is_surrogate(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
                           lo: float, hi: float) -> Tensor:
    """Pessimistic truncated IS objective (to maximise), mean over samples:

        L = mean_i min(w_i A_i, clip(w_i, lo, hi) A_i),   w_i = pi(y_i) / mu(y_i)

    the PPO-clip form (Schulman et al. 2017, Eq. 7) with the behaviour policy as pi_old and
    [lo, hi] as the clip range: truncation only removes gradient where it would make the step
    more optimistic. Inputs (N,); differentiable in logprobs. Returns a scalar.
    """
    w = torch.exp(logprobs - behaviour_logprobs)
    return torch.minimum(w * advantages, torch.clamp(w, lo, hi) * advantages).mean()


def effective_sample_size(weights: Tensor) -> float:
    """Kish's ESS = (sum w)^2 / sum w^2 over the entries of weights (any shape); 0 if empty."""
    w = weights.flatten().double()
    denom = float((w * w).sum())
    return float(w.sum() ** 2 / denom) if denom > 0 else 0.0


def staleness(iterations: Sequence[int], current: int, device: torch.device | str = "cpu"
              ) -> Tensor:
    """Iterations since each sample was drawn: current - iteration, shape (B,), on `device`."""
    return torch.tensor([current - i for i in iterations], dtype=torch.float32, device=device)


def fresh_enough(iterations: Sequence[int], current: int, max_staleness: int) -> list[bool]:
    """Which samples may be reused: drawn at most max_staleness iterations ago."""
    return [0 <= current - i <= max_staleness for i in iterations]


def reuse_metrics(weights: Tensor, raw: Tensor, mask: Tensor, ages: Tensor, lo: float,
                  hi: float, level: Level) -> dict[str, float]:
    """ESS (plain and / n), fraction truncated and mean staleness of the reused samples.

    weights, raw, mask: (B, T) from truncated_is_weights; ages: (B,). At sequence level the
    unit is a response (its first token carries its weight), at token level a token.
    """
    if level == "token":
        w, r = weights[mask.bool()], raw[mask.bool()]
    else:
        first = mask[:, 0].bool()
        w, r = weights[first, 0], raw[first, 0]
    n = max(int(w.numel()), 1)
    ess = effective_sample_size(w)
    return {"update/reuse_n": float(ages.numel()), "update/reuse_ess": ess,
            "update/reuse_ess_frac": ess / n,
            "update/reuse_truncated_frac": float(((r < lo) | (r > hi)).float().sum()) / n,
            "update/reuse_staleness_mean": float(ages.mean()) if ages.numel() else 0.0}
