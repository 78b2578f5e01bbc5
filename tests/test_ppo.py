"""PPO with a critic: exact values of GAE, rewards, value clipping and score shaping; the full
objective at ratio 1 is the plain policy gradient; KL modes, early stop, no-EOS handling on a
tiny model (the update stage end to end: tests/test_ppo_stage.py)."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tasks.config.params import PPOParams, ReuseParams
from tasks.data.records import Message, Rollout
from tasks.functional.losses import ppo_clip_loss, ppo_value_loss
from tasks.policy import value_head
from tasks.policy.ppo import (
    gae,
    make_experience,
    minibatch_loss,
    prompt_minibatches,
    shape_scores,
    token_rewards,
    train_ppo,
)
from tasks.schemas.generation import GenerationParams

REPO = Path(__file__).resolve().parents[1]


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


# --- minibatches of whole prompt groups ------------------------------------------------------

def test_prompt_minibatches_partition_the_batch_by_whole_groups() -> None:
    # 5 prompts with 3, 3, 2, 3, 1 rollouts, interleaved as a replay batch would be
    prompts = [(1,), (1,), (2,), (1,), (2,), (2,), (3,), (3,), (4,), (4,), (4,), (5,)]
    batches = prompt_minibatches(prompts, 4, torch.Generator().manual_seed(0))
    flat = [i for b in batches for i in b.tolist()]
    assert sorted(flat) == list(range(len(prompts)))                  # every rollout once
    for b in batches:                                                 # groups never split
        ids = {prompts[i] for i in b.tolist()}
        assert sum(prompts.count(x) for x in ids) == len(b)
    assert all(len(b) >= 4 for b in batches[:-1])                     # cut at >= size
    again = prompt_minibatches(prompts, 4, torch.Generator().manual_seed(0))
    other = prompt_minibatches(prompts, 4, torch.Generator().manual_seed(1))
    assert [b.tolist() for b in again] == [b.tolist() for b in batches]
    assert [b.tolist() for b in other] != [b.tolist() for b in batches]


# --- GAE and rewards --------------------------------------------------------------------------

def naive_gae(rewards: list[float], values: list[float], gamma: float, lam: float
              ) -> list[float]:
    """A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V_T = 0."""
    n = len(rewards)
    v = values + [0.0]
    deltas = [rewards[i] + gamma * v[i + 1] - v[i] for i in range(n)]
    return [sum((gamma * lam) ** k * deltas[i + k] for k in range(n - i)) for i in range(n)]


def test_gae_equals_a_naive_loop_over_ragged_responses() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [5, 3, 1, 4]
    rewards = torch.randn(4, 5, generator=g, dtype=torch.float64)
    values = torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths], dtype=torch.float64)
    rewards, values = rewards * mask, values * mask
    rewards[1, 4] = values[1, 4] = 1e6 * 0          # padding stays zero (it is masked anyway)
    for gamma, lam in [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0), (1.0, 1.0)]:
        adv, ret = gae(rewards, values, mask, gamma, lam)
        for i, n in enumerate(lengths):
            expected = naive_gae(rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam)
            assert adv[i, :n].tolist() == pytest.approx(expected, abs=1e-12)
            assert ret[i, :n].tolist() == pytest.approx(
                [a + v for a, v in zip(expected, values[i, :n].tolist())], abs=1e-12)
        assert bool((adv[mask == 0] == 0).all()) and bool((ret[mask == 0] == 0).all())


def test_gae_with_lambda_one_is_return_to_go_minus_value() -> None:
    rewards, values, mask = t(0.0, -0.1, 2.0).reshape(1, 3), t(0.5, 0.2, 1.0).reshape(1, 3), \
        torch.ones(1, 3, dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    assert ret[0].tolist() == pytest.approx([1.9, 1.9, 2.0], abs=1e-12)   # Monte Carlo G_t
    assert adv[0].tolist() == pytest.approx([1.4, 1.7, 1.0], abs=1e-12)


def test_token_rewards_put_the_score_on_the_last_response_token() -> None:
    kl = t(0.1, 0.2, 0.3, 0.4, 9.0, 9.0).reshape(2, 3)
    mask = t(1, 1, 1, 1, 0, 0).reshape(2, 3)
    r = token_rewards(t(1.0, -2.0), kl, mask, kl_coef=0.5)
    assert r.flatten().tolist() == pytest.approx([-0.05, -0.1, -0.15 + 1.0, -0.2 - 2.0, 0.0, 0.0])


def test_value_clipping_exact_values() -> None:
    old = t(0.0, 0.0, 1.0, 1.0).reshape(1, 4)
    new = t(0.5, 0.1, 0.5, 2.0).reshape(1, 4).requires_grad_(True)
    ret = t(1.0, -1.0, 0.0, 1.5).reshape(1, 4)
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, clipfrac = ppo_value_loss(new, old, ret, mask, clip=0.2)
    # token 1: V=0.5 clipped to 0.2: max((0.5-1)^2, (0.2-1)^2) = 0.64 (clipped branch larger)
    # token 2: V=0.1 within the range: (1.1)^2 = 1.21
    # token 3: V=0.5 clipped to 0.8: max(0.25, 0.64) = 0.64 (clipped)
    # token 4: V=2.0 clipped to 1.2: max(0.25, 0.09) = 0.25 (unclipped branch)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.21 + 0.64 + 0.25) / 4, abs=1e-12)
    assert clipfrac.item() == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(loss, new)
    assert grad[0, 0].item() == 0.0 and grad[0, 2].item() == 0.0      # clipped: no gradient
    assert grad[0, 1].item() == pytest.approx(0.5 * 2 * 1.1 / 4)
    assert grad[0, 3].item() == pytest.approx(0.5 * 2 * 0.5 / 4)
    # inside the range everywhere: plain 0.5 (V - R)^2
    same, frac = ppo_value_loss(old, old, ret, mask, clip=0.2)
    assert same.item() == pytest.approx(0.5 * (1 + 1 + 1 + 0.25) / 4) and frac.item() == 0.0


def test_no_eos_keep_penalty_drop_and_reward_clip() -> None:
    scores, finished = t(3.0, -0.5, 0.25), [True, False, False]
    p = PPOParams()
    out, keep = shape_scores(scores, finished, p)
    assert out.tolist() == [3.0, -0.5, 0.25] and keep.tolist() == [True, True, True]
    out, keep = shape_scores(scores, finished, dataclasses.replace(p, no_eos="penalty",
                                                                   no_eos_penalty=2.0))
    assert out.tolist() == [3.0, -2.5, -1.75] and keep.all()
    out, keep = shape_scores(scores, finished, dataclasses.replace(p, no_eos="drop"))
    assert keep.tolist() == [True, False, False]
    # clip first, then the penalty: a truncated response always ends below the clip floor
    out, _ = shape_scores(scores, finished, dataclasses.replace(p, reward_clip=1.0,
                                                                no_eos="penalty"))
    assert out.tolist() == [1.0, -1.5, -0.75]
    assert scores.tolist() == [3.0, -0.5, 0.25]                     # input not mutated


# --- a tiny LM for objective-level tests ------------------------------------------------------

VOCAB = 12


@pytest.fixture()
def lm_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2,
                                   intermediate_size=32, max_position_embeddings=32,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    policy = transformers.LlamaForCausalLM(cfg).eval()
    torch.manual_seed(1)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    return policy, ref


def fake_rollouts(policy: torch.nn.Module, n: int, seed: int, it: int = 1,
                  finished: list[bool] | None = None, shift: float = 0.0) -> list[Rollout]:
    """Random responses with the policy's own log-probs (minus `shift`: a different mu)."""
    from tasks.models import lm
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = tuple(int(x) for x in torch.randint(3, VOCAB, (3,), generator=g))
        length = 2 + i % 3
        resp = tuple(int(x) for x in torch.randint(3, VOCAB, (length,), generator=g))
        with torch.no_grad():
            lp, _ = lm.response_logprobs(policy, [prompt], [resp], 0)
        fin = finished[i] if finished else True
        out.append(Rollout(f"p{i // 2}", (Message("user", "x"),), prompt, resp,
                           tuple(float(x) - shift for x in lp[0, :length]), fin, "", "md5", it,
                           GenerationParams(temperature=1.0)))
    return out


def test_full_objective_at_ratio_one_is_the_plain_policy_gradient(lm_pair: Any) -> None:
    policy, ref = lm_pair
    p = PPOParams(clip=1e9, value_clip=1e9, whiten_advantages=False, kl_mode="reward")
    rs = fake_rollouts(policy, 6, seed=0)
    head = value_head.ValueHead(16)
    torch.nn.init.normal_(head.linear.weight)                        # a critic that is not zero
    exp, _ = make_experience(policy, head, ref, rs, t(1.0, -1.0, 0.5, 2.0, 0.0, -0.3).float(),
                             0, p, 0, it=1)
    idx = torch.arange(6)
    loss, _ = minibatch_loss(policy, head, exp, idx, p, 0, 1.0)
    params = [q for q in policy.parameters()]
    g_ppo = torch.autograd.grad(loss, params, allow_unused=True)
    from tasks.models import lm
    logp, m = lm.response_logprobs(policy, exp.prompts, exp.responses, 0)
    pg = -(exp.advantages * logp * m).sum() / m.sum()                # REINFORCE, token mean
    g_pg = torch.autograd.grad(pg, params, allow_unused=True)
    assert sum(float(g.abs().sum()) for g in g_pg if g is not None) > 0
    for a, b in zip(g_ppo, g_pg):                                    # the critic adds nothing
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    # and the clipped surrogate itself is -mean(A) at ratio 1
    pg_loss, clipfrac = ppo_clip_loss(logp.detach(), exp.old_logprobs[:, :logp.shape[1]],
                                      exp.advantages[:, :logp.shape[1]], m, p.clip)
    assert float(pg_loss) == pytest.approx(-float((exp.advantages * m).sum() / m.sum()),
                                           abs=1e-5)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_in_reward_or_in_loss(lm_pair: Any, estimator: str) -> None:
    policy, ref = lm_pair
    rs = fake_rollouts(policy, 4, seed=1)
    scores = torch.tensor([1.0, 0.0, -1.0, 0.5])
    head = value_head.ValueHead(16)
    base = PPOParams(kl_coef=0.5, kl_estimator=estimator, whiten_advantages=False, lam=1.0)
    exp_r, m_r = make_experience(policy, head, ref, rs, scores, 0, base, 0, 1)
    exp_l, m_l = make_experience(policy, head, ref, rs, scores,
                                 0, dataclasses.replace(base, kl_mode="loss"), 0, 1)
    # both estimates are logged either way, and the chosen one is the KL to the reference
    assert m_r["update/kl_to_ref_per_token"] == m_r[f"update/kl_{estimator}_per_token"]
    assert m_r["update/kl_k3_per_token"] >= 0 and m_r["update/kl_k1_per_token"] != 0
    # reward mode: the returns (V = 0, lambda = 1) carry -kl_coef * sum of the estimate
    from tasks.functional.losses import kl_k1, kl_k3
    est = {"k1": kl_k1, "k3": kl_k3}[estimator](exp_r.old_logprobs, exp_r.ref_logprobs)
    g0 = scores - 0.5 * (est * exp_r.mask).sum(-1)
    assert exp_r.returns[:, 0].tolist() == pytest.approx(g0.tolist(), abs=1e-5)
    assert exp_l.returns[:, 0].tolist() == pytest.approx(scores.tolist(), abs=1e-6)
    # loss mode: the loss is larger by kl_coef * KL(pi || ref) of the minibatch
    idx = torch.arange(4)
    loss_l, st = minibatch_loss(policy, head, exp_l, idx, dataclasses.replace(base, kl_mode="loss"),
                                0, 1.0)
    loss_0, _ = minibatch_loss(policy, head, exp_l, idx, base, 0, 1.0)
    assert float((loss_l - loss_0).detach()) == pytest.approx(0.5 * st[f"kl_{estimator}"], abs=1e-6)


def test_early_stop_on_approximate_kl(lm_pair: Any) -> None:
    policy, ref = lm_pair
    rs = fake_rollouts(policy, 8, seed=2)
    scores = torch.linspace(-1, 1, 8)
    p = PPOParams(lr=0.05, epochs=5, minibatch_size=2, target_kl=1e-4)
    m = train_ppo(policy, value_head.ValueHead(16), ref, rs, scores, p=p, pad_id=0,
                  rng=torch.Generator().manual_seed(0), it=1)
    assert m["update/early_stopped"] == 1.0
    assert 1 <= m["update/steps"] < 5 * 4                           # stopped before 20 steps
    assert m["update/epochs_run"] == math.floor(m["update/steps"] / 4) + 1
    off = train_ppo(ref, value_head.ValueHead(16), ref, fake_rollouts(ref, 8, seed=2), scores,
                    p=dataclasses.replace(p, lr=1e-4, target_kl=0.0, epochs=2), pad_id=0,
                    rng=torch.Generator().manual_seed(0), it=1)
    assert off["update/early_stopped"] == 0.0 and off["update/steps"] == 8
    assert off["update/epochs_run"] == 2


def test_no_eos_drop_removes_truncated_rollouts(lm_pair: Any) -> None:
    policy, ref = lm_pair
    rs = fake_rollouts(policy, 6, seed=3, finished=[True, False, True, True, False, True])
    p = PPOParams(no_eos="drop", epochs=1, minibatch_size=4)
    m = train_ppo(policy, value_head.ValueHead(16), ref, rs, torch.zeros(6), p=p, pad_id=0,
                  rng=torch.Generator().manual_seed(0), it=1)
    assert m["update/n_rollouts"] == 4 and m["update/steps"] == 1


def test_reused_rollouts_are_weighted_and_logged(lm_pair: Any) -> None:
    policy, ref = lm_pair
    fresh = fake_rollouts(policy, 4, seed=4, it=2)
    # mu gave each reused token log-prob 0.3 lower than pi: sequence ratio exp(0.3 * len)
    old = fake_rollouts(policy, 4, seed=5, it=1, shift=0.3)
    stale = fake_rollouts(policy, 2, seed=6, it=0)                  # 2 iterations old: dropped
    reuse = ReuseParams(iterations_back=1, truncate=(0.0, 2.0), level="sequence", max_staleness=1)
    p = PPOParams(epochs=1, minibatch_size=4, reuse=reuse)
    m = train_ppo(policy, value_head.ValueHead(16), ref, fresh, torch.zeros(4), p=p, pad_id=0,
                  rng=torch.Generator().manual_seed(0), it=2, reused=old + stale,
                  reused_scores=torch.zeros(6))
    assert m["update/n_rollouts"] == 4 and m["update/n_reused"] == 4
    raw = [math.exp(0.3 * len(r.response_ids)) for r in old]        # lengths 2, 3, 4, 2
    w = [min(x, 2.0) for x in raw]
    assert m["update/reuse_truncated_frac"] == pytest.approx(sum(x > 2.0 for x in raw) / 4)
    assert m["update/reuse_ess"] == pytest.approx(sum(w) ** 2 / sum(x * x for x in w), rel=1e-4)
    assert m["update/reuse_ess_frac"] == pytest.approx(m["update/reuse_ess"] / 4)
    assert m["update/reuse_staleness_mean"] == 1.0


# --- the update stage end to end --------------------------------------------------------------
