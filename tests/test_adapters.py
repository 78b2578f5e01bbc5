"""LoRA adapters (tasks/models/adapters.py) on a tiny random Llama and a tiny random Qwen2: only
the adapter trains, the reference is the base under it, the adapter directory round-trips and
names its base by path and md5, the merged model samples as the adapter does."""
from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import peft
import pytest
import torch
import transformers

from tasks.core.errors import InputError
from tasks.data.records import Message, Rollout
from tasks.models import adapters, fast_llama, lm, sampling
from tasks.models.lm import ModelError
from tasks.models.tiny_model import build_tiny_model
from tasks.policy import value_head
from tasks.policy.dpo import train_dpo
from tasks.policy.ppo import train_ppo
from tasks.reward.features import EncodedPair
from tasks.runtime.device import device_of
from tasks.schemas.generation import GenerationParams
from tasks.schemas.model import TinyModelParams
from tasks.schemas.update import DPOParams, LoraParams, PPOParams

VOCAB = 64
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
LORA = LoraParams(r=4, alpha=8.0)
BASE_PATH = "models/iter_0/policy"      # the base's workspace-relative path, as DVC names it


def _llama(seed: int = 0) -> transformers.PreTrainedModel:
    return build_tiny_model(TinyModelParams(), VOCAB, SPECIAL, seed)


def _qwen2(seed: int = 0) -> transformers.PreTrainedModel:
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
        tie_word_embeddings=True, **SPECIAL)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


ARCHS: dict[str, Callable[..., transformers.PreTrainedModel]] = {"llama": _llama, "qwen2": _qwen2}


def _ids(g: torch.Generator, k: int) -> tuple[int, ...]:
    return tuple(int(x) for x in torch.randint(3, VOCAB, (k,), generator=g))


def _pairs(n: int = 8) -> list[EncodedPair]:
    g = torch.Generator().manual_seed(3)
    return [EncodedPair(_ids(g, 5), _ids(g, 6) + (2,), _ids(g, 4) + (2,)) for _ in range(n)]


def _logprobs(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (N, R) and mask of the pairs' chosen responses."""
    pairs = _pairs(4)
    with torch.no_grad():
        return lm.response_logprobs(model, [p.prompt_ids for p in pairs],
                                    [p.chosen_ids for p in pairs], SPECIAL["pad_token_id"])


def _attached(arch: str) -> tuple[transformers.PreTrainedModel, torch.nn.Module]:
    """(an untouched copy of the base, the base with a fresh adapter)."""
    base = ARCHS[arch]()
    return copy.deepcopy(base), adapters.attach(base, LORA, torch.Generator().manual_seed(1))


def _perturb(policy: torch.nn.Module, scale: float = 0.05) -> None:
    """B away from its zero init, so the adapter changes what the model computes."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, q in policy.named_parameters():
            if "lora_B" in name:
                q.copy_(torch.randn(q.shape, generator=g) * scale)


def _base_weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's weights under the adapter, by the base model's own names."""
    return {n.replace(".base_layer", ""): q for n, q in policy.get_base_model().named_parameters()
            if "lora_" not in n}


# --- attach -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_after_attach_only_the_adapter_requires_grad_and_the_model_is_unchanged(arch: str) -> None:
    base, policy = _attached(arch)
    trainable = [n for n, q in policy.named_parameters() if q.requires_grad]
    n_layers = base.config.num_hidden_layers
    assert len(trainable) == 2 * 7 * n_layers                 # A and B on 7 projections a layer
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # B starts at zero (PEFT's init): adding it changes nothing the kernels compute
    got, mask = _logprobs(policy)
    want, _ = _logprobs(base)
    assert (got - want).abs().max() <= 1e-6 and mask.sum() > 0


def test_attach_is_deterministic_given_the_generator_and_leaves_the_global_rng_alone() -> None:
    model = _llama()                       # build_tiny_model seeds the global RNG itself
    state = torch.get_rng_state()
    a = adapters.attach(model, LORA, torch.Generator().manual_seed(1))
    assert torch.equal(torch.get_rng_state(), state)
    b = adapters.attach(_llama(), LORA, torch.Generator().manual_seed(1))
    c = adapters.attach(_llama(), LORA, torch.Generator().manual_seed(2))
    lora_a = lambda m: {n: q for n, q in m.named_parameters() if "lora_A" in n}
    assert all(torch.equal(q, lora_a(b)[n]) for n, q in lora_a(a).items())
    assert not all(torch.equal(q, lora_a(c)[n]) for n, q in lora_a(a).items())


def test_attach_refuses_a_target_the_model_does_not_have() -> None:
    with pytest.raises(ModelError) as e:
        adapters.attach(_llama(), LoraParams(r=4, target_modules=("q_proj", "c_attn")),
                        torch.Generator().manual_seed(1))
    assert str(e.value).startswith("update.lora.target_modules: ['c_attn'] name no linear layer "
                                   "of LlamaForCausalLM (its linear layers: ")
    dotted = adapters.attach(_llama(), LoraParams(r=4, target_modules=("self_attn.q_proj",)),
                             torch.Generator().manual_seed(1))     # a name's tail, as PEFT matches
    assert len([q for q in dotted.parameters() if q.requires_grad]) == 2 * 2
    with pytest.raises(ValueError, match="LoRA is off"):
        adapters.attach(_llama(), LoraParams(), torch.Generator().manual_seed(1))


# --- training against the base under the adapter ----------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_dpo_against_the_reference_view_trains_the_adapter_and_no_base_weight(arch: str) -> None:
    base, policy = _attached(arch)
    before = {n: q.detach().clone() for n, q in base.named_parameters()}
    adapter_before = {n: q.detach().clone() for n, q in policy.named_parameters()
                      if q.requires_grad}
    curve: list[dict[str, float]] = []
    m = train_dpo(policy, adapters.ReferenceView(policy), _pairs(8),
                  p=DPOParams(lr=1e-2, batch_size=4, epochs=2, sft_weight=0.5), pad_id=0,
                  rng=torch.Generator().manual_seed(0), curve=curve)
    assert m["update/steps"] == 4.0
    # before the first step the policy is its base: log pi/pi_ref is 0 (not bits: two forwards)
    assert abs(curve[0]["logratio"]) < 1e-6
    after = _base_weights(policy)
    assert set(after) == set(before)
    assert all(torch.equal(after[n], q) for n, q in before.items())   # frozen: exactly unchanged
    moved = [n for n, q in policy.named_parameters() if q.requires_grad
             and not torch.equal(q, adapter_before[n])]
    assert any(".lora_A." in n for n in moved) and any(".lora_B." in n for n in moved)
    assert all(q.requires_grad == ("lora_" in n) for n, q in policy.named_parameters())


def _rollouts(policy: torch.nn.Module, n: int = 8) -> list[Rollout]:
    """Random responses with the policy's own log-probs as the sampler's."""
    g = torch.Generator().manual_seed(4)
    prompts = [_ids(g, 3) for _ in range(n)]
    responses = [_ids(g, 2 + i % 3) for i in range(n)]
    with torch.no_grad():
        lp, _ = lm.response_logprobs(policy, prompts, responses, 0)
    return [Rollout(f"p{i // 2}", (Message("user", "x"),), x, y, tuple(lp[i, : len(y)].tolist()),
                    True, "", "md5", 1, GenerationParams(temperature=1.0))
            for i, (x, y) in enumerate(zip(prompts, responses))]


def test_ppo_against_the_reference_view_trains_the_adapter_and_no_base_weight() -> None:
    base, policy = _attached("llama")
    before = {n: q.detach().clone() for n, q in base.named_parameters()}
    adapter_before = {n: q.detach().clone() for n, q in policy.named_parameters()
                      if q.requires_grad}
    head = value_head.ValueHead(policy.config.hidden_size)     # run_ppo reads it so
    m = train_ppo(policy, head, adapters.ReferenceView(policy), _rollouts(policy),
                  torch.linspace(-1, 1, 8), p=PPOParams(lr=1e-2, epochs=1, minibatch_size=4),
                  pad_id=0, rng=torch.Generator().manual_seed(0), it=1)
    assert m["update/steps"] == 2.0
    after = _base_weights(policy)
    assert all(torch.equal(after[n], q) for n, q in before.items())
    assert any(not torch.equal(q, adapter_before[n]) for n, q in policy.named_parameters()
               if "lora_B" in n)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_reference_view_computes_the_base_model(arch: str) -> None:
    base, policy = _attached(arch)
    _perturb(policy)
    view = adapters.ReferenceView(policy)
    ref, mask = _logprobs(view)
    want, _ = _logprobs(base)
    # the same weights through the adapter layers' disabled path (base_layer alone): equal
    # here, but PEFT does not promise that path runs the very kernels of the plain module
    assert (ref - want).abs().max() <= 1e-6
    adapted, _ = _logprobs(policy)
    assert ((adapted - want) * mask).abs().max() > 1e-3       # the adapter is back on after it
    # what the training loops touch: config, dtype, the device of its first parameter
    assert view.config is policy.config and view.dtype == torch.float32
    assert device_of(view) == device_of(policy)
    names = [n for n, _ in view.named_parameters()]
    assert names and not any("lora_" in n for n in names)
    assert not any(q.requires_grad for q in view.parameters())


def test_the_reference_view_leaves_the_policys_modes_and_grads_as_they_were() -> None:
    _, policy = _attached("llama")
    view = adapters.ReferenceView(policy)
    policy.train()
    view.eval()                                               # as train_dpo does: the view only
    assert policy.training
    _logprobs(view)
    assert all(m.training for m in policy.modules())
    assert all(q.requires_grad == ("lora_" in n) for n, q in policy.named_parameters())


# --- save, load, merge --------------------------------------------------------------------------

def _workspace(tmp_path: Path, arch: str) -> tuple[Path, transformers.PreTrainedModel,
                                                    torch.nn.Module]:
    """A workspace root holding the base at BASE_PATH, and a perturbed adapter on that base."""
    base = ARCHS[arch]()
    base.save_pretrained(tmp_path / BASE_PATH)
    base = lm.load_causal_lm(tmp_path / BASE_PATH)
    plain = copy.deepcopy(base)
    policy = adapters.attach(base, LORA, torch.Generator().manual_seed(1))
    _perturb(policy)
    return tmp_path, plain, policy


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_load_round_trip(tmp_path: Path, arch: str) -> None:
    root, _, policy = _workspace(tmp_path, arch)
    out = root / "models" / "iter_1" / "policy"
    adapters.save_adapter(policy, out, BASE_PATH, lm.weights_md5(root / BASE_PATH))
    assert sorted(p.name for p in out.iterdir()) == sorted([
        adapters.ADAPTER_CONFIG, adapters.BASE_FILE, adapters.ADAPTER_WEIGHTS])  # no full weights
    assert adapters.is_adapter_dir(out) and not adapters.is_adapter_dir(root / BASE_PATH)
    config = json.loads((out / adapters.ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == BASE_PATH            # not where it was loaded
    assert config["target_modules"] == sorted(LORA.target_modules)    # not a set's hash order
    assert adapters.read_base(out) == (BASE_PATH, lm.weights_md5(root / BASE_PATH))
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    adapters.save_adapter(policy, out, BASE_PATH, lm.weights_md5(root / BASE_PATH))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first   # a rerun: the same bytes

    loaded = adapters.load_policy(out, root)
    got, mask = _logprobs(loaded)
    want, _ = _logprobs(policy)
    assert (got - want).abs().max() <= 1e-6 and mask.sum() > 0
    assert not any(q.requires_grad for q in loaded.parameters()) and not loaded.training
    _logprobs(adapters.ReferenceView(loaded))       # PEFT re-enables grads after disable_adapter
    assert not any(q.requires_grad for q in loaded.parameters())

    resumed = adapters.load_policy(out, root, trainable=True)       # the next iteration's start
    assert all(q.requires_grad == ("lora_" in n) for n, q in resumed.named_parameters())


def test_adapter_size_against_the_base(tmp_path: Path, record_property: Callable) -> None:
    """Information only: at hidden 64 and a 64-token vocabulary the adapter is no small share
    of the model (an adapter under 5% of its base holds at SmolLM2-135M's size, not at this
    one's)."""
    root, _, policy = _workspace(tmp_path, "llama")
    out = root / "adapter"
    adapters.save_adapter(policy, out, BASE_PATH, lm.weights_md5(root / BASE_PATH))
    ratio = (out / adapters.ADAPTER_WEIGHTS).stat().st_size / \
        (root / BASE_PATH / "model.safetensors").stat().st_size
    record_property("adapter_to_base_bytes", ratio)
    print(f"adapter / base model.safetensors bytes: {ratio:.3f}")
    assert ratio > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_merged_matches_the_adapter_and_leaves_it_untouched(tmp_path: Path, arch: str) -> None:
    _, plain, policy = _workspace(tmp_path, arch)
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    plain_model = adapters.merged(policy)
    assert type(plain_model) is type(plain) and not plain_model.training
    assert {k: v for k, v in policy.state_dict().items()}.keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in policy.state_dict().items())
    got, mask = _logprobs(plain_model)
    want, _ = _logprobs(policy)
    assert ((got - want) * mask).abs().max() <= 1e-3                  # the merge's bar, per token
    base, _ = _logprobs(plain)
    assert ((got - base) * mask).abs().max() > 1e-3                   # the adapter is in it


def test_the_fast_sampler_takes_the_merged_llama_and_its_logprobs_are_the_adapters(
        tmp_path: Path) -> None:
    root, _, policy = _workspace(tmp_path, "llama")
    out = root / "adapter"
    adapters.save_adapter(policy, out, BASE_PATH, lm.weights_md5(root / BASE_PATH))
    plain = adapters.merged(adapters.load_policy(out, root), in_place=True)
    assert fast_llama.supports(plain)
    prompts = [p.prompt_ids for p in _pairs(4)]
    samples = sampling.sample(plain, prompts, batch_size=4, max_new_tokens=8, eos_id=2, pad_id=0,
                              temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(0))
    responses = [s.response_ids for s in samples]
    with torch.no_grad():
        full, mask = lm.response_logprobs(policy, prompts, responses, 0)   # the PEFT model
    stored = torch.zeros_like(full)
    for i, s in enumerate(samples):
        stored[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
    assert mask.sum() > 0 and ((stored - full) * mask).abs().max() <= 1e-3


# --- the base named by path and md5 ---------------------------------------------------------------

def test_load_refuses_an_adapter_whose_base_changed(tmp_path: Path) -> None:
    root, _, policy = _workspace(tmp_path, "llama")
    out = root / "adapter"
    md5 = lm.weights_md5(root / BASE_PATH)
    adapters.save_adapter(policy, out, BASE_PATH, md5)
    _llama(seed=9).save_pretrained(root / BASE_PATH)                 # other bytes at that path
    with pytest.raises(ModelError) as e:
        adapters.load_policy(out, root)
    msg = str(e.value)
    assert isinstance(e.value, InputError) and "\n" not in msg        # a stage prints one line
    assert msg == (f"{out / adapters.BASE_FILE}: base_md5: {md5} recorded, but the weights in "
                   f"{BASE_PATH} have md5 {lm.weights_md5(root / BASE_PATH)} (the adapter was "
                   "trained on another base)")


@pytest.mark.parametrize("content, expected", [
    (None, "missing (an adapter directory names its base model there; save_adapter writes it)"),
    ("{", "not a JSON object (Expecting property name enclosed in double quotes: line 1 "
          "column 2 (char 1))"),
    ('{"base_path": "models/iter_0/policy"}', "base_md5: expected a non-empty string, got None"),
    ('{"base_path": "/abs/policy", "base_md5": "x"}',
     "base_path: '/abs/policy' is not relative to the workspace"),
    ('{"base_path": "../other/policy", "base_md5": "x"}',
     "base_path: '../other/policy' is not relative to the workspace"),
    ('{"base_path": "models/iter_9/policy", "base_md5": "x"}',
     "base_path: {root}/models/iter_9/policy: model directory does not exist"),
], ids=["missing", "not-json", "no-md5", "absolute", "outside", "no-base"])
def test_load_refuses_a_bad_base_file_in_one_line(tmp_path: Path, content: str | None,
                                                  expected: str) -> None:
    root, _, policy = _workspace(tmp_path, "llama")
    out = root / "adapter"
    adapters.save_adapter(policy, out, BASE_PATH, lm.weights_md5(root / BASE_PATH))
    file = out / adapters.BASE_FILE
    if content is None:
        file.unlink()
    else:
        file.write_text(content)
    with pytest.raises(ModelError) as e:
        adapters.load_policy(out, root)
    assert str(e.value) == f"{file}: " + expected.format(root=root)


def test_an_update_continues_from_the_saved_adapter_and_refuses_another_shape(
        tmp_path: Path) -> None:
    """start_policy: a full model gets a fresh adapter (B = 0: the model unchanged); a saved
    adapter comes back trainable with its weights (iteration k continues from k-1's); an
    adapter of another rank is refused in one line naming the file and the fields."""
    root, plain, policy = _workspace(tmp_path, "llama")
    fresh = adapters.start_policy(root / BASE_PATH, root, LORA, torch.Generator().manual_seed(1))
    assert torch.equal(_logprobs(fresh)[0], _logprobs(plain)[0])
    out = root / "models" / "iter_1" / "policy"
    adapters.save_adapter(policy, out, BASE_PATH, lm.weights_md5(root / BASE_PATH))
    resumed = adapters.start_policy(out, root, LORA, torch.Generator().manual_seed(1))
    assert (_logprobs(resumed)[0] - _logprobs(policy)[0]).abs().max() <= 1e-6
    assert {n for n, q in resumed.named_parameters() if q.requires_grad} == \
        {n for n, q in policy.named_parameters() if q.requires_grad}
    assert adapters.base_of(out, root) == adapters.base_of(root / BASE_PATH, root) == \
        (BASE_PATH, lm.weights_md5(root / BASE_PATH))
    with pytest.raises(ModelError) as e:
        adapters.start_policy(out, root, LoraParams(r=8, alpha=8.0),
                              torch.Generator().manual_seed(1))
    assert str(e.value).startswith(f"{out / adapters.ADAPTER_CONFIG}: r, lora_alpha, "
                                   "target_modules (4, 8.0,") and "\n" not in str(e.value)


def test_the_previous_adapter_as_reference_computes_the_previous_policy(tmp_path: Path) -> None:
    """reference: previous under LoRA: k-1's adapter loaded frozen beside the trained one on the
    same base; the view computes pi_{k-1} while the policy trains away from it, and no frozen
    reference weight moves."""
    root, _, policy = _workspace(tmp_path, "llama")
    out = root / "models" / "iter_1" / "policy"
    adapters.save_adapter(policy, out, BASE_PATH, lm.weights_md5(root / BASE_PATH))
    want, mask = _logprobs(policy)
    trained = adapters.start_policy(out, root, LORA, torch.Generator().manual_seed(1))
    ref = adapters.add_reference(trained, out)
    assert (_logprobs(ref)[0] - want).abs().max() <= 1e-6
    frozen = {n: q.clone() for n, q in trained.named_parameters() if not q.requires_grad}
    assert all(f".{adapters.REFERENCE}." not in n for n, q in trained.named_parameters()
               if q.requires_grad)
    train_dpo(trained, ref, _pairs(), p=DPOParams(lr=5e-2, epochs=2, batch_size=4),
              pad_id=SPECIAL["pad_token_id"], rng=torch.Generator().manual_seed(2))
    assert all(torch.equal(q, frozen[n]) for n, q in trained.named_parameters()
               if not q.requires_grad)
    assert (_logprobs(ref)[0] - want).abs().max() <= 1e-6             # still pi_{k-1}
    assert ((_logprobs(trained)[0] - want) * mask).abs().max() > 1e-3  # the policy moved


def test_an_adapters_identity_names_its_base_and_it_loads_merged_for_inference(
        tmp_path: Path) -> None:
    """weights_md5 of an adapter directory covers the base it names (the same adapter on
    another base is another policy version); load_for_inference gives the merged model, or a
    full model as saved."""
    root, plain, policy = _workspace(tmp_path, "llama")
    out = root / "models" / "iter_1" / "policy"
    adapters.save_adapter(policy, out, BASE_PATH, lm.weights_md5(root / BASE_PATH))
    first = lm.weights_md5(out)
    (out / adapters.BASE_FILE).write_text(json.dumps({"base_path": BASE_PATH,
                                                      "base_md5": "0" * 32}))
    assert lm.weights_md5(out) != first
    adapters.save_adapter(policy, out, BASE_PATH, lm.weights_md5(root / BASE_PATH))
    assert lm.weights_md5(out) == first
    model = adapters.load_for_inference(out, root)
    assert not isinstance(model, peft.PeftModel) and fast_llama.supports(model)
    got, mask = _logprobs(model)
    assert ((got - _logprobs(policy)[0]) * mask).abs().max() <= 1e-3
    full = adapters.load_for_inference(root / BASE_PATH, root)
    assert torch.equal(_logprobs(full)[0], _logprobs(plain)[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_checkpointing_gives_the_adapter_the_same_gradients(arch: str) -> None:
    """Checkpointing recomputes the base's activations in the backward: the adapter's
    gradients are those of the plain backward (to float tolerance: the same ops recomputed)."""
    grads = []
    for ckpt in (False, True):
        _, policy = _attached(arch)
        _perturb(policy)
        if ckpt:
            adapters.checkpointed(policy)
        policy.train()
        pairs = _pairs(4)
        lp, mask = lm.response_logprobs(policy, [p.prompt_ids for p in pairs],
                                        [p.chosen_ids for p in pairs], SPECIAL["pad_token_id"])
        (lp * mask).sum().backward()
        grads.append({n: q.grad.clone() for n, q in policy.named_parameters() if q.requires_grad})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])


@pytest.mark.parametrize("content, layers, expected", [
    ('{"base_path": "models/iter_0/policy", "base_md5": "x"}', False,
     lm.BaseRecord("models/iter_0/policy", "x")),
    ('{"base_md5": "x", "base_path": "models/iter_0/policy", "num_layers": 12}', True,
     lm.BaseRecord("models/iter_0/policy", "x", 12)),
    ('{"base_path": "models/iter_0/policy", "base_md5": "x"}', True,
     "num_layers: expected a positive integer, got None"),
    ('{"base_path": "models/iter_0/policy", "base_md5": "x", "num_layers": true}', False,
     "num_layers: expected a positive integer, got True"),
    ('["models/iter_0/policy"]', False, "not a JSON object"),
    ('{"base_path": "a\\\\b", "base_md5": "x"}', False,
     "base_path: 'a\\\\b' is not relative to the workspace"),
], ids=["adapter", "head-only-rm", "rm-without-layers", "bool-layers", "list", "backslash"])
def test_one_reader_of_the_base_record_for_adapters_and_head_only_rms(
        tmp_path: Path, content: str, layers: bool, expected: object) -> None:
    """An adapter's record (path, md5) and a head-only RM's (path, md5, num_layers) are one
    file format with one reader; what a reader requires it names in one line."""
    (tmp_path / lm.ADAPTER_BASE).write_text(content)
    if isinstance(expected, lm.BaseRecord):
        assert lm.read_base_record(tmp_path, layers=layers) == expected
        lm.write_base_record(tmp_path / "again", expected)          # and back, the same record
        assert lm.read_base_record(tmp_path / "again", layers=layers) == expected
        return
    with pytest.raises(ModelError) as e:
        lm.read_base_record(tmp_path, layers=layers)
    assert str(e.value) == f"{tmp_path / lm.ADAPTER_BASE}: {expected}"


def test_no_base_record_means_the_weights_are_stored_whole(tmp_path: Path) -> None:
    assert lm.read_base_record(tmp_path) is None
    with pytest.raises(ValueError, match="must be relative to the workspace"):
        lm.write_base_record(tmp_path, lm.BaseRecord("/abs/model", "x"))
    assert not (tmp_path / lm.ADAPTER_BASE).exists()
