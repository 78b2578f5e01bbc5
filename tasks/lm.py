"""Causal-LM plumbing shared by the stages: loading, chat rendering, batching, log-probs."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from tasks.errors import InputError
from tasks.records import Prompt, prompt_to_record

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import transformers  # noqa: E402  (after the offline switches)

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
logging.getLogger("transformers").setLevel(logging.ERROR)


class ModelError(InputError):
    """A model path that does not exist or does not hold a loadable model."""


def check_model_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"{path}: model directory does not exist")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: no config.json (not a saved transformers model)")
    return path


def load_tokenizer(path: str | Path) -> transformers.PreTrainedTokenizerBase:
    tok = transformers.AutoTokenizer.from_pretrained(check_model_dir(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str | Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        check_model_dir(path), dtype=torch.float32)
    return model.eval()


def weights_md5(path: str | Path) -> str:
    """md5 over the weight files of a saved model directory (its version identity)."""
    h = hashlib.md5()
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path}: no *.safetensors weights")
    for f in files:
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def autocast(precision: str) -> contextlib.AbstractContextManager[object]:
    """bf16: matmuls in bfloat16 under torch.autocast (weights, optimizer state, softmax and
    losses stay fp32); fp32: no-op. AVX512-BF16 CPUs run bf16 matmuls ~2.2x faster."""
    if precision == "bf16":
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def render_prompt(tok: transformers.PreTrainedTokenizerBase, prompt: Prompt,
                  max_tokens: int) -> list[int]:
    """Chat-template the prompt (with the generation prompt) and keep its last max_tokens ids."""
    text = tok.apply_chat_template(prompt_to_record(prompt), tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids[-max_tokens:]


def encode_response(tok: transformers.PreTrainedTokenizerBase, text: str,
                    max_tokens: int) -> list[int]:
    """Response text to ids, ending with EOS when it fits (a finished response)."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return (ids + [tok.eos_token_id])[:max_tokens]


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad to (B, T) ids and a (B, T) attention mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def response_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                      responses: Sequence[Sequence[int]], pad_id: int,
                      temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of each response given its prompt.

    Returns logprobs (B, R) and a response mask (B, R), R = longest response; entries past a
    response's end are 0 in both. Differentiable when grad is enabled.
    """
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    ids, mask = pad_right(seqs, pad_id)                                  # (B, T)
    # only positions that predict a response token need logits: the lm_head and the
    # softmax over the vocabulary are skipped for the shared prompt prefix
    first = min(len(p) for p in prompts) - 1
    keep = ids.shape[1] - first
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits[:, :-1]
    logits = logits.float() / temperature                                # (B, K-1, V)
    targets = ids[:, first + 1:, None]                                   # (B, K-1, 1)
    token_logp = logits.gather(-1, targets).squeeze(-1) - logits.logsumexp(-1)
    width = max(len(r) for r in responses)
    rmask = torch.zeros((len(seqs), width))
    rows = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        start = len(p) - 1 - first              # logit at position t predicts token t+1
        rows.append(token_logp[i, start: start + len(r)])
        rmask[i, : len(r)] = 1
    out = torch.stack([F.pad(row, (0, width - row.numel())) for row in rows])
    return out, rmask


def sequence_logprob(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                     responses: Sequence[Sequence[int]], pad_id: int) -> Tensor:
    """Summed response log-prob log pi(y|x), shape (B,)."""
    logp, mask = response_logprobs(model, prompts, responses, pad_id)
    return (logp * mask).sum(-1)
