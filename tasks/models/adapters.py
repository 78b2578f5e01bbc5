"""LoRA adapters for the policy (PEFT): attach one, use the base underneath it as the reference,
save and load it beside the name and md5 of the base it was trained on, merge it for sampling.

A LoRA policy trains low-rank updates W + (alpha / r) B A of the linear layers that
`update.lora.target_modules` names, the base weights W frozen (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models"). B starts at zero, so a fresh adapter is the base model
exactly. The base is still there under the adapter, so the `initial` reference is the policy
with its adapter switched off (`ReferenceView`), not a second model in memory.

A policy directory of a LoRA policy holds PEFT's two files (`adapter_config.json`,
`adapter_model.safetensors`) and `alignloop_base.json`, which names the base model by its
workspace-relative path and its weights' md5 (`lm.weights_md5`): `load_policy` loads that base,
refuses it if its bytes changed, and puts the adapter on it.

With `update.lora.r > 0` the update stage trains an adapter (`start_policy`), rollout and
evaluate sample its merged weights (`load_for_inference`), and `reference: previous` is the
previous adapter loaded beside the trained one on the same base (`add_reference`): one base in
memory, whichever reference.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import peft
import torch
import transformers

from tasks.core import atomic
from tasks.models import lm
from tasks.models.lm import ModelError
from tasks.runtime.device import Device
from tasks.schemas.update import LoraParams

ADAPTER_CONFIG = "adapter_config.json"          # PEFT's: the adapter's shape and targets
ADAPTER_WEIGHTS = "adapter_model.safetensors"   # PEFT's: the adapter's A and B matrices
BASE_FILE = lm.ADAPTER_BASE                     # ours: {"base_path": ..., "base_md5": ...}
ADAPTER = "default"                             # PEFT's name of a model's one adapter
REFERENCE = "reference"                         # a second, frozen adapter: the previous policy


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """PEFT asks transformers' deprecated `is_gradient_checkpointing` (a FutureWarning on every
    wrap): not ours to act on, and no line for the stage's log."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        yield


def lora_config(lp: LoraParams) -> peft.LoraConfig:
    """PEFT's LoraConfig for `update.lora`: adapters on the named linear layers, biases frozen."""
    return peft.LoraConfig(r=lp.r, lora_alpha=lp.alpha, lora_dropout=lp.dropout,
                           target_modules=list(lp.target_modules), bias="none",
                           task_type=peft.TaskType.CAUSAL_LM)


def _check_targets(model: torch.nn.Module, lp: LoraParams) -> None:
    """Every name in target_modules must end the name of a linear layer of `model`, as PEFT
    matches them (PEFT itself fails only when none does: a misspelt one would get no adapter)."""
    linear = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    missing = [t for t in lp.target_modules
               if not any(name == t or name.endswith("." + t) for name in linear)]
    if missing:
        kinds = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise ModelError(f"update.lora.target_modules: {missing} name no linear layer of "
                         f"{type(model).__name__} (its linear layers: {kinds})")


def attach(model: transformers.PreTrainedModel, lp: LoraParams,
           rng: torch.Generator) -> peft.PeftModel:
    """`model` wrapped with a fresh LoRA adapter (`update.lora`, r > 0): only the adapter's
    parameters require grad. PEFT injects the adapter layers into `model` itself and freezes its
    weights; use the returned wrapper from then on.

    PEFT draws A (Kaiming-uniform) from torch's global generator and takes none of its own, so
    the init runs under a forked global RNG seeded from `rng`: the same `rng` state gives the
    same adapter, and the caller's global RNG state is left as it was. B is zero: the wrapped
    model computes exactly what `model` did."""
    if lp.r <= 0:
        raise ValueError(f"update.lora.r is {lp.r}: LoRA is off, there is no adapter to attach")
    _check_targets(model, lp)
    seed = int(torch.randint(0, 2**62, (1,), generator=rng))
    devices = [d for d in {q.device for q in model.parameters()} if d.type == "cuda"]
    with torch.random.fork_rng(devices=devices), _quiet():
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, lora_config(lp), adapter_name=ADAPTER)
    return wrapped


@contextlib.contextmanager
def _as_reference(policy: peft.PeftModel, adapter: str | None) -> Iterator[None]:
    """For the block, the policy computes its reference: the base (adapter None: every adapter
    off) or the frozen adapter `adapter` alone, every module in eval mode; afterwards the
    trained adapter active again and each module's mode and each parameter's requires_grad as
    they were (PEFT's enable_adapter_layers and set_adapter mark the adapter they switch on
    trainable, even one loaded frozen)."""
    modes = [(m, m.training) for m in policy.modules()]
    grads = [(q, q.requires_grad) for q in policy.parameters()]
    policy.eval()
    try:
        if adapter is None:
            with policy.disable_adapter():
                yield
        else:
            policy.set_adapter(adapter)
            try:
                yield
            finally:
                policy.set_adapter(ADAPTER)
    finally:
        for m, training in modes:
            m.training = training
        for q, requires_grad in grads:
            q.requires_grad_(requires_grad)


class ReferenceView(torch.nn.Module):
    """The base model under a LoRA policy (adapter None), or the base with the frozen adapter
    `add_reference` loaded (adapter REFERENCE: the previous policy), as a reference module: its
    forward runs the policy so, in eval mode, without grad. No second model: the policy's own
    base weights, which the adapter's training never changes.

    What `train_dpo`, `train_ppo`, `KLGuard` and `lm.packed_logprobs` touch is the policy's:
    `config` (its attention implementation), `dtype`, and `parameters()`, which yields the
    base's frozen weights only (never the adapter's, so freezing "the reference's parameters"
    cannot freeze the policy's adapter). The policy is not a submodule: `ref.eval()` or
    `ref.to(...)` leave it alone."""

    def __init__(self, policy: peft.PeftModel, adapter: str | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "policy", policy)     # not registered: a view, not an owner
        self.adapter = adapter

    @property
    def config(self) -> transformers.PretrainedConfig:
        return self.policy.config

    @property
    def dtype(self) -> torch.dtype:
        return self.policy.get_base_model().dtype

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The base model's parameters (frozen), without the adapter's."""
        tag = self.policy.base_model.prefix                              # "lora_"
        for name, q in self.policy.named_parameters(prefix, recurse, remove_duplicate):
            if tag not in name:
                yield name, q

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The policy's forward as its reference: the base's outputs, or base + REFERENCE's."""
        with torch.no_grad(), _as_reference(self.policy, self.adapter):
            return self.policy(*args, **kwargs)


def save_adapter(model: peft.PeftModel, out_dir: str | Path, base_path: str,
                 base_md5: str) -> None:
    """The adapter only (PEFT's adapter_config.json and adapter_model.safetensors) and
    alignloop_base.json naming its base, into `out_dir` (made if missing; a stage writes into
    `atomic.directory`, as for a full model). base_path: the base model's directory relative to
    the workspace, as DVC names it (e.g. models/iter_0/policy); base_md5: `lm.weights_md5` of
    that directory, which `load_policy` checks.

    The same adapter gives the same bytes: adapter_config.json names the base by base_path (PEFT
    would write the absolute path it was loaded from) and lists target_modules sorted (PEFT
    writes them from a set, in an order that changes with PYTHONHASHSEED); PEFT's README.md
    (a card naming that absolute path) is not kept: the stage writes the model card."""
    if not lm.is_workspace_relative(base_path):
        raise ValueError(f"base_path {base_path!r} must be relative to the workspace")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.peft_config[ADAPTER]
    named = config.base_model_name_or_path
    config.base_model_name_or_path = base_path
    try:
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".peft-") as tmp:
            model.save_pretrained(tmp, selected_adapters=[ADAPTER], save_embedding_layers=False)
            os.replace(Path(tmp) / ADAPTER_WEIGHTS, out_dir / ADAPTER_WEIGHTS)
            saved = json.loads((Path(tmp) / ADAPTER_CONFIG).read_text())
    finally:
        config.base_model_name_or_path = named
    saved["target_modules"] = sorted(saved["target_modules"])
    atomic.write_json(out_dir / ADAPTER_CONFIG, saved)
    lm.write_base_record(out_dir, lm.BaseRecord(base_path, base_md5))


def is_adapter_dir(path: str | Path) -> bool:
    """Whether a policy directory holds a LoRA adapter (PEFT's adapter_config.json) rather than
    a full model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_base(adapter_dir: str | Path) -> tuple[str, str]:
    """The base an adapter directory names: (workspace-relative path, weights md5); a missing
    or malformed alignloop_base.json is a ModelError naming the file and the field."""
    record = lm.read_base_record(adapter_dir)
    if record is None:
        raise ModelError(f"{Path(adapter_dir) / BASE_FILE}: missing (an adapter directory names "
                         "its base model there; save_adapter writes it)")
    return record.base_path, record.base_md5


def load_policy(adapter_dir: str | Path, root: str | Path, device: Device = "cpu", *,
                trainable: bool = False) -> peft.PeftModel:
    """Base + adapter: the base that `adapter_dir`'s alignloop_base.json names (under the
    workspace `root`, fp32, on `device`), refused in one line if its weights' md5 is not the
    recorded one, with the saved adapter on it. trainable: the adapter's parameters require grad
    (training continues from it; the base stays frozen); else all frozen, in eval mode
    (inference: `merged(..., in_place=True)` for the fast sampler)."""
    file = Path(adapter_dir) / BASE_FILE
    base_path, base_md5 = read_base(adapter_dir)
    base_dir = Path(root) / base_path
    try:
        lm.check_model_dir(base_dir)
        actual = lm.weights_md5(base_dir)
    except ModelError as e:
        raise ModelError(f"{file}: base_path: {e}") from None
    if actual != base_md5:
        raise ModelError(f"{file}: base_md5: {base_md5} recorded, but the weights in "
                         f"{base_path} have md5 {actual} (the adapter was trained on another "
                         "base)")
    base = lm.load_causal_lm(base_dir, device)
    with _quiet():
        model = peft.PeftModel.from_pretrained(base, str(adapter_dir), adapter_name=ADAPTER,
                                               is_trainable=trainable,
                                               torch_device=str(device))
    return model.to(device).eval()


def merged(model: peft.PeftModel, *, in_place: bool = False) -> transformers.PreTrainedModel:
    """A plain model (e.g. a LlamaForCausalLM the fast sampler takes) with the adapter merged
    into its weights, W + (alpha / r) B A, in eval mode. Merges into a copy, leaving `model`
    (adapter and all) as it was; in_place: merges `model` itself and unwraps it (no copy: for a
    model loaded for inference only, which is not used as a PeftModel after)."""
    target = model if in_place else copy.deepcopy(model)
    with _quiet():
        plain = target.merge_and_unload(safe_merge=True)
    return plain.eval()


def add_reference(policy: peft.PeftModel, adapter_dir: str | Path) -> ReferenceView:
    """The adapter saved in `adapter_dir` (the previous policy's, on the same base) loaded
    beside the policy's own as a frozen second adapter, and the view that computes with it
    alone: `reference: previous` without a second base in memory."""
    with _quiet():
        policy.load_adapter(str(adapter_dir), adapter_name=REFERENCE, is_trainable=False)
        policy.set_adapter(ADAPTER)
    for name, q in policy.named_parameters():
        if f".{REFERENCE}." in name:
            q.requires_grad_(False)
    return ReferenceView(policy, REFERENCE)


def load_for_inference(policy_dir: str | Path, root: str | Path,
                       device: Device = "cpu") -> transformers.PreTrainedModel:
    """A policy directory as a plain model in eval mode, whichever it holds: a full model as
    saved, an adapter merged into its base (the fast sampler reads plain weights)."""
    if not is_adapter_dir(policy_dir):
        return lm.load_causal_lm(policy_dir, device)
    return merged(load_policy(policy_dir, root, device), in_place=True)


def base_of(policy_dir: str | Path, root: str | Path) -> tuple[str, str]:
    """The base an adapter trained from `policy_dir` sits on: an adapter's own base, or the full
    model in `policy_dir` itself; (workspace-relative path, weights md5)."""
    if is_adapter_dir(policy_dir):
        return read_base(policy_dir)
    # lexically, not resolved: a workspace may link its inputs in (the name is the workspace's)
    rel = Path(os.path.abspath(policy_dir)).relative_to(os.path.abspath(root)).as_posix()
    return rel, lm.weights_md5(policy_dir)


def checkpointed(policy: peft.PeftModel) -> peft.PeftModel:
    """The policy with gradient checkpointing on its base's blocks (transformers' own, non-
    reentrant: the frozen base needs no input that requires grad): in training mode each
    block's activations are recomputed in the backward instead of kept. In eval mode (sampling,
    the reference, the KL budget's measure) nothing changes."""
    base = policy.get_base_model()
    with _quiet():
        if hasattr(base, "activation_checkpointing_enable"):    # transformers' newer name
            base.activation_checkpointing_enable({"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable({"use_reentrant": False})
    return policy


def start_policy(policy_dir: str | Path, root: str | Path, lp: LoraParams, rng: torch.Generator,
                 device: Device = "cpu") -> peft.PeftModel:
    """The policy an update trains under `update.lora`: the adapter saved in `policy_dir`,
    trainable (iteration k continues from k-1's), or a fresh adapter on the full model there.
    An adapter of another shape than `lp` asks for (r, alpha, target modules) is refused in one
    line: it cannot be continued as another. With `lp.gradient_checkpointing`, checkpointed.
    """
    if not is_adapter_dir(policy_dir):
        policy = attach(lm.load_causal_lm(policy_dir, device), lp, rng)
        return checkpointed(policy) if lp.gradient_checkpointing else policy
    config = json.loads((Path(policy_dir) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    saved = (config.get("r"), float(config.get("lora_alpha", 0)),
             sorted(config.get("target_modules") or []))
    wanted = (lp.r, float(lp.alpha), sorted(lp.target_modules))
    if saved != wanted:
        raise ModelError(f"{Path(policy_dir) / ADAPTER_CONFIG}: r, lora_alpha, target_modules "
                         f"{saved} but update.lora asks for {wanted}: an adapter continues with "
                         "its own shape (set update.lora as it was, or start a new workspace)")
    policy = load_policy(policy_dir, root, device, trainable=True)
    return checkpointed(policy) if lp.gradient_checkpointing else policy
