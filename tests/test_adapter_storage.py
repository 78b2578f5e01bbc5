"""LoRA adapters saved and loaded (tasks/models/adapters.py): the adapter directory round-trips
and names its base by path and md5, the merged model samples as the adapter does, a changed or
bad base is refused in one line."""
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
from tasks.models import adapters, fast_llama, lm, sampling
from tasks.models.lm import ModelError
from tasks.policy.dpo import train_dpo
from tasks.schemas.update import DPOParams, LoraParams
from tiny_lora import (
    ARCHS,
    BASE_PATH,
    LORA,
    SPECIAL,
    chosen_logprobs,
    perturb_adapter,
    random_pairs,
    tiny_llama,
)

# --- save, load, merge --------------------------------------------------------------------------

def _workspace(tmp_path: Path, arch: str) -> tuple[Path, transformers.PreTrainedModel,
                                                    torch.nn.Module]:
    """A workspace root holding the base at BASE_PATH, and a perturbed adapter on that base."""
    base = ARCHS[arch]()
    base.save_pretrained(tmp_path / BASE_PATH)
    base = lm.load_causal_lm(tmp_path / BASE_PATH)
    plain = copy.deepcopy(base)
    policy = adapters.attach(base, LORA, torch.Generator().manual_seed(1))
    perturb_adapter(policy)
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
    got, mask = chosen_logprobs(loaded)
    want, _ = chosen_logprobs(policy)
    assert (got - want).abs().max() <= 1e-6 and mask.sum() > 0
    assert not any(q.requires_grad for q in loaded.parameters()) and not loaded.training
    chosen_logprobs(adapters.ReferenceView(loaded))       # PEFT re-enables grads after disable_adapter
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
    got, mask = chosen_logprobs(plain_model)
    want, _ = chosen_logprobs(policy)
    assert ((got - want) * mask).abs().max() <= 1e-3                  # the merge's bar, per token
    base, _ = chosen_logprobs(plain)
    assert ((got - base) * mask).abs().max() > 1e-3                   # the adapter is in it


def test_the_fast_sampler_takes_the_merged_llama_and_its_logprobs_are_the_adapters(
        tmp_path: Path) -> None:
    root, _, policy = _workspace(tmp_path, "llama")
    out = root / "adapter"
    adapters.save_adapter(policy, out, BASE_PATH, lm.weights_md5(root / BASE_PATH))
    plain = adapters.merged(adapters.load_policy(out, root), in_place=True)
    assert fast_llama.supports(plain)
    prompts = [p.prompt_ids for p in random_pairs(4)]
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
    tiny_llama(seed=9).save_pretrained(root / BASE_PATH)                 # other bytes at that path
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
    assert torch.equal(chosen_logprobs(fresh)[0], chosen_logprobs(plain)[0])
    out = root / "models" / "iter_1" / "policy"
    adapters.save_adapter(policy, out, BASE_PATH, lm.weights_md5(root / BASE_PATH))
    resumed = adapters.start_policy(out, root, LORA, torch.Generator().manual_seed(1))
    assert (chosen_logprobs(resumed)[0] - chosen_logprobs(policy)[0]).abs().max() <= 1e-6
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
    want, mask = chosen_logprobs(policy)
    trained = adapters.start_policy(out, root, LORA, torch.Generator().manual_seed(1))
    ref = adapters.add_reference(trained, out)
    assert (chosen_logprobs(ref)[0] - want).abs().max() <= 1e-6
    frozen = {n: q.clone() for n, q in trained.named_parameters() if not q.requires_grad}
    assert all(f".{adapters.REFERENCE}." not in n for n, q in trained.named_parameters()
               if q.requires_grad)
    train_dpo(trained, ref, random_pairs(), p=DPOParams(lr=5e-2, epochs=2, batch_size=4),
              pad_id=SPECIAL["pad_token_id"], rng=torch.Generator().manual_seed(2))
    assert all(torch.equal(q, frozen[n]) for n, q in trained.named_parameters()
               if not q.requires_grad)
    assert (chosen_logprobs(ref)[0] - want).abs().max() <= 1e-6             # still pi_{k-1}
    assert ((chosen_logprobs(trained)[0] - want) * mask).abs().max() > 1e-3  # the policy moved


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
    got, mask = chosen_logprobs(model)
    assert ((got - chosen_logprobs(policy)[0]) * mask).abs().max() <= 1e-3
    full = adapters.load_for_inference(root / BASE_PATH, root)
    assert torch.equal(chosen_logprobs(full)[0], chosen_logprobs(plain)[0])


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
