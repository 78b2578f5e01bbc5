"""Causal-LM plumbing shared by the stages: loading, chat rendering, batching, log-probs."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import posixpath
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from tasks.core import atomic, layout
from tasks.core.errors import InputError
from tasks.data.records import Prompt, prompt_to_record
from tasks.runtime.device import Device, device_of

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
    """The tokenizer saved in a model directory (or beside an ensemble's member directories,
    which has a tokenizer_config.json and no config.json of its own)."""
    path = Path(path)
    if not (path / "tokenizer_config.json").is_file():
        check_model_dir(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str | Path, device: Device = "cpu") -> transformers.PreTrainedModel:
    """A saved causal LM in fp32, on `device`, in eval mode."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        check_model_dir(path), dtype=torch.float32)
    return model.to(device).eval()


ADAPTER_BASE = layout.ADAPTER_BASE     # a model directory that stores only what it adds to a base


@dataclass(frozen=True)
class BaseRecord:
    """The base a model directory stores no weights of, named in its alignloop_base.json: a
    LoRA adapter's base model (tasks/models/adapters.py), or the backbone whose first
    `num_layers` blocks a head-only reward model reads (tasks/reward/reward_model.py).
    base_path is relative to the workspace (as DVC names it); base_md5 is `weights_md5`."""
    base_path: str
    base_md5: str
    num_layers: int | None = None


def is_workspace_relative(path: str) -> bool:
    """A relative POSIX path that stays inside the workspace."""
    norm = posixpath.normpath(path) if path else ""
    return bool(norm) and not path.startswith(("/", "~", "\\")) and \
        norm != ".." and not norm.startswith("../") and "\\" not in path


def write_base_record(model_dir: str | Path, record: BaseRecord) -> None:
    """alignloop_base.json, atomically (num_layers only when the record has it)."""
    if not is_workspace_relative(record.base_path):
        raise ValueError(f"base_path {record.base_path!r} must be relative to the workspace")
    data = {k: v for k, v in asdict(record).items() if v is not None}
    atomic.write_json(Path(model_dir) / ADAPTER_BASE, data)


def read_base_record(model_dir: str | Path, *, layers: bool = False) -> BaseRecord | None:
    """The record of `model_dir`'s base; None when the directory stores its weights whole.
    `layers`: num_layers is required (a head-only reward model's). A malformed record is a
    ModelError naming the file and the field."""
    f = Path(model_dir) / ADAPTER_BASE
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{f}: not a JSON object ({e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{f}: not a JSON object")
    for key in ("base_path", "base_md5"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ModelError(f"{f}: {key}: expected a non-empty string, got {data.get(key)!r}")
    if not is_workspace_relative(data["base_path"]):
        raise ModelError(f"{f}: base_path: {data['base_path']!r} is not relative to the "
                         "workspace")
    n = data.get("num_layers")
    if (layers or n is not None) and \
            not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
        raise ModelError(f"{f}: num_layers: expected a positive integer, got {n!r}")
    return BaseRecord(data["base_path"], data["base_md5"], n)


def weights_md5(path: str | Path) -> str:
    """md5 over the weight files of a saved model directory (its version identity); of an
    adapter directory, over its weights and the file naming its base (path and md5): the same
    adapter on another base is another model."""
    h = hashlib.md5()
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path}: no *.safetensors weights")
    if (Path(path) / ADAPTER_BASE).is_file():
        files.append(Path(path) / ADAPTER_BASE)
    for f in files:
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def native_bf16(device: Device = "cpu") -> bool:
    """Whether `device` runs bf16 matmuls in hardware: an x86 CPU with AVX512-BF16 or AMX, an
    ARM CPU with bf16 (oneDNN's check), CUDA as torch reports (Ampere and later). oneDNN's own
    x86 check accepts any AVX512 core (Skylake, Cascade Lake), which has no bf16 instructions
    (emulated: 3-4x slower than fp32 by ONNX Runtime's note; no such CPU here); without
    AVX512 torch falls back to reference kernels: on an AVX2 EPYC (2 cores) a bf16
    (512 x 576) @ (576 x 1536) ran at 1.2 GFLOP/s against fp32's 92 (benchmarks/peaks.py).
    Asked once per device: autocast asks on every training step."""
    if torch.device(device).type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return any(bool(getattr(torch.cpu, name, lambda: False)())
                   for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(supported()) if supported is not None else False


_warned_bf16 = False


def effective_precision(precision: str, device: Device = "cpu") -> str:
    """The precision a `precision` setting runs in on `device`: auto = bf16 where its bf16
    matmuls are native, else fp32; fp32 and bf16 as asked (bf16 without native kernels: one
    warning line, since it is tens of times slower than fp32 there)."""
    global _warned_bf16
    if precision == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    if precision == "bf16" and not _warned_bf16 and not native_bf16(device):
        _warned_bf16 = True
        print("warning: precision bf16 without native bf16 matmuls (a CPU without AVX512-BF16 "
              "or AMX): tens of times slower than fp32 here; precision: auto picks fp32",
              file=sys.stderr, flush=True)
    return precision


def autocast(precision: str, device: Device = "cpu") -> contextlib.AbstractContextManager[object]:
    """bf16 (or auto resolving to it): matmuls in bfloat16 under torch.autocast for the
    device's type (weights, optimizer state, softmax and losses stay fp32); fp32: no-op.
    AVX512-BF16 CPUs run bf16 matmuls ~2.2x faster than fp32, CPUs without native bf16 kernels
    ~70x slower; on CUDA it is the usual mixed precision (no loss scaling: bf16 has fp32's
    range)."""
    if effective_precision(precision, device) == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
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
    """The text of a response that ended (an imported pair's side) to ids, with EOS when it
    fits. Sampled responses keep the ids they were drawn as (`reward_model.response_ids`): a
    truncated one has no EOS, and its text need not re-tokenise to the same ids."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return (ids + [tok.eos_token_id])[:max_tokens]


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int,
              device: Device = "cpu") -> tuple[Tensor, Tensor]:
    """Right-pad to (B, T) ids and a (B, T) attention mask, on `device`."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)   # cpu: host rows, copied once
    mask = torch.zeros((len(seqs), width), dtype=torch.long)          # cpu: host rows, copied once
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)         # cpu: host rows, copied once
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


@dataclass(frozen=True)
class Packed:
    """Responses that share a prompt, packed into one row: [x | y_1 | ... | y_k | pad]. Each
    y_j's positions continue from x and y_j attends x and itself only, so every response sees
    exactly what its own [x | y_j] row would, while x is computed once per row (K samples of a
    prompt, or a preference pair's two sides, cost |x| + sum |y_j| tokens, not K |x| + ...)."""
    ids: Tensor                 # (G, T) one row per distinct prompt, right-padded
    positions: Tensor           # (G, T) position ids
    attention: Tensor           # (G, 1, T, T) bool: query t may attend key s
    rows: Tensor                # (N,) each response's row, in input order
    prompt_ends: list[int]      # (N) position of its prompt's last token
    starts: list[int]           # (N) position of its first token
    lengths: list[int]          # (N) its token count

    def predictors(self) -> tuple[Tensor, Tensor, Tensor]:
        """Per response, the positions whose outputs predict its tokens (the prompt's last for
        the first token, then its own), its tokens' positions and the mask, each (N, R).

        Slots past a response's end (mask 0) point at its prompt's last position, never before
        it: callers that keep outputs from the earliest prompt end on (`packed_logprobs`) index
        at `pred - min(prompt_ends)` >= 0."""
        n, width = len(self.lengths), max(self.lengths, default=0)
        ends = torch.tensor(self.prompt_ends, dtype=torch.long)[:, None]  # cpu: host rows, one copy
        pred = ends.expand(n, width).clone()
        at = ends.expand(n, width).clone()
        mask = torch.zeros((n, width))  # cpu: host rows, copied once
        for i, (end, start, length) in enumerate(zip(self.prompt_ends, self.starts,
                                                     self.lengths)):
            if length:
                pred[i, :length] = torch.tensor(  # cpu: host rows, copied once
                    [end] + list(range(start, start + length - 1)))
                at[i, :length] = torch.arange(start, start + length)  # cpu: host rows, copied once
                mask[i, :length] = 1
        device = self.ids.device
        return pred.to(device), at.to(device), mask.to(device)

    def last_positions(self) -> Tensor:
        """(N,) position of each response's last token (its prompt's last when empty)."""
        return torch.tensor([s + n - 1 if n else e for e, s, n in
                             zip(self.prompt_ends, self.starts, self.lengths)],
                            device=self.ids.device)


def prompt_groups(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of identical prompts, grouped, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    return list(groups.values())


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
         pad_id: int, device: Device = "cpu") -> Packed:
    """Group the responses by identical prompt and pack each group into one row (Packed), its
    tensors on `device` (built on the CPU row by row, then copied once)."""
    n = len(prompts)
    rows, ends, starts = [0] * n, [0] * n, [0] * n
    seqs, segs, poss = [], [], []
    for g, members in enumerate(prompt_groups(prompts)):
        prompt = prompts[members[0]]
        seq, seg, pos = list(prompt), [0] * len(prompt), list(range(len(prompt)))
        for j, i in enumerate(members, start=1):
            r = list(responses[i])
            rows[i], ends[i], starts[i] = g, len(prompt) - 1, len(seq)
            seq += r
            seg += [j] * len(r)
            pos += range(len(prompt), len(prompt) + len(r))
        seqs.append(seq)
        segs.append(seg)
        poss.append(pos)
    ids, _ = pad_right(seqs, pad_id, device)                                # (G, T)
    t = ids.shape[1]
    segment = torch.full(ids.shape, -1, dtype=torch.long)  # cpu: host rows, one copy; -1: pad
    positions = torch.zeros(ids.shape, dtype=torch.long)     # cpu: host rows, copied once
    for g, (seg, pos) in enumerate(zip(segs, poss)):
        segment[g, : len(seg)] = torch.tensor(seg, dtype=torch.long)  # cpu: host rows, copied once
        positions[g, : len(pos)] = torch.tensor(pos, dtype=torch.long)  # cpu: host rows, one copy
    segment, positions = segment.to(device), positions.to(device)
    causal = torch.ones((t, t), dtype=torch.bool, device=device).tril()     # key s <= query t
    seg_q, seg_k = segment[:, :, None], segment[:, None, :]                 # (G, T, 1), (G, 1, T)
    attention = causal & ((seg_k == 0) | (seg_k == seg_q))                  # prompt, or own
    return Packed(ids, positions, attention[:, None],
                  torch.tensor(rows, dtype=torch.long, device=device),
                  ends, starts, [len(r) for r in responses])


def model_config(model: object) -> object | None:
    """A model's transformers config: its own, or (a wrapper module) the first inside it."""
    config = getattr(model, "config", None)
    if config is None and isinstance(model, torch.nn.Module):
        config = next((m.config for m in model.modules()
                       if getattr(m, "config", None) is not None), None)
    return config


def attention_mask(model: torch.nn.Module, allowed: Tensor) -> Tensor:
    """A packed (G, 1, T, T) boolean mask (True: may attend) in the form `model`'s attention
    implementation reads it. transformers hands a 4D mask to the attention function unchanged:
    sdpa takes booleans, eager adds the mask to its scores, so it gets 0 where a key is allowed
    and the lowest fp32 value elsewhere (booleans added as 0 / 1 would mask nothing: every
    token would see the future and the other responses of its row). fp32 for any weight dtype:
    the scores are promoted to it before eager's fp32 softmax."""
    impl = getattr(model_config(model), "_attn_implementation", None) or "sdpa"
    if impl == "sdpa":
        return allowed
    if impl == "eager":
        additive = torch.zeros(allowed.shape, device=allowed.device)
        return additive.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    raise ModelError(f"attention implementation {impl!r} cannot take the packed 4D attention "
                     "mask; load the model with attn_implementation='sdpa' or 'eager'")


def packed_logprobs(model: torch.nn.Module, pk: Packed,
                    temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Per-token log-probs (N, R) and mask (N, R) of the packed responses, one forward pass.
    Only positions that predict a response token get logits: the lm_head and the softmax over
    the vocabulary are skipped for the prompt before its last token."""
    first = min(pk.prompt_ends)                   # the earliest position predicting a token
    logits = model(input_ids=pk.ids, attention_mask=attention_mask(model, pk.attention),
                   position_ids=pk.positions,
                   logits_to_keep=pk.ids.shape[1] - first).logits
    logits = logits.float() / temperature                                # (G, T - first, V)
    pred, at, mask = pk.predictors()                                     # (N, R) each
    rows = pk.rows[:, None]                                              # (N, 1)
    tokens = pk.ids[rows, at]                                            # (N, R) y_t
    lse = logits.logsumexp(-1)                                           # (G, T - first)
    logp = logits[rows, pred - first, tokens] - lse[rows, pred - first]  # log pi(y_t | x, y_<t)
    return logp * mask, mask


def response_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                      responses: Sequence[Sequence[int]], pad_id: int,
                      temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of each response given its prompt, responses to the same prompt
    packed into one row (`pack`).

    Returns logprobs (B, R) and a response mask (B, R), R = longest response; entries past a
    response's end are 0 in both. Differentiable when grad is enabled.
    """
    return packed_logprobs(model, pack(prompts, responses, pad_id, device_of(model)),
                           temperature)


def sequence_logprob(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                     responses: Sequence[Sequence[int]], pad_id: int) -> Tensor:
    """Summed response log-prob log pi(y|x), shape (B,)."""
    logp, mask = response_logprobs(model, prompts, responses, pad_id)
    return (logp * mask).sum(-1)


def padded(rows: Sequence[Sequence[float]]) -> tuple[Tensor, Tensor]:
    """Ragged per-token values (host lists: a sample's stored log-probs) to (B, R) values and
    mask, on the CPU: the metrics are computed there from values read back from the device."""
    width = max((len(r) for r in rows), default=0)
    vals = torch.zeros((len(rows), width))   # cpu: host-side metric arithmetic
    mask = torch.zeros((len(rows), width))   # cpu: host-side metric arithmetic
    for i, r in enumerate(rows):
        vals[i, : len(r)] = torch.tensor(r, dtype=torch.float32)  # cpu: host-side metric arithmetic
        mask[i, : len(r)] = 1
    return vals, mask


def mean_nll(logprobs: Tensor, mask: Tensor) -> list[float]:
    """Per-response mean NLL from (B, R) token log-probs and mask; empty responses get +inf
    (nothing said is not fluent)."""
    n = mask.sum(-1)
    total = -(logprobs * mask).sum(-1)
    return [float(t / k) if k > 0 else float("inf") for t, k in zip(total.tolist(), n.tolist())]
