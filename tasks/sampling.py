"""Batched autoregressive sampling with a KV cache that records the sampler's log-probs.

The log-prob stored for each token is that of the distribution it was actually drawn from
(temperature and top-p applied), i.e. the behaviour policy's probability: exactly what PPO's
ratio pi_theta / pi_old and any later importance weighting need.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Sample:
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finished: bool          # ended with EOS (included in response_ids) rather than truncated


def _top_p_filter(logp: Tensor, top_p: float) -> Tensor:
    """Mask tokens outside the nucleus and renormalise. logp: (B, V) log-probs."""
    if top_p >= 1.0:
        return logp
    sorted_logp, idx = logp.sort(dim=-1, descending=True)
    cum = sorted_logp.exp().cumsum(-1)
    drop = cum - sorted_logp.exp() > top_p           # keep the smallest set with mass >= top_p
    sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logp, float("-inf")).scatter(-1, idx, sorted_logp)
    return F.log_softmax(filtered, dim=-1)


@torch.no_grad()
def sample_batch(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 eos_id: int, pad_id: int, temperature: float, top_p: float,
                 generator: torch.Generator) -> list[Sample]:
    """Sample one response per prompt. Prompts are left-padded; positions follow the mask."""
    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)                       # (B, T)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache, logits = out.cache, out.logits[:, -1]                         # (B, V)
    tokens = torch.zeros((b, max_new_tokens), dtype=torch.long)
    logps = torch.zeros((b, max_new_tokens))
    done = torch.zeros(b, dtype=torch.bool)
    lengths = torch.full((b,), max_new_tokens, dtype=torch.long)
    next_pos = positions[:, -1] + 1
    for t in range(max_new_tokens):
        # 1. the sampling distribution: temperature, then nucleus
        logp = _top_p_filter(F.log_softmax(logits.float() / temperature, dim=-1), top_p)
        tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)   # (B,)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        # 2. record token and the behaviour log-prob
        tokens[:, t] = tok
        logps[:, t] = logp.gather(-1, tok[:, None]).squeeze(-1).masked_fill(done, 0.0)
        newly = (~done) & (tok == eos_id)
        lengths = torch.where(newly, torch.full_like(lengths, t + 1), lengths)
        done |= newly
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        # 3. one cached decoding step
        mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]
        next_pos = next_pos + 1
    samples = []
    for i in range(b):
        n = int(lengths[i])
        ids_i = tuple(int(x) for x in tokens[i, :n])
        finished = bool(n > 0 and ids_i[-1] == eos_id)
        samples.append(Sample(ids_i, tuple(float(x) for x in logps[i, :n]), finished))
    return samples


def sample(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, batch_size: int,
           max_new_tokens: int, eos_id: int, pad_id: int, temperature: float, top_p: float,
           generator: torch.Generator) -> list[Sample]:
    """Sample one response per prompt, in batches of batch_size (order preserved)."""
    out: list[Sample] = []
    for start in range(0, len(prompts), batch_size):
        out.extend(sample_batch(model, prompts[start: start + batch_size],
                                max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                                temperature=temperature, top_p=top_p, generator=generator))
    return out
