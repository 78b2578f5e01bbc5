"""A lean fp32 decoder for Llama-architecture causal LMs: the sampler's fast path.

The math is transformers' `LlamaForCausalLM` (RMSNorm, RoPE, grouped-query attention, SwiGLU,
final norm, lm_head; embedding, rotary and norm weights are read from the model), arranged for
batched sampling:
- one preallocated KV cache per batch, written in place (no per-step concatenation);
- grouped-query attention that groups the query heads under their KV head instead of
  repeating K/V for every query head;
- fused QKV and gate/up projections, concatenated from the model's weights at each `sample`
  call, so no copy outlives a weight update;
- prefix sharing: the prefix common to all prompts of the batch is run once (batch 1) and its
  KV kept once, attended by all rows in one matmul; each distinct prompt's remainder is run
  once, packed with others into sequences without padding, and its KV copied out to that
  prompt's samples (the K rollouts of a prompt);
- logits only at the positions a token is sampled from, computed a vocabulary chunk at a time
  into one reused buffer.

A row's keys are [shared prefix | pad ... remainder | generated tokens]; pad slots carry a -inf
key bias and positions are counted over real tokens only, so every row sees exactly the
attention and positions of its prompt run alone.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor

HEAD_CHUNK = 2048     # vocabulary columns per lm_head product
PACK_TOKENS = 256     # prompt tokens per packed prefill sequence


def supports(model: torch.nn.Module) -> bool:
    """True for a plain fp32 LlamaForCausalLM whose forward this module reproduces."""
    if type(model) is not transformers.LlamaForCausalLM:
        return False
    c = model.config
    return (c.hidden_act == "silu" and not c.attention_bias and not c.mlp_bias
            and getattr(c, "pretraining_tp", 1) == 1 and c.attention_dropout == 0.0
            and all(p.dtype == torch.float32 for p in model.parameters()))


@dataclass(frozen=True)
class _Layer:
    in_norm: torch.nn.Module
    post_norm: torch.nn.Module
    qkv: Tensor          # (H*hd + 2*KV*hd, D): q (pre-scaled by 1/sqrt(hd)), k, v stacked
    o: Tensor            # (D, H*hd)
    gate_up: Tensor      # (2*I, D): gate and up projections stacked
    down: Tensor         # (D, I)


@dataclass(frozen=True)
class PromptLayout:
    """Where each row's prompt lies: a shared prefix, then its distinct remainder right-aligned."""
    prefix: tuple[int, ...]                  # common to every prompt (always leaves >= 1 token)
    remainders: tuple[tuple[int, ...], ...]  # one per distinct prompt, prefix removed
    row_prompt: tuple[int, ...]              # row -> index into remainders

    @property
    def width(self) -> int:
        """Slots from the prefix's end to the last prompt token (longest remainder)."""
        return max(len(r) for r in self.remainders)


def prompt_layout(prompts: Sequence[Sequence[int]]) -> PromptLayout:
    distinct = list(dict.fromkeys(tuple(p) for p in prompts))
    index = {p: i for i, p in enumerate(distinct)}
    n = min(len(p) for p in distinct) - 1            # keep one token: its logits start sampling
    first = distinct[0]
    for p in distinct[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return PromptLayout(first[:max(n, 0)], tuple(p[max(n, 0):] for p in distinct),
                        tuple(index[tuple(p)] for p in prompts))


class LlamaWeights:
    """The model's weights as the decoder reads them: per layer its norms, fused QKV, output,
    fused gate/up and down projections. Built per `sample` call, so it never outlives an
    update of the model."""

    def __init__(self, model: transformers.LlamaForCausalLM):
        c = model.config
        self.model = model
        self.n_heads, self.n_kv = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        scale = self.head_dim ** -0.5       # attention's 1/sqrt(hd), folded into W_q
        self.layers = [_Layer(
            layer.input_layernorm, layer.post_attention_layernorm,
            torch.cat([layer.self_attn.q_proj.weight * scale, layer.self_attn.k_proj.weight,
                       layer.self_attn.v_proj.weight]),
            layer.self_attn.o_proj.weight,
            torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
            layer.mlp.down_proj.weight) for layer in model.model.layers[: c.num_hidden_layers]]


class LlamaDecoder:
    """Prefill and one-token decode steps for a batch of prompts; returns tempered logits.

    `prefill()` gives the (B, V) logits of each row's first response token; `step(tokens)`
    appends one token per row and gives the next (B, V) logits. Both return the same buffer,
    which the caller may overwrite in place until the next call.

    The KV cache has two parts: the shared prefix's, stored once (L, KV, P, hd) and attended by
    every row as one matmul over all rows' queries, and each row's own (L, B, KV, S, hd) for
    its prompt remainder and generated tokens.
    """

    def __init__(self, weights: LlamaWeights, prompts: Sequence[Sequence[int]], *, pad_id: int,
                 temperature: float, max_new_tokens: int):
        self.model, self.layers = weights.model, weights.layers
        self.n_heads, self.n_kv, self.head_dim = weights.n_heads, weights.n_kv, weights.head_dim
        self.pad_id, self.inv_temp = pad_id, 1.0 / temperature
        self.layout = prompt_layout(prompts)
        n_layers, b, width = len(self.layers), len(prompts), self.layout.width
        self.k_prefix = self.v_prefix = torch.zeros((n_layers, self.n_kv, 0, self.head_dim))
        shape = (n_layers, b, self.n_kv, width + max_new_tokens, self.head_dim)
        self.k, self.v = torch.empty(shape), torch.empty(shape)            # (L, B, KV, S, hd)
        self.key_bias = torch.zeros((b, width + max_new_tokens))            # 0 or -inf per slot
        self.next_slot = width
        self.next_pos = torch.zeros(b, dtype=torch.long)                    # (B,)
        self.logits = torch.empty((b, self.model.lm_head.weight.shape[0]))  # (B, V)

    # -- the transformer -----------------------------------------------------------------------
    def _forward(self, ids: Tensor, positions: Tensor, k: Tensor, v: Tensor, start: int,
                 bias: Tensor) -> Tensor:
        """Run ids (N, T) at slots [start, start+T) of the row cache k, v (L, N, KV, S, hd),
        attending to the whole shared prefix and to row slots [0, start+T) with additive bias
        (N, T, start+T). Returns the final-norm hidden states (N, T, D)."""
        m = self.model.model
        n, t = ids.shape
        h, kv, g, hd = self.n_heads, self.n_kv, self.n_heads // self.n_kv, self.head_dim
        p, end = self.k_prefix.shape[2], start + ids.shape[1]
        x = m.embed_tokens(ids)                                             # (N, T, D)
        cos, sin = (a.unsqueeze(2) for a in m.rotary_emb(x, positions))     # (N, T, 1, hd)
        bias = bias[:, None, None]                                          # (N, 1, 1, T, S')
        for i, w in enumerate(self.layers):
            # 1. fused QKV; RoPE on q and k together; new k, v into the row cache
            qkv = F.linear(_rms_norm(w.in_norm, x), w.qkv)                  # (N, T, (H+2KV)*hd)
            qk = _rope(qkv[..., : (h + kv) * hd].view(n, t, h + kv, hd), cos, sin)
            k[i, :, :, start:end] = qk[:, :, h:].transpose(1, 2)
            v[i, :, :, start:end] = qkv[..., (h + kv) * hd:].view(n, t, kv, hd).transpose(1, 2)
            q = qk[:, :, :h].reshape(n, t, kv, g, hd)
            q = q.permute(0, 2, 3, 1, 4).reshape(n, kv, g * t, hd)          # (N, KV, G*T, hd)
            # 2. grouped-query attention: row slots, then the shared prefix for all rows at once
            scores = q @ k[i, :, :, :end].transpose(-1, -2)                 # (N, KV, G*T, S')
            scores = (scores.view(n, kv, g, t, end) + bias).view(n, kv, g * t, end)
            if p:
                q_all = q.transpose(0, 1).reshape(kv, n * g * t, hd)        # (KV, N*G*T, hd)
                s_pre = (q_all @ self.k_prefix[i].transpose(-1, -2)).view(kv, n, g * t, p)
                scores = torch.cat([s_pre.transpose(0, 1), scores], dim=-1)
            probs = scores.softmax(-1)                                      # (N, KV, G*T, P+S')
            att = probs[..., p:] @ v[i, :, :, :end]                         # (N, KV, G*T, hd)
            if p:
                pre = probs[..., :p].transpose(0, 1).reshape(kv, n * g * t, p) @ self.v_prefix[i]
                att = att + pre.view(kv, n, g * t, hd).transpose(0, 1)
            att = att.view(n, kv, g, t, hd).permute(0, 3, 1, 2, 4).reshape(n, t, h * hd)
            x = _add_linear(x, att, w.o)
            # 3. SwiGLU MLP with the fused gate/up projection
            gate, up = F.linear(_rms_norm(w.post_norm, x), w.gate_up).chunk(2, dim=-1)
            x = _add_linear(x, F.silu(gate).mul_(up), w.down)
        return _rms_norm(m.norm, x)

    def _head(self, hidden: Tensor, out: Tensor) -> Tensor:
        """Tempered logits (N, V) of last hidden states (N, D), into out, a vocabulary chunk at
        a time: a chunk's product stays in cache, which the full-width product does not."""
        hidden, weight = hidden * self.inv_temp, self.model.lm_head.weight
        chunk = torch.empty((hidden.shape[0], min(HEAD_CHUNK, weight.shape[0])))
        for lo in range(0, weight.shape[0], HEAD_CHUNK):
            part = chunk[:, : min(HEAD_CHUNK, weight.shape[0] - lo)]
            out[:, lo: lo + part.shape[1]] = torch.mm(hidden, weight[lo: lo + part.shape[1]].t(),
                                                      out=part)
        return out

    # -- prefill -------------------------------------------------------------------------------
    def prefill(self) -> Tensor:
        lay = self.layout
        n_p, width = len(lay.prefix), lay.width
        n_layers, kv, hd = len(self.layers), self.n_kv, self.head_dim
        # 1. the shared prefix, once
        if n_p:
            k1, v1 = (torch.empty((n_layers, 1, kv, n_p, hd)) for _ in range(2))
            causal = torch.full((n_p, n_p), float("-inf")).triu_(1)[None]
            self._forward(torch.tensor([lay.prefix]), torch.arange(n_p)[None], k1, v1, 0, causal)
            self.k_prefix, self.v_prefix = k1[:, 0], v1[:, 0]
        # 2. each distinct remainder once, packed into sequences of about PACK_TOKENS tokens
        last = torch.empty((len(lay.remainders), self.model.config.hidden_size))   # (D, D_model)
        for group in _pack([len(r) for r in lay.remainders], PACK_TOKENS):
            self._prefill_packed(group, last)
        # 3. each row's remainder slots right-aligned before the generated ones; pads masked
        lengths = torch.tensor([len(lay.remainders[j]) for j in lay.row_prompt])     # (B,)
        pad = torch.arange(width)[None, :] < (width - lengths)[:, None]             # (B, W)
        self.key_bias[:, :width].masked_fill_(pad, float("-inf"))
        for cache in (self.k, self.v):          # finite pads: a masked key must not be NaN
            cache[:, :, :, :width].masked_fill_(pad[None, :, None, :, None], 0.0)
        self.next_pos = n_p + lengths
        rows = torch.tensor(lay.row_prompt)
        return torch.index_select(self._head(last, torch.empty(len(last), self.logits.shape[1])),
                                  0, rows, out=self.logits)

    def _prefill_packed(self, group: Sequence[int], last: Tensor) -> None:
        """Run the remainders in group as one sequence, each attending to the prefix and to
        itself only; copy their KV out to their rows and their last hidden state into last."""
        lay, width = self.layout, self.layout.width
        n_p = len(lay.prefix)
        rems = [lay.remainders[j] for j in group]
        seg = torch.cat([torch.full((len(r),), i) for i, r in enumerate(rems)])       # (T,)
        offset = torch.cat([torch.arange(len(r)) for r in rems])                      # (T,)
        allowed = (seg[:, None] == seg[None, :]) & (offset[None, :] <= offset[:, None])
        bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))[None]
        t = len(seg)
        k1, v1 = (torch.empty((len(self.layers), 1, self.n_kv, t, self.head_dim))
                  for _ in range(2))
        ids = torch.tensor([[tok for r in rems for tok in r]])
        hidden = self._forward(ids, (n_p + offset)[None], k1, v1, 0, bias)[0]        # (T, D)
        start = 0
        for j, r in zip(group, rems):
            end = start + len(r)
            rows = [i for i, jj in enumerate(lay.row_prompt) if jj == j]
            self.k[:, rows, :, width - len(r): width] = k1[:, :, :, start:end]
            self.v[:, rows, :, width - len(r): width] = v1[:, :, :, start:end]
            last[j] = hidden[end - 1]
            start = end

    # -- decode --------------------------------------------------------------------------------
    def step(self, tokens: Tensor) -> Tensor:
        """Append tokens (B,) at the next slot; returns the next tempered logits (B, V)."""
        s = self.next_slot
        bias = self.key_bias[:, None, : s + 1]                              # (B, 1, S')
        hidden = self._forward(tokens[:, None], self.next_pos[:, None], self.k, self.v, s, bias)
        self.next_slot, self.next_pos = s + 1, self.next_pos + 1
        return self._head(hidden[:, -1], self.logits)


def _pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive indices grouped so that each group's lengths sum to at most budget (a
    longer item goes alone)."""
    groups: list[list[int]] = []
    total = budget
    for i, n in enumerate(lengths):
        if total + n > budget:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def _add_linear(x: Tensor, a: Tensor, weight: Tensor) -> Tensor:
    """x + a @ weight.T as one GEMM accumulating into a copy of x (the residual update)."""
    out = torch.addmm(x.reshape(-1, x.shape[-1]), a.reshape(-1, a.shape[-1]), weight.t())
    return out.view(x.shape)


def _rms_norm(norm: torch.nn.Module, x: Tensor) -> Tensor:
    """The model's RMSNorm (weight * x / rms(x)) as one fused op."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE as transformers applies it (rotate_half convention). x: (N, T, heads, hd)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
