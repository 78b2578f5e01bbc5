"""Off-policy estimators (tasks/functional/offpolicy.py): exact weights and ESS, the truncated IS
estimator against a brute-force expectation, and the seeds' demonstration — a Gaussian policy N(mu,
1) trained from a fixed batch drawn at mu = 0 towards a reward peaked at 1.3."""
from __future__ import annotations

import math

import pytest
import torch

from tasks.functional.offpolicy import (
    effective_sample_size,
    reuse_metrics,
    truncated_is_estimate,
    truncated_is_surrogate,
    truncated_is_weights,
    versions_back,
)

TARGET = 1.3                       # the reward's optimum: r(y) = -(y - 1.3)^2


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


# --- weights, ESS, staleness ------------------------------------------------------------------

def test_token_and_sequence_level_truncated_weights() -> None:
    logp = t(-1.0, -2.0, -0.5, -1.0, 0.0, 0.0).reshape(2, 3)
    beh = t(-1.5, -1.0, -0.5, -1.2, 9.0, 9.0).reshape(2, 3)
    mask = t(1, 1, 1, 1, 0, 0).reshape(2, 3)                  # row 2: one token
    w, raw = truncated_is_weights(logp, beh, mask, 0.5, 1.5, "token")
    assert raw[0].tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 1.0])
    assert w[0].tolist() == pytest.approx([1.5, 0.5, 1.0])
    assert w[1].tolist() == pytest.approx([math.exp(0.2), 0.0, 0.0])  # off-mask: 0
    w, raw = truncated_is_weights(logp, beh, mask, 0.5, 1.5, "sequence")
    assert raw[0].tolist() == pytest.approx([math.exp(-0.5)] * 3)     # exp(0.5 - 1 + 0)
    assert w[0].tolist() == pytest.approx([math.exp(-0.5)] * 3)       # 0.607: inside
    assert w[1].tolist() == pytest.approx([math.exp(0.2), 0.0, 0.0])


def test_effective_sample_size() -> None:
    assert effective_sample_size(torch.ones(7)) == pytest.approx(7.0)
    assert effective_sample_size(t(0.0, 0.0, 3.0)) == pytest.approx(1.0)
    assert effective_sample_size(t(1.0, 3.0)) == pytest.approx(16 / 10)
    assert effective_sample_size(torch.zeros(3)) == 0.0


def test_versions_back_is_the_place_on_the_lineage() -> None:
    assert versions_back([2, 1, 0], [2, 1, 0]) == [0, 1, 2]         # linear: 2 <- 1 <- 0
    # a branch: iteration 3 continued from 1 (2 was refused); 2 is off the chain: older than all
    assert versions_back([3, 1, 0, 2], [3, 1, 0]) == [0, 1, 2, 3]


def test_reuse_metrics_sequence_level() -> None:
    mask = t(1, 1, 1, 0, 1, 1).reshape(3, 2)
    raw = t(4.0, 4.0, 0.5, 0.0, 1.0, 1.0).reshape(3, 2)
    w = raw.clamp(0.0, 2.0) * mask
    m = reuse_metrics(w, raw, mask, [1, 1, 2], [2, 2, 1], 0.0, 2.0, "sequence")
    assert m["update/reuse_ess"] == pytest.approx(3.5 ** 2 / 5.25)    # weights 2, 0.5, 1
    assert m["update/reuse_ess_frac"] == pytest.approx(3.5 ** 2 / 5.25 / 3)
    assert m["update/reuse_truncated_frac"] == pytest.approx(1 / 3)
    assert m["update/reuse_staleness_mean"] == pytest.approx(4 / 3)
    # per iteration of origin: iteration 2 drew weights 2 (truncated from 4) and 0.5,
    # ESS = 2.5^2 / (4 + 0.25) = 1.4706; iteration 1 drew weight 1 alone, ESS 1
    assert m["update/reuse/iter_2/ess"] == pytest.approx(6.25 / 4.25, abs=1e-12)
    assert m["update/reuse/iter_2/ess_frac"] == pytest.approx(6.25 / 4.25 / 2, abs=1e-12)
    assert m["update/reuse/iter_2/truncated_frac"] == 0.5
    assert m["update/reuse/iter_1/ess"] == pytest.approx(1.0, abs=1e-12)
    assert m["update/reuse/iter_1/truncated_frac"] == 0.0


def test_reuse_metrics_token_level_counts_tokens_by_their_response_origin() -> None:
    mask = t(1, 1, 1, 0).reshape(2, 2)                        # response 1: 2 tokens, 2: 1
    raw = t(3.0, 1.0, 0.5, 0.0).reshape(2, 2)
    w = raw.clamp(0.0, 2.0) * mask                            # 2, 1 | 0.5
    m = reuse_metrics(w, raw, mask, [1, 2], [4, 3], 0.0, 2.0, "token")
    assert m["update/reuse_n"] == 2.0                         # responses
    assert m["update/reuse/iter_4/n"] == 2.0                  # its tokens
    assert m["update/reuse/iter_4/ess"] == pytest.approx(9 / 5, abs=1e-12)   # (2+1)^2/(4+1)
    assert m["update/reuse/iter_3/ess"] == pytest.approx(1.0, abs=1e-12)
    assert m["update/reuse_ess"] == pytest.approx(3.5 ** 2 / 5.25, abs=1e-12)
    assert m["update/reuse_staleness_mean"] == 1.5


# --- the truncated estimator against brute force ----------------------------------------------

def test_truncated_is_estimator_matches_brute_force_expectation() -> None:
    p = t(0.6, 0.2, 0.1, 0.1)                  # target pi
    q = t(0.1, 0.2, 0.3, 0.4)                  # behaviour mu
    f = t(1.0, -2.0, 0.5, 3.0)
    lo, hi = 0.5, 2.0
    brute_truncated = float((q * (p / q).clamp(lo, hi) * f).sum())   # E_mu[clip(pi/mu) f]
    brute_exact = float((p * f).sum())                                # E_pi[f] = 0.55
    assert brute_exact == pytest.approx(0.6 - 0.4 + 0.05 + 0.3)
    g = torch.Generator().manual_seed(0)
    n = 400_000
    x = torch.multinomial(q.float(), n, replacement=True, generator=g)
    est_t = float(truncated_is_estimate(f[x], p.log()[x], q.log()[x], lo, hi))
    est_u = float(truncated_is_estimate(f[x], p.log()[x], q.log()[x], 0.0, math.inf))
    # tolerance: 5 standard errors of each estimator, from its exact per-sample variance
    var_t = float((q * ((p / q).clamp(lo, hi) * f) ** 2).sum()) - brute_truncated ** 2
    var_u = float((q * ((p / q) * f) ** 2).sum()) - brute_exact ** 2
    assert est_t == pytest.approx(brute_truncated, abs=5 * math.sqrt(var_t / n))
    assert est_u == pytest.approx(brute_exact, abs=5 * math.sqrt(var_u / n))
    # weights 6, 1, 1/3, 1/4 clip to 2, 1, 0.5, 0.5: 0.2 - 0.4 + 0.075 + 0.6
    assert brute_truncated == pytest.approx(0.475)       # truncation is a bias (0.075) ...
    assert var_t < var_u / 2                             # ... bought with a smaller variance


# --- the seeds' Gaussian demonstration --------------------------------------------------------

def log_normal(y: torch.Tensor, mu: torch.Tensor | float) -> torch.Tensor:
    return -0.5 * (y - mu) ** 2 - 0.5 * math.log(2 * math.pi)     # log N(y; mu, 1)


def train_gaussian(lo: float, hi: float, seeds: int, n: int, steps: int = 60, lr: float = 0.3
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient ascent on the pessimistic truncated surrogate from one fixed batch per seed.

    Batch y ~ N(0, 1), shape (seeds, n); advantage r(y) - b with b the truncated-weighted mean
    reward. Returns the final means (seeds,) and the raw weights and batch at the end."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(seeds, n, generator=g, dtype=torch.float64)
    r, behaviour = -(y - TARGET) ** 2, log_normal(y, 0.0)
    mu = torch.zeros(seeds, 1, dtype=torch.float64, requires_grad=True)
    for _ in range(steps):
        logp = log_normal(y, mu)
        w = torch.exp(logp - behaviour).clamp(lo, hi).detach()
        baseline = (w * r).sum(1, keepdim=True) / w.sum(1, keepdim=True)
        objective = truncated_is_surrogate(logp, behaviour, r - baseline, lo, hi) * seeds
        (grad,) = torch.autograd.grad(objective, mu)          # each seed's own gradient
        with torch.no_grad():
            mu += lr * grad
    raw = torch.exp(log_normal(y, mu.detach()) - behaviour)
    return mu.detach().squeeze(1), raw, y


def test_clipped_off_policy_gaussian_moves_to_the_reward_optimum() -> None:
    """Truncation [0, 5]: 16 seeds, 10k samples each.

    Tolerance 0.12 on the seed mean: the population fixed point of this truncated surrogate is
    1.29-1.30 (quadrature, truncation bias < 0.02); the fixed point of a finite batch is biased
    up by ~0.17 / n_eff (~0.02 here; measured 1.355 at n = 3000, 1.304 at 20000); and the
    per-seed spread is ~0.09, so 4 standard errors of a 16-seed mean are 0.09.
    Measured: mean 1.295, spread 0.081, range 1.13-1.45 (unclipped: 1.303, 0.079)."""
    mus, raw, _ = train_gaussian(0.0, 5.0, seeds=16, n=10_000)
    assert float(mus.mean()) == pytest.approx(TARGET, abs=0.12)
    assert float(mus.std()) < 0.2
    assert bool((mus > 0.9).all() and (mus < 1.8).all())          # every seed moved, none flew
    ess_frac = sum(effective_sample_size(raw[s]) for s in range(16)) / 16 / 10_000
    assert 0.1 < ess_frac < 0.3            # at mu = 1.3 E_0[w^2] = e^1.69: ESS/n ~ 0.18


def test_unclipped_ratios_blow_up_the_variance_as_the_target_moves_away() -> None:
    """The same batch, the plain IS estimate of E_pi[r] at pi = N(mu, 1) over 400 seeds of 1000
    samples: its spread grows like sqrt(exp(mu^2)) and ESS/n collapses; the truncated one stays
    bounded (and biased)."""
    g = torch.Generator().manual_seed(1)
    y = torch.randn(400, 1000, generator=g, dtype=torch.float64)
    r, behaviour = -(y - TARGET) ** 2, log_normal(y, 0.0)
    spread, spread_t, ess = {}, {}, {}
    for mu in (0.5, 1.3, 2.6):
        logp = log_normal(y, mu)
        spread[mu] = float(truncated_is_estimate(r, logp, behaviour, 0.0, math.inf).std())
        spread_t[mu] = float(truncated_is_estimate(r, logp, behaviour, 0.0, 5.0).std())
        ess[mu] = sum(effective_sample_size(torch.exp(logp[s] - behaviour[s]))
                      for s in range(400)) / 400 / 1000
        true = -(mu - TARGET) ** 2 - 1.0                             # E_pi[r], brute force
        mean_u = float(truncated_is_estimate(r, logp, behaviour, 0.0, math.inf).mean())
        if mu <= 1.3:
            assert mean_u == pytest.approx(true, abs=5 * spread[mu] / 20)   # unbiased
    # measured: spread 0.04 -> 0.25 -> 3.8; truncated 0.04 -> 0.03 -> 0.04; ESS/n .78 .21 .02
    assert spread[2.6] > 8 * spread[1.3] > 8 * 3 * spread[0.5]
    assert all(s < 0.1 for s in spread_t.values())
    assert spread[2.6] > 30 * spread_t[2.6]
    assert ess[0.5] > 0.6 and ess[2.6] < 0.05


def test_the_seeds_recipe_without_a_baseline_diverges() -> None:
    """The seeds' numpy demo (weights clipped to [0.5, 2] times the score function, reward
    without a baseline, lr 0.1) has no fixed point: the always-negative reward and the raised
    small weights keep pushing mu up. It passes the optimum within 10 epochs and keeps going —
    why the stage uses the pessimistic (PPO-form) truncation with a baseline instead."""
    g = torch.Generator().manual_seed(42)
    y = torch.randn(3000, generator=g, dtype=torch.float64)
    r, mu = -(y - TARGET) ** 2, 0.0
    for _ in range(50):
        w = torch.exp(log_normal(y, mu) - log_normal(y, 0.0)).clamp(0.5, 2.0)
        mu += 0.1 * float((w * r * (y - mu)).mean())                # grad log N = (y - mu)
    assert mu > 10 * TARGET
