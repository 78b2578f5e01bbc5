"""Exact values of the losses and estimators in tasks/functional/losses.py."""
from __future__ import annotations

import math

import pytest
import torch

from tasks.functional.losses import (
    bradley_terry_loss,
    dpo_implicit_rewards,
    dpo_sigmoid_loss,
    kl_k1,
    kl_k3,
    ppo_clip_loss,
    whiten,
)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


# --- DPO --------------------------------------------------------------------------------------

def test_dpo_at_zero_margin_is_log2_per_pair() -> None:
    pi_c, pi_r, ref_c, ref_r = t(-3.0, -10.0, 0.0), t(-4.0, -2.0, -1.0), t(-3.0, -10.0, 0.0), \
        t(-4.0, -2.0, -1.0)
    loss = dpo_sigmoid_loss(pi_c, pi_r, ref_c, ref_r, beta=0.1)
    assert loss.shape == (3,)
    assert torch.allclose(loss, torch.full((3,), math.log(2), dtype=torch.float64), atol=1e-12)


def test_dpo_zero_margin_when_policy_moves_both_completions_equally() -> None:
    # policy - reference is +0.7 on both sides: the implicit reward margin is still zero
    loss = dpo_sigmoid_loss(t(-1.3), t(-2.3), t(-2.0), t(-3.0), beta=0.5)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-12)


def test_dpo_hand_computed_nonzero_margin() -> None:
    # h = (pi_c - ref_c) - (pi_r - ref_r) = (-1 - -2) - (-3 - -2) = 2; beta * h = 1
    loss = dpo_sigmoid_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-12)   # 0.3132617
    # the opposite preference is penalised more
    worse = dpo_sigmoid_loss(t(-3.0), t(-1.0), t(-2.0), t(-2.0), beta=0.5)
    assert worse.item() == pytest.approx(math.log1p(math.exp(1.0)), abs=1e-12)


def test_dpo_implicit_rewards() -> None:
    assert torch.allclose(dpo_implicit_rewards(t(-1.0, -5.0), t(-2.0, -4.0), 0.1), t(0.1, -0.1))


# --- Bradley-Terry ----------------------------------------------------------------------------

def test_bradley_terry_equals_minus_log_sigmoid_of_difference() -> None:
    r_c, r_r = t(0.0, 2.0, -1.0, 5.0), t(0.0, 0.0, 2.0, 5.0)
    expected = t(*[-math.log(1.0 / (1.0 + math.exp(-(c - r))))
                   for c, r in zip(r_c.tolist(), r_r.tolist())])
    loss = bradley_terry_loss(r_c, r_r)
    assert torch.allclose(loss, expected, atol=1e-12)
    assert loss[0].item() == pytest.approx(math.log(2), abs=1e-12)
    assert loss[2].item() == pytest.approx(math.log1p(math.exp(3.0)), abs=1e-12)


# --- KL estimators ----------------------------------------------------------------------------

def test_k1_and_k3_hand_values() -> None:
    logp, ref = t(math.log(0.5), math.log(0.25)), t(math.log(0.25), math.log(0.5))
    assert torch.allclose(kl_k1(logp, ref), t(math.log(2), -math.log(2)), atol=1e-12)
    # k3 = (r - 1) - log r with r = ref / pi
    expected = t((0.5 - 1) - math.log(0.5), (2.0 - 1) - math.log(2.0))   # 0.19315, 0.30685
    assert torch.allclose(kl_k3(logp, ref), expected, atol=1e-12)
    assert torch.equal(kl_k3(t(-2.0), t(-2.0)), t(0.0))


def test_k3_is_nonnegative() -> None:
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(2000, generator=g, dtype=torch.float64) * 5
    ref = torch.randn(2000, generator=g, dtype=torch.float64) * 5
    assert bool((kl_k3(logp, ref) >= 0).all())
    # k1 is not: it is negative wherever ref > pi
    assert bool((kl_k1(logp, ref) < 0).any())


def test_k1_and_k3_sample_means_approximate_exact_kl() -> None:
    p = t(0.7, 0.1, 0.1, 0.1)
    q = t(0.1, 0.3, 0.3, 0.3)
    exact = float((p * (p / q).log()).sum())                 # brute-force KL(p || q) = 1.0326
    assert exact == pytest.approx(0.7 * math.log(7) + 0.3 * math.log(1 / 3))
    g = torch.Generator().manual_seed(0)
    x = torch.multinomial(p.float(), 200_000, replacement=True, generator=g)
    logp, ref = p.log()[x], q.log()[x]
    k3 = kl_k3(logp, ref)
    assert float(k3.mean()) == pytest.approx(exact, abs=0.003)
    assert float(kl_k1(logp, ref).mean()) == pytest.approx(exact, abs=0.02)
    # the reverse direction is a different number: the estimator is not symmetric by accident
    reverse = float((q * (q / p).log()).sum())
    assert abs(reverse - exact) > 0.2


# --- PPO clipped surrogate --------------------------------------------------------------------

def test_ppo_clip_loss_at_ratio_one_is_minus_mean_advantage() -> None:
    logprobs = t(-1.0, -2.0, -0.5, -3.0, -1.5, -0.1).reshape(2, 3)
    advantages = t(1.0, -2.0, 0.5, 3.0, 100.0, -1.0).reshape(2, 3)
    mask = t(1, 1, 1, 1, 0, 0).reshape(2, 3)               # the 100 is outside the mask
    loss, clipfrac = ppo_clip_loss(logprobs, logprobs.clone(), advantages, mask, clip=0.2)
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5 + 3.0) / 4, abs=1e-12)
    assert clipfrac.item() == 0.0


def test_ppo_clip_gradient_at_ratio_one_is_plain_policy_gradient() -> None:
    torch.manual_seed(0)
    b, steps, vocab = 3, 4, 5
    theta = torch.randn(b, steps, vocab, dtype=torch.float64, requires_grad=True)
    actions = torch.randint(0, vocab, (b, steps))
    advantages = torch.randn(b, steps, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)

    def logprobs() -> torch.Tensor:
        return torch.log_softmax(theta, -1).gather(-1, actions[..., None]).squeeze(-1)

    lp = logprobs()
    loss, _ = ppo_clip_loss(lp, lp.detach(), advantages, mask, clip=0.2)
    (g_ppo,) = torch.autograd.grad(loss, theta)
    pg = -(advantages * logprobs() * mask).sum() / mask.sum()       # REINFORCE, token mean
    (g_pg,) = torch.autograd.grad(pg, theta)
    assert g_ppo.abs().sum() > 0
    assert torch.allclose(g_ppo, g_pg, atol=1e-12)


def test_ppo_clip_fraction_and_clipped_value() -> None:
    old = torch.zeros(1, 4, dtype=torch.float64)
    # ratios exp(.) = 1, 1.65, 0.61, 1.105 with clip 0.2: the 2nd and 3rd are outside [0.8, 1.2]
    logprobs = t(0.0, 0.5, -0.5, 0.1).reshape(1, 4).requires_grad_(True)
    advantages = t(1.0, 1.0, -1.0, 1.0).reshape(1, 4)
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, clipfrac = ppo_clip_loss(logprobs, old, advantages, mask, clip=0.2)
    assert clipfrac.item() == pytest.approx(0.5)
    # per token -min(r A, clip(r) A): -1, -1.2, -(-0.8)... min(0.61*-1, 0.8*-1) = -0.8 -> +0.8
    expected = (-1.0 - 1.2 + 0.8 - math.exp(0.1)) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert grad[0, 1].item() == 0.0 and grad[0, 2].item() == 0.0     # clipped: no gradient
    assert grad[0, 3].item() == pytest.approx(-math.exp(0.1) / 4)
    # masked-out tokens do not count towards the clip fraction
    _, clipfrac = ppo_clip_loss(logprobs, old, advantages, t(1, 1, 0, 1).reshape(1, 4), 0.2)
    assert clipfrac.item() == pytest.approx(1 / 3)


# --- whitening --------------------------------------------------------------------------------

def test_whiten_zero_mean_unit_variance_over_mask_and_zero_outside() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64) * 3 + 7
    mask = (torch.rand(4, 6, generator=g) > 0.3).double()
    mask[0, 0], mask[0, 1] = 1.0, 0.0
    x[0, 1] = 1e6                                    # a huge value outside the mask is ignored
    w = whiten(x, mask)
    n = mask.sum()
    mean = (w * mask).sum() / n
    var = ((w - mean) ** 2 * mask).sum() / n
    assert mean.item() == pytest.approx(0.0, abs=1e-9)
    assert var.item() == pytest.approx(1.0, abs=1e-6)
    assert bool((w[mask == 0] == 0).all())
    # order is kept: whitening is an increasing affine map on the masked entries
    sel = mask.bool()
    assert torch.equal(x[sel].argsort(), w[sel].argsort())
