"""LoRA adapters (tasks/models/adapters.py) on a tiny random Llama and a tiny random Qwen2: only
the adapter trains and the reference is the base under it (saving, loading and merging:
tests/test_adapter_storage.py)."""
from __future__ import annotations

import pytest
import torch

from tasks.data.records import Message, Rollout
from tasks.models import adapters, lm
from tasks.models.lm import ModelError
from tasks.policy import value_head
from tasks.policy.dpo import train_dpo
from tasks.policy.ppo import train_ppo
from tasks.runtime.device import device_of
from tasks.schemas.generation import GenerationParams
from tasks.schemas.update import DPOParams, LoraParams, PPOParams
from tiny_lora import (
    ARCHS,
    LORA,
    SPECIAL,
    base_weights,
    chosen_logprobs,
    perturb_adapter,
    random_ids,
    random_pairs,
    tiny_llama,
    with_adapter,
)

# --- attach -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_after_attach_only_the_adapter_requires_grad_and_the_model_is_unchanged(arch: str) -> None:
    base, policy = with_adapter(arch)
    trainable = [n for n, q in policy.named_parameters() if q.requires_grad]
    n_layers = base.config.num_hidden_layers
    assert len(trainable) == 2 * 7 * n_layers                 # A and B on 7 projections a layer
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # B starts at zero (PEFT's init): adding it changes nothing the kernels compute
    got, mask = chosen_logprobs(policy)
    want, _ = chosen_logprobs(base)
    assert (got - want).abs().max() <= 1e-6 and mask.sum() > 0


def test_attach_is_deterministic_given_the_generator_and_leaves_the_global_rng_alone() -> None:
    model = tiny_llama()                       # build_tiny_model seeds the global RNG itself
    state = torch.get_rng_state()
    a = adapters.attach(model, LORA, torch.Generator().manual_seed(1))
    assert torch.equal(torch.get_rng_state(), state)
    b = adapters.attach(tiny_llama(), LORA, torch.Generator().manual_seed(1))
    c = adapters.attach(tiny_llama(), LORA, torch.Generator().manual_seed(2))
    lora_a = lambda m: {n: q for n, q in m.named_parameters() if "lora_A" in n}
    assert all(torch.equal(q, lora_a(b)[n]) for n, q in lora_a(a).items())
    assert not all(torch.equal(q, lora_a(c)[n]) for n, q in lora_a(a).items())


def test_attach_refuses_a_target_the_model_does_not_have() -> None:
    with pytest.raises(ModelError) as e:
        adapters.attach(tiny_llama(), LoraParams(r=4, target_modules=("q_proj", "c_attn")),
                        torch.Generator().manual_seed(1))
    assert str(e.value).startswith("update.lora.target_modules: ['c_attn'] name no linear layer "
                                   "of LlamaForCausalLM (its linear layers: ")
    dotted = adapters.attach(tiny_llama(), LoraParams(r=4, target_modules=("self_attn.q_proj",)),
                             torch.Generator().manual_seed(1))     # a name's tail, as PEFT matches
    assert len([q for q in dotted.parameters() if q.requires_grad]) == 2 * 2
    with pytest.raises(ValueError, match="LoRA is off"):
        adapters.attach(tiny_llama(), LoraParams(), torch.Generator().manual_seed(1))


# --- training against the base under the adapter ----------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_dpo_against_the_reference_view_trains_the_adapter_and_no_base_weight(arch: str) -> None:
    base, policy = with_adapter(arch)
    before = {n: q.detach().clone() for n, q in base.named_parameters()}
    adapter_before = {n: q.detach().clone() for n, q in policy.named_parameters()
                      if q.requires_grad}
    curve: list[dict[str, float]] = []
    m = train_dpo(policy, adapters.ReferenceView(policy), random_pairs(8),
                  p=DPOParams(lr=1e-2, batch_size=4, epochs=2, sft_weight=0.5), pad_id=0,
                  rng=torch.Generator().manual_seed(0), curve=curve)
    assert m["update/steps"] == 4.0
    # before the first step the policy is its base: log pi/pi_ref is 0 (not bits: two forwards)
    assert abs(curve[0]["logratio"]) < 1e-6
    after = base_weights(policy)
    assert set(after) == set(before)
    assert all(torch.equal(after[n], q) for n, q in before.items())   # frozen: exactly unchanged
    moved = [n for n, q in policy.named_parameters() if q.requires_grad
             and not torch.equal(q, adapter_before[n])]
    assert any(".lora_A." in n for n in moved) and any(".lora_B." in n for n in moved)
    assert all(q.requires_grad == ("lora_" in n) for n, q in policy.named_parameters())


def _rollouts(policy: torch.nn.Module, n: int = 8) -> list[Rollout]:
    """Random responses with the policy's own log-probs as the sampler's."""
    g = torch.Generator().manual_seed(4)
    prompts = [random_ids(g, 3) for _ in range(n)]
    responses = [random_ids(g, 2 + i % 3) for i in range(n)]
    with torch.no_grad():
        lp, _ = lm.response_logprobs(policy, prompts, responses, 0)
    return [Rollout(f"p{i // 2}", (Message("user", "x"),), x, y, tuple(lp[i, : len(y)].tolist()),
                    True, "", "md5", 1, GenerationParams(temperature=1.0))
            for i, (x, y) in enumerate(zip(prompts, responses))]


def test_ppo_against_the_reference_view_trains_the_adapter_and_no_base_weight() -> None:
    base, policy = with_adapter("llama")
    before = {n: q.detach().clone() for n, q in base.named_parameters()}
    adapter_before = {n: q.detach().clone() for n, q in policy.named_parameters()
                      if q.requires_grad}
    head = value_head.ValueHead(policy.config.hidden_size)     # run_ppo reads it so
    m = train_ppo(policy, head, adapters.ReferenceView(policy), _rollouts(policy),
                  torch.linspace(-1, 1, 8), p=PPOParams(lr=1e-2, epochs=1, minibatch_size=4),
                  pad_id=0, rng=torch.Generator().manual_seed(0), it=1)
    assert m["update/steps"] == 2.0
    after = base_weights(policy)
    assert all(torch.equal(after[n], q) for n, q in before.items())
    assert any(not torch.equal(q, adapter_before[n]) for n, q in policy.named_parameters()
               if "lora_B" in n)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_reference_view_computes_the_base_model(arch: str) -> None:
    base, policy = with_adapter(arch)
    perturb_adapter(policy)
    view = adapters.ReferenceView(policy)
    ref, mask = chosen_logprobs(view)
    want, _ = chosen_logprobs(base)
    # the same weights through the adapter layers' disabled path (base_layer alone): equal
    # here, but PEFT does not promise that path runs the very kernels of the plain module
    assert (ref - want).abs().max() <= 1e-6
    adapted, _ = chosen_logprobs(policy)
    assert ((adapted - want) * mask).abs().max() > 1e-3       # the adapter is back on after it
    # what the training loops touch: config, dtype, the device of its first parameter
    assert view.config is policy.config and view.dtype == torch.float32
    assert device_of(view) == device_of(policy)
    names = [n for n, _ in view.named_parameters()]
    assert names and not any("lora_" in n for n in names)
    assert not any(q.requires_grad for q in view.parameters())


def test_the_reference_view_leaves_the_policys_modes_and_grads_as_they_were() -> None:
    _, policy = with_adapter("llama")
    view = adapters.ReferenceView(policy)
    policy.train()
    view.eval()                                               # as train_dpo does: the view only
    assert policy.training
    chosen_logprobs(view)
    assert all(m.training for m in policy.modules())
    assert all(q.requires_grad == ("lora_" in n) for n, q in policy.named_parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_checkpointing_gives_the_adapter_the_same_gradients(arch: str) -> None:
    """Checkpointing recomputes the base's activations in the backward: the adapter's
    gradients are those of the plain backward (to float tolerance: the same ops recomputed)."""
    grads = []
    for ckpt in (False, True):
        _, policy = with_adapter(arch)
        perturb_adapter(policy)
        if ckpt:
            adapters.checkpointed(policy)
        policy.train()
        pairs = random_pairs(4)
        lp, mask = lm.response_logprobs(policy, [p.prompt_ids for p in pairs],
                                        [p.chosen_ids for p in pairs], SPECIAL["pad_token_id"])
        (lp * mask).sum().backward()
        grads.append({n: q.grad.clone() for n, q in policy.named_parameters() if q.requires_grad})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])
