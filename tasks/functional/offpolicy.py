"""Off-policy estimators for reusing earlier samples: truncated importance weights, the
pessimistic truncated surrogate, effective sample size and staleness.

A reused sample y ~ mu (the behaviour policy that sampled it, whose per-token log-probs the
rollout or pair stores) is reweighted towards the current policy pi by w = pi(y) / mu(y),
truncated to [lo, hi] (truncation trades a bias for a bounded variance; Ionides 2008,
Espeholt et al. 2018). A reused preference pair (y_w, y_l), two draws of mu, carries the
product of its sides' length-normalised ratios, truncated above (`pair_is_weights`).
Staleness counts policy versions along the `prev` chain (`versions_back`).
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


def mean_log_ratio(logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token mean log pi/mu of each response: (1/|y|) sum_t (log pi(y_t) - log mu(y_t)).
    Inputs (B, T), mask 0/1; returns (B,) (0 for an empty response)."""
    n = mask.sum(-1).clamp(min=1.0)                                  # |y|
    return ((logprobs - behaviour_logprobs) * mask).sum(-1) / n


def pair_is_weights(log_ratio_chosen: Tensor, log_ratio_rejected: Tensor, hi: float
                    ) -> tuple[Tensor, Tensor]:
    """Truncated weights of preference pairs and their raw values, each (B,):

        w = min(hi, exp(lbar_w + lbar_l)),  lbar = mean_t log pi(y_t)/mu(y_t)

    the pair's two responses are independent draws of mu, so its ratio is the product of
    theirs; each is length-normalised (the geometric mean of the per-token ratios, the
    sequence ratio of GSPO, Zheng et al. 2025), which bounds its spread independently of
    the response length at the price of a bias towards 1. Inputs (B,) from mean_log_ratio.
    """
    raw = torch.exp(log_ratio_chosen + log_ratio_rejected)          # (pi/mu)^(1/|y_w|) ...
    return torch.clamp(raw, max=hi), raw                             # w~ = min(c, w)


def weight_metrics(weights: Tensor, raw: Tensor, origins: Sequence[int | str], lo: float,
                   hi: float, prefix: str) -> dict[str, float]:
    """ESS, ESS / n, the fraction truncated (raw outside [lo, hi]) and the mean weight of
    reused units (responses, pairs or tokens; weights and raw (n,)), over all of them
    (`{prefix}_ess`, ...) and per iteration of origin (`{prefix}/iter_{i}/ess`, ...; an origin
    given as a name, e.g. `book_iter_3` for a pair of another workspace's iteration 3:
    `{prefix}/book_iter_3/ess`)."""
    out: dict[str, float] = {}
    groups: dict[str, list[int]] = {"": list(range(len(origins)))}
    for j, i in enumerate(origins):
        groups.setdefault(f"/{i}/" if isinstance(i, str) else f"/iter_{i}/", []).append(j)
    for key, idx in groups.items():
        at = torch.tensor(idx, dtype=torch.long)
        w, r = weights.flatten().cpu()[at], raw.flatten().cpu()[at]
        n, ess = len(idx), effective_sample_size(w)
        name = f"{prefix}_" if key == "" else f"{prefix}{key}"
        out.update({f"{name}n": float(n), f"{name}ess": ess,
                    f"{name}ess_frac": ess / n if n else 0.0,
                    f"{name}truncated_frac": float(((r < lo) | (r > hi)).sum()) / n if n else 0.0,
                    f"{name}weight_mean": float(w.double().mean()) if n else 0.0})
    return out


def versions_back(samplers: Sequence[int], lineage: Sequence[int]) -> list[int]:
    """Staleness: the policy versions between each sample's sampler and the policy an update
    starts from, i.e. the sampler's place in `lineage` (that policy, its parent, ..., the
    initial model: the `prev` chain). A sampler off the chain counts as older than all of it
    (len(lineage))."""
    where = {v: j for j, v in enumerate(lineage)}
    return [where.get(s, len(lineage)) for s in samplers]


def reuse_metrics(weights: Tensor, raw: Tensor, mask: Tensor, ages: Sequence[int],
                  origins: Sequence[int], lo: float, hi: float, level: Level) -> dict[str, float]:
    """ESS (plain and / n), fraction truncated and mean weight of the reused samples, over all
    and per iteration of origin (`weight_metrics`), with their count and mean staleness.

    weights, raw, mask: (B, T) from truncated_is_weights; ages, origins: one per response. At
    sequence level the unit is a response (its first token carries its weight), at token
    level a token (of its response's origin).
    """
    if level == "token":
        keep = mask.bool()
        w, r = weights[keep], raw[keep]
        unit_origins = [origins[b] for b in keep.nonzero()[:, 0].tolist()]
    else:
        first = mask[:, 0].bool()
        w, r = weights[first, 0], raw[first, 0]
        unit_origins = [o for o, f in zip(origins, first.tolist()) if f]
    out = weight_metrics(w, r, unit_origins, lo, hi, "update/reuse")
    out["update/reuse_n"] = float(len(ages))                         # responses
    out["update/reuse_staleness_mean"] = sum(ages) / len(ages) if ages else 0.0
    return out
