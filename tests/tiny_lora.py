"""Tiny random Llama and Qwen2 models with LoRA adapters, and the random pairs the adapter tests
train on (tests/test_adapters.py, tests/test_adapter_storage.py)."""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import transformers

from tasks.models import adapters, lm
from tasks.models.tiny_model import build_tiny_model
from tasks.reward.features import EncodedPair
from tasks.schemas.model import TinyModelParams
from tasks.schemas.update import LoraParams

VOCAB = 64
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
LORA = LoraParams(r=4, alpha=8.0)
BASE_PATH = "models/iter_0/policy"      # the base's workspace-relative path, as DVC names it


def tiny_llama(seed: int = 0) -> transformers.PreTrainedModel:
    return build_tiny_model(TinyModelParams(), VOCAB, SPECIAL, seed)


def tiny_qwen2(seed: int = 0) -> transformers.PreTrainedModel:
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
        tie_word_embeddings=True, **SPECIAL)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


ARCHS: dict[str, Callable[..., transformers.PreTrainedModel]] = {"llama": tiny_llama, "qwen2": tiny_qwen2}


def random_ids(g: torch.Generator, k: int) -> tuple[int, ...]:
    return tuple(int(x) for x in torch.randint(3, VOCAB, (k,), generator=g))


def random_pairs(n: int = 8) -> list[EncodedPair]:
    g = torch.Generator().manual_seed(3)
    return [EncodedPair(random_ids(g, 5), random_ids(g, 6) + (2,), random_ids(g, 4) + (2,)) for _ in range(n)]


def chosen_logprobs(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (N, R) and mask of the pairs' chosen responses."""
    pairs = random_pairs(4)
    with torch.no_grad():
        return lm.response_logprobs(model, [p.prompt_ids for p in pairs],
                                    [p.chosen_ids for p in pairs], SPECIAL["pad_token_id"])


def with_adapter(arch: str) -> tuple[transformers.PreTrainedModel, torch.nn.Module]:
    """(an untouched copy of the base, the base with a fresh adapter)."""
    base = ARCHS[arch]()
    return copy.deepcopy(base), adapters.attach(base, LORA, torch.Generator().manual_seed(1))


def perturb_adapter(policy: torch.nn.Module, scale: float = 0.05) -> None:
    """B away from its zero init, so the adapter changes what the model computes."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, q in policy.named_parameters():
            if "lora_B" in name:
                q.copy_(torch.randn(q.shape, generator=g) * scale)


def base_weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's weights under the adapter, by the base model's own names."""
    return {n.replace(".base_layer", ""): q for n, q in policy.get_base_model().named_parameters()
            if "lora_" not in n}
