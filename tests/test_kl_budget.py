"""The KL budget (tasks/policy/kl_budget.py): DPO stops at the last state within its KL target, with
those weights restored; the measurement is the evaluation's k1 estimate."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch

from tasks.models import lm, sampling
from tasks.models.tiny_model import build_tiny_model
from tasks.policy import kl_budget
from tasks.policy.dpo import train_dpo
from tasks.policy.kl_budget import KLGuard, guard_prompts
from tasks.reward.features import EncodedPair
from tasks.schemas.generation import GenerationParams
from tasks.schemas.model import TinyModelParams
from tasks.schemas.update import DPOParams, KLBudgetParams

VOCAB = 64
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_tiny_model(TinyModelParams(), VOCAB, SPECIAL, 0)


def _pairs(n: int = 16) -> list[EncodedPair]:
    g = torch.Generator().manual_seed(3)
    ids = lambda k: tuple(int(x) for x in torch.randint(3, VOCAB, (k,), generator=g))
    return [EncodedPair(ids(5), ids(6) + (2,), ids(6) + (2,)) for _ in range(n)]


@dataclass
class Scripted:
    """A guard whose measurements are given: the stop/restore logic without sampling noise."""
    values: list[float]
    budget: KLBudgetParams
    policy: torch.nn.Module
    seen: list[dict[str, torch.Tensor]] = field(default_factory=list)
    start_known: float | None = None
    start: float = 0.0
    target: float = 0.0
    measured: list[tuple[int, float]] = field(default_factory=list)

    def measure(self) -> float:
        return self.values.pop(0)

    def within(self, step: int) -> bool:
        self.seen.append({k: v.clone() for k, v in self.policy.state_dict().items()})
        return KLGuard.within(self, step)        # type: ignore[arg-type]

    begin = KLGuard.begin
    metrics = KLGuard.metrics


def test_training_stops_at_the_last_state_within_the_target_and_restores_it():
    policy, ref = _model(), _model()
    budget = KLBudgetParams(total=18.0, per_iteration=5.0, check_every=2)
    guard = Scripted([10.0, 12.0, 14.5, 15.5, 99.0], budget, policy)   # start 10: target 15
    m = train_dpo(policy, ref, _pairs(16), p=DPOParams(lr=1e-2, epochs=3, batch_size=2), pad_id=0,
                  rng=torch.Generator().manual_seed(0), guard=guard)      # type: ignore[arg-type]
    assert guard.target == 15.0
    assert m["update/steps"] == 6.0                 # checks at 2, 4 (within), 6 (past): stop
    assert m["update/kl_stopped"] == 1.0 and m["update/steps_kept"] == 4.0
    assert m["update/kl_kept"] == 14.5 and m["update/kl_last"] == 15.5
    kept = guard.seen[1]                            # the weights measured at step 4
    assert all(torch.equal(v, kept[k]) for k, v in policy.state_dict().items())
    assert not all(torch.equal(v, guard.seen[2][k]) for k, v in policy.state_dict().items())


def _trained(policy: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: weights[k] for k, q in policy.named_parameters() if q.requires_grad}


def test_backtracking_keeps_the_first_state_within_the_target_between_the_last_two_checks():
    """Past the target at step 4 (the last within it: step 2), with `backtrack: 2` the guard
    measures half way back (step 3's worth: still past), then a quarter of the way from step 2
    (within): those weights stay, lerp(step 2's, step 4's, 1/4)."""
    policy, ref = _model(), _model()
    budget = KLBudgetParams(total=18.0, per_iteration=5.0, check_every=2, backtrack=2)
    guard = Scripted([10.0, 12.0, 16.0, 15.5, 14.0, 99.0], budget, policy)   # target 15
    m = train_dpo(policy, ref, _pairs(16), p=DPOParams(lr=1e-2, epochs=3, batch_size=2), pad_id=0,
                  rng=torch.Generator().manual_seed(0), guard=guard)      # type: ignore[arg-type]
    assert [s for s, _ in guard.measured] == [0, 2, 4, 3.0, 2.5]
    assert m["update/steps"] == 4.0 and m["update/kl_stopped"] == 1.0
    assert m["update/steps_kept"] == 2.5 and m["update/kl_kept"] == 14.0
    assert m["update/kl_last"] == 14.0 and m["update/kl_backtracks"] == 2.0
    at2, at4 = (_trained(policy, guard.seen[i]) for i in (0, 1))   # begin() adds none
    now = dict(policy.named_parameters())
    moved = 0.0
    for k, w in at2.items():
        torch.testing.assert_close(now[k].detach(), torch.lerp(w, at4[k], 0.25))
        moved += float((at4[k] - w).abs().sum())
    assert moved > 0                                # the two states differ: not a vacuous match


def test_with_no_backtracked_state_within_the_target_the_last_one_within_is_restored():
    policy, ref = _model(), _model()
    budget = KLBudgetParams(total=18.0, per_iteration=5.0, check_every=2, backtrack=2)
    guard = Scripted([10.0, 12.0, 16.0, 15.5, 15.2, 99.0], budget, policy)
    m = train_dpo(policy, ref, _pairs(16), p=DPOParams(lr=1e-2, epochs=3, batch_size=2), pad_id=0,
                  rng=torch.Generator().manual_seed(0), guard=guard)      # type: ignore[arg-type]
    assert m["update/steps_kept"] == 2.0 and m["update/kl_kept"] == 12.0
    assert m["update/kl_backtracks"] == 2.0 and m["update/kl_checks"] == 5.0
    kept = guard.seen[0]                            # the weights measured at step 2
    assert all(torch.equal(v, kept[k]) for k, v in policy.state_dict().items())


def test_a_snapshot_keeps_each_state_in_its_own_tensors_without_a_second_copy():
    policy = _model()
    snap = kl_budget.Snapshot(policy)
    where = {k: v.data_ptr() for k, v in snap.state.items()}
    with torch.no_grad():
        for q in policy.parameters():
            q.add_(1.0)
    snap.take(4)
    assert snap.step == 4 and {k: v.data_ptr() for k, v in snap.state.items()} == where
    assert all(torch.equal(snap.state[k], q) for k, q in policy.named_parameters())
    with torch.no_grad():
        for q in policy.parameters():
            q.sub_(3.0)
    snap.restore()
    assert all(torch.equal(snap.state[k], q) for k, q in policy.named_parameters())


def test_a_start_past_the_total_trains_nothing():
    policy, ref = _model(), _model()
    before = copy.deepcopy(policy.state_dict())
    guard = Scripted([19.0], KLBudgetParams(total=18.0, per_iteration=5.0), policy)
    m = train_dpo(policy, ref, _pairs(8), p=DPOParams(lr=1e-2), pad_id=0,
                  rng=torch.Generator().manual_seed(0), guard=guard)      # type: ignore[arg-type]
    assert m["update/steps"] == 0.0 and m["update/kl_stopped"] == 1.0
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())


def test_within_the_budget_every_step_is_kept():
    policy, ref = _model(), _model()
    guard = Scripted([0.0, 1.0, 2.0, 3.0], KLBudgetParams(total=18.0, check_every=3), policy)
    m = train_dpo(policy, ref, _pairs(14), p=DPOParams(lr=1e-3, epochs=1, batch_size=2), pad_id=0,
                  rng=torch.Generator().manual_seed(0), guard=guard)      # type: ignore[arg-type]
    assert m["update/steps"] == 7.0 and m["update/kl_stopped"] == 0.0
    assert [s for s, _ in guard.measured] == [0, 3, 6, 7]      # and once after the last step
    assert m["update/steps_kept"] == 7.0


def _prompts() -> list[tuple[int, ...]]:
    prompts = guard_prompts([p.prompt_ids for p in _pairs(16)] * 2, 8)
    assert len(prompts) == 8 and len(set(prompts)) == 8
    return prompts


def test_the_measurement_is_zero_at_the_reference_and_grows_as_the_policy_moves():
    """Sampled at temperature 0.7 the policy's log-probs come from its forward pass (at
    temperature 1): KL(pi || ref) of a policy equal to its reference is 0 exactly, the same
    weights in the same passes on the same inputs; after training on pairs it is positive."""
    policy, ref = _model(), _model()
    gen = GenerationParams(max_new_tokens=8, temperature=0.7, top_p=1.0, batch_size=8)
    guard = KLGuard(policy, ref, _prompts(), gen, KLBudgetParams(total=1e9), 2, 0,
                    torch.Generator().manual_seed(0))
    assert guard.measure() == 0.0
    train_dpo(policy, ref, _pairs(16), p=DPOParams(lr=5e-2, epochs=4, batch_size=4), pad_id=0,
              rng=torch.Generator().manual_seed(0))
    assert guard.measure() > 0.1


def _forward_k1(policy: torch.nn.Module, ref: torch.nn.Module, prompts: list[tuple[int, ...]],
                gen: GenerationParams, seed: int) -> tuple[float, float]:
    """The k1 estimate with both sides by forward passes on the samples the guard draws with
    `seed`; and the mean response length."""
    samples = sampling.sample(policy, prompts, batch_size=gen.batch_size,
                              max_new_tokens=gen.max_new_tokens, eos_id=2, pad_id=0,
                              temperature=1.0, top_p=1.0,
                              generator=torch.Generator().manual_seed(seed))
    responses = [x.response_ids for x in samples]
    with torch.no_grad():
        pi, mask = lm.response_logprobs(policy, prompts, responses, 0)
        rf, _ = lm.response_logprobs(ref, prompts, responses, 0)
    return float(((pi - rf) * mask).sum()) / len(samples), float(mask.sum()) / len(samples)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_untempered_the_policy_side_is_the_samplers_stored_logprobs(monkeypatch, lora):
    """Sampled untempered (evaluate's default), the guard runs the reference's forward pass
    only: the policy's log-probs are the ones the sampler stored. The estimate agrees with the
    one from two forward passes within the sampler's tolerance (1e-3 per token), at the
    reference and after training, for a full policy and a LoRA one (PEFT's model, its adapter
    unmerged, as the update trains it); not bit for bit (the sampler's incremental decoding
    and a full pass sum in different orders)."""
    policy, ref = _model(), _model()
    if lora:
        import peft
        policy = peft.get_peft_model(policy, peft.LoraConfig(r=4, lora_alpha=8,
                                                             target_modules=["q_proj", "v_proj"]))
    train_dpo(policy, ref, _pairs(16), p=DPOParams(lr=5e-2, epochs=4, batch_size=4), pad_id=0,
              rng=torch.Generator().manual_seed(0))
    gen = GenerationParams(max_new_tokens=8, temperature=1.0, top_p=1.0, batch_size=8)
    prompts = _prompts()
    called: list[torch.nn.Module] = []
    real = lm.response_logprobs

    def spy(model, *a, **k):
        called.append(model)
        return real(model, *a, **k)

    monkeypatch.setattr(kl_budget.lm, "response_logprobs", spy)
    for pol in (ref, policy):
        called.clear()
        got = KLGuard(pol, ref, prompts, gen, KLBudgetParams(total=1e9), 2, 0,
                      torch.Generator().manual_seed(5)).measure()
        assert called and all(m is ref for m in called)
        want, tokens = _forward_k1(pol, ref, prompts, gen, 5)
        assert tokens > 1
        assert abs(got - want) <= 1e-3 * tokens
    assert want > 0.1                          # the trained policy moved: not a vacuous match


def test_a_known_start_is_not_measured():
    """From the initial model itself the start is 0: begin() takes it without sampling."""
    g = KLGuard(None, None, [], GenerationParams(), KLBudgetParams(18.0, 5.0), 2, 0,
                torch.Generator(), start_known=0.0)                   # type: ignore[arg-type]

    def never() -> float:
        raise AssertionError("measured a known start")

    g.measure = never                                                  # type: ignore[method-assign]
    g.begin()
    assert (g.start, g.target, g.measured) == (0.0, 5.0, [(0, 0.0)])
    g.measure = lambda: 4.0                                            # type: ignore[method-assign]
    assert g.within(4)
    m = g.metrics(stopped_at=None)
    assert (m["update/kl_checks"], m["update/kl_start"], m["update/kl_kept"]) == (1.0, 0.0, 4.0)


@pytest.mark.parametrize("start, per_iteration, total, target", [
    (10.0, 5.0, 18.0, 15.0), (16.0, 5.0, 18.0, 18.0), (3.0, 0.0, 18.0, 18.0)])
def test_the_target_is_the_start_plus_the_step_capped_by_the_total(start, per_iteration, total,
                                                                   target):
    g = KLGuard(None, None, [], GenerationParams(), KLBudgetParams(total, per_iteration), 2, 0,
                torch.Generator())                                     # type: ignore[arg-type]
    g.measure = lambda: start                                          # type: ignore[method-assign]
    g.begin()
    assert g.target == target
