"""A lean fp32 decoder for Llama-architecture causal LMs: the sampler's fast path.

The math is transformers' `LlamaForCausalLM` (RMSNorm, RoPE, grouped-query attention, SwiGLU,
final norm, lm_head; embedding, rotary and norm weights are read from the model), arranged for
batched sampling:
- one preallocated KV cache per batch, written in place (no per-step concatenation);
- grouped-query attention that groups the query heads under their KV head instead of
  repeating K/V for every query head;
- fused QKV and gate/up projections, concatenated from the model's weights at each `sample`
  call, so no copy outlives a weight update;
- prompt sharing: the prefix common to all prompts of the batch is run once (batch 1) and its
  KV stored once; each distinct prompt's remainder is run once (packed with others into
  sequences without padding) and its KV stored once for its K samples (consecutive rows). A
  decode step attends to the three parts as one softmax: the prefix with one matmul over all
  rows' queries, a remainder with one matmul over its K rows' queries, and each row's own
  generated tokens;
- logits only at the positions a token is sampled from, computed a vocabulary chunk at a time
  into one reused buffer.

Every row sees exactly the keys and positions of its prompt run alone: remainders are
right-aligned with -inf key bias on the pad slots before them, positions count real tokens.
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
    """A batch's prompts as a shared prefix and distinct remainders, each remainder the prompt
    of `group` consecutive rows (row r has remainder r // group)."""
    prefix: tuple[int, ...]                  # common to every prompt (always leaves >= 1 token)
    remainders: tuple[tuple[int, ...], ...]  # prefix removed
    group: int                               # rows per remainder

    @property
    def width(self) -> int:
        """Key slots of the remainder part (the longest remainder)."""
        return max(len(r) for r in self.remainders)


def prompt_layout(prompts: Sequence[Sequence[int]]) -> PromptLayout:
    """Runs of equal consecutive prompts share a remainder when all runs are equally long (K
    samples per prompt, as rollouts lay them out); otherwise every row has its own."""
    rows = [tuple(p) for p in prompts]
    starts = [i for i in range(len(rows)) if i == 0 or rows[i] != rows[i - 1]]
    sizes = {b - a for a, b in zip(starts, starts[1:] + [len(rows)])}
    group = sizes.pop() if len(sizes) == 1 else 1
    distinct = rows[::group]
    n = min(len(p) for p in distinct) - 1            # keep one token: its logits start sampling
    for p in distinct[1:]:
        n = next((i for i in range(n) if p[i] != distinct[0][i]), n)
    n = max(n, 0)
    return PromptLayout(distinct[0][:n], tuple(p[n:] for p in distinct), group)


class LlamaWeights:
    """The model's weights as the decoder reads them: per layer its norms, fused QKV, output,
    fused gate/up and down projections. Built per `sample` call, so it never outlives an
    update of the model."""

    def __init__(self, model: transformers.LlamaForCausalLM):
        c = model.config
        self.model, self.device = model, model.lm_head.weight.device
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

    KV cache, each (L, ..., KV, slots, hd): the prefix's (L, KV, P, hd), the remainders'
    (L, D, KV, W, hd) with their key bias (D, W), and the rows' generated tokens'
    (L, B, KV, max_new_tokens, hd).
    """

    def __init__(self, weights: LlamaWeights, prompts: Sequence[Sequence[int]], *, pad_id: int,
                 temperature: float, max_new_tokens: int):
        self.model, self.layers = weights.model, weights.layers
        self.n_heads, self.n_kv, self.head_dim = weights.n_heads, weights.n_kv, weights.head_dim
        self.pad_id, self.inv_temp = pad_id, 1.0 / temperature
        self.layout = prompt_layout(prompts)
        n_layers, kv, hd = len(self.layers), self.n_kv, self.head_dim
        d, width = len(self.layout.remainders), self.layout.width
        self.device = dev = weights.device
        self.k_prefix = self.v_prefix = torch.zeros((n_layers, kv, 0, hd), device=dev)
        self.k_rem, self.v_rem = (torch.zeros((n_layers, d, kv, width, hd), device=dev)
                                  for _ in range(2))
        self.rem_bias = torch.zeros((d, width), device=dev)                 # 0 or -inf (pad)
        shape = (n_layers, len(prompts), kv, max_new_tokens, hd)
        self.k_gen = torch.empty(shape, device=dev)                        # written, then read
        self.v_gen = torch.empty(shape, device=dev)
        self.next_slot = 0
        self.next_pos = torch.zeros(len(prompts), dtype=torch.long, device=dev)   # (B,)
        self.logits = torch.empty((len(prompts), self.model.lm_head.weight.shape[0]),
                                  device=dev)                                      # (B, V)

    # -- the transformer -----------------------------------------------------------------------
    def _forward(self, ids: Tensor, positions: Tensor, k: Tensor, v: Tensor, start: int,
                 bias: Tensor | None, remainders: bool) -> Tensor:
        """Run ids (N, T) at slots [start, start+T) of the rows' own cache k, v
        (L, N, KV, S, hd), attending to the shared prefix, to the rows' remainders when asked,
        and to own slots [0, start+T) with additive bias (N, T, start+T) or none. Returns the
        final-norm hidden states (N, T, D)."""
        m = self.model.model
        n, t = ids.shape
        h, kv, g, hd = self.n_heads, self.n_kv, self.n_heads // self.n_kv, self.head_dim
        x = m.embed_tokens(ids)                                             # (N, T, D)
        cos, sin = (a.unsqueeze(2) for a in m.rotary_emb(x, positions))     # (N, T, 1, hd)
        for i, w in enumerate(self.layers):
            # 1. fused QKV (q pre-scaled); RoPE on q and k together; new k, v into own cache
            qkv = F.linear(_rms_norm(w.in_norm, x), w.qkv)                  # (N, T, (H+2KV)*hd)
            qk = _rope(qkv[..., : (h + kv) * hd].view(n, t, h + kv, hd), cos, sin)
            k[i, :, :, start: start + t] = qk[:, :, h:].transpose(1, 2)
            v[i, :, :, start: start + t] = qkv[..., (h + kv) * hd:].view(n, t, kv, hd
                                                                          ).transpose(1, 2)
            q = qk[:, :, :h].reshape(n, t, kv, g, hd).permute(0, 2, 3, 1, 4)  # (N, KV, G, T, hd)
            # 2. grouped-query attention over prefix, remainders and own keys
            att = self._attend(i, q.reshape(n, kv, g * t, hd), k[i, :, :, : start + t],
                               v[i, :, :, : start + t], bias, remainders)   # (N, KV, G*T, hd)
            att = att.view(n, kv, g, t, hd).permute(0, 3, 1, 2, 4).reshape(n, t, h * hd)
            x = _add_linear(x, att, w.o)
            # 3. SwiGLU MLP with the fused gate/up projection
            gate, up = F.linear(_rms_norm(w.post_norm, x), w.gate_up).chunk(2, dim=-1)
            x = _add_linear(x, F.silu(gate).mul_(up), w.down)
        return _rms_norm(m.norm, x)

    def _attend(self, i: int, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
                remainders: bool) -> Tensor:
        """Softmax attention of q (N, KV, M, hd), M = G*T query rows per KV head, over layer
        i's prefix keys (one matmul for all rows), remainder keys (one matmul per distinct
        prompt, over its rows' queries) and own keys k, v (N, KV, S, hd)."""
        n, kv, m, hd = q.shape
        k_pre, v_pre = self.k_prefix[i], self.v_prefix[i]                   # (KV, P, hd)
        p = k_pre.shape[1]
        d, w = (len(self.layout.remainders), self.layout.width) if remainders else (0, 0)
        own = q @ k.transpose(-1, -2)                                       # (N, KV, M, S)
        if bias is not None:
            t = bias.shape[1]
            own = (own.view(n, kv, m // t, t, -1) + bias[:, None, None]).view(n, kv, m, -1)
        scores = [own]
        if p:
            q_all = q.transpose(0, 1).reshape(kv, n * m, hd)                # (KV, N*M, hd)
            scores.insert(0, (q_all @ k_pre.transpose(-1, -2)).view(kv, n, m, p).transpose(0, 1))
        if d:
            q_grp = _to_groups(q, d)                                        # (D, KV, K*M, hd)
            s_rem = q_grp @ self.k_rem[i].transpose(-1, -2) + self.rem_bias[:, None, None]
            scores.insert(1 if p else 0, _from_groups(s_rem, n))            # (N, KV, M, W)
        probs = torch.cat(scores, dim=-1).softmax(-1) if len(scores) > 1 else own.softmax(-1)
        att = probs[..., p + w:] @ v                                        # (N, KV, M, hd)
        if p:
            pre = probs[..., :p].transpose(0, 1).reshape(kv, n * m, p) @ v_pre
            att += pre.view(kv, n, m, hd).transpose(0, 1)
        if d:
            att += _from_groups(_to_groups(probs[..., p: p + w], d) @ self.v_rem[i], n)
        return att

    def _head(self, hidden: Tensor, out: Tensor) -> Tensor:
        """Tempered logits (N, V) of last hidden states (N, D), into out, a vocabulary chunk at
        a time: a chunk's product stays in cache, which the full-width product does not."""
        hidden, weight = hidden * self.inv_temp, self.model.lm_head.weight
        chunk = torch.empty((hidden.shape[0], min(HEAD_CHUNK, weight.shape[0])),
                            device=hidden.device)
        for lo in range(0, weight.shape[0], HEAD_CHUNK):
            part = chunk[:, : min(HEAD_CHUNK, weight.shape[0] - lo)]
            out[:, lo: lo + part.shape[1]] = torch.mm(hidden, weight[lo: lo + part.shape[1]].t(),
                                                      out=part)
        return out

    # -- prefill -------------------------------------------------------------------------------
    def prefill(self) -> Tensor:
        lay, dev = self.layout, self.device
        n_p = len(lay.prefix)
        # 1. the shared prefix, once
        if n_p:
            k1, v1 = (torch.empty((len(self.layers), 1, self.n_kv, n_p, self.head_dim),
                                  device=dev) for _ in range(2))
            causal = torch.full((n_p, n_p), float("-inf"), device=dev).triu_(1)[None]
            self._forward(torch.tensor([lay.prefix], device=dev),
                          torch.arange(n_p, device=dev)[None], k1, v1, 0, causal,
                          remainders=False)
            self.k_prefix, self.v_prefix = k1[:, 0], v1[:, 0]
        # 2. each distinct remainder once, packed into sequences of about PACK_TOKENS tokens
        last = torch.empty((len(lay.remainders), self.model.config.hidden_size),
                           device=dev)                                                # (D, D_model)
        for group in _pack([len(r) for r in lay.remainders], PACK_TOKENS):
            self._prefill_packed(group, last)
        lengths = torch.tensor([len(r) for r in lay.remainders], device=dev)          # (D,)
        self.rem_bias.masked_fill_(
            torch.arange(lay.width, device=dev) < (lay.width - lengths)[:, None], float("-inf"))
        self.next_pos = (n_p + lengths).repeat_interleave(lay.group)                  # (B,)
        first = self._head(last, torch.empty(len(last), self.logits.shape[1],
                                             device=dev))                             # (D, V)
        rows = torch.arange(len(self.logits), device=dev) // lay.group
        return torch.index_select(first, 0, rows, out=self.logits)

    def _prefill_packed(self, group: Sequence[int], last: Tensor) -> None:
        """Run the remainders in group as one sequence, each attending to the prefix and to
        itself only; store their KV right-aligned and their last hidden state into last."""
        rems, dev = [self.layout.remainders[j] for j in group], self.device
        seg = torch.cat([torch.full((len(r),), i, device=dev) for i, r in enumerate(rems)])  # (T,)
        offset = torch.cat([torch.arange(len(r), device=dev) for r in rems])                 # (T,)
        allowed = (seg[:, None] == seg[None, :]) & (offset[None, :] <= offset[:, None])
        bias = torch.zeros(allowed.shape, device=dev).masked_fill_(~allowed, float("-inf"))[None]
        k1, v1 = (torch.empty((len(self.layers), 1, self.n_kv, len(seg), self.head_dim),
                              device=dev) for _ in range(2))
        ids = torch.tensor([[tok for r in rems for tok in r]], device=dev)
        positions = (len(self.layout.prefix) + offset)[None]
        hidden = self._forward(ids, positions, k1, v1, 0, bias, remainders=False)[0]  # (T, D)
        start, width = 0, self.layout.width
        for j, r in zip(group, rems):
            end = start + len(r)
            self.k_rem[:, j, :, width - len(r):] = k1[:, 0, :, start:end]
            self.v_rem[:, j, :, width - len(r):] = v1[:, 0, :, start:end]
            last[j] = hidden[end - 1]
            start = end

    # -- decode --------------------------------------------------------------------------------
    def step(self, tokens: Tensor) -> Tensor:
        """Append tokens (B,) at the next slot; returns the next tempered logits (B, V)."""
        s = self.next_slot
        hidden = self._forward(tokens[:, None], self.next_pos[:, None], self.k_gen, self.v_gen,
                               s, None, remainders=True)
        self.next_slot, self.next_pos = s + 1, self.next_pos + 1
        return self._head(hidden[:, -1], self.logits)


def _to_groups(x: Tensor, d: int) -> Tensor:
    """(N, KV, M, S) rows to (D, KV, K*M, S): each remainder's K consecutive rows together."""
    n, kv, m, s = x.shape
    return x.view(d, n // d, kv, m, s).transpose(1, 2).reshape(d, kv, n // d * m, s)


def _from_groups(x: Tensor, n: int) -> Tensor:
    """Inverse of _to_groups: (D, KV, K*M, S) to (N, KV, M, S)."""
    d, kv, km, s = x.shape
    return x.view(d, kv, n // d, km * d // n, s).transpose(1, 2).reshape(n, kv, km * d // n, s)


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
