"""Batched autoregressive sampling with a KV cache that records the sampler's log-probs.

The log-prob stored for each token is that of the distribution it was actually drawn from
(temperature and top-p applied), i.e. the behaviour policy's probability: exactly what PPO's
ratio pi_theta / pi_old and any later importance weighting need.

Plain fp32 Llama models go through `tasks.models.fast_llama` (static KV cache, shared-prefix
prefill); any other model through its own transformers forward with a cache. Both feed the same
exact sampler: an inverse-CDF draw at one uniform per row and step, all taken from the passed
generator before a batch starts, so that a row's sample depends only on its prompt and its uniforms.
That lets a batch be split into one shard per torch thread, sampled side by side with
single-threaded ops (data parallelism instead of intra-op parallelism).
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from tasks.core import progress
from tasks.models import fast_llama, lm

BLOCK = 256             # vocabulary block of the two-level inverse CDF
MIN_SHARD_ROWS = 4      # rows below which a batch is not split across threads


@dataclass(frozen=True)
class Sample:
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finished: bool          # ended with EOS (included in response_ids) rather than truncated


# -- the exact sampler ---------------------------------------------------------------------------
def first_above(cdf: Tensor, target: Tensor) -> Tensor:
    """Per row, the first index with cdf > target, capped at the last index holding mass (so
    that a target rounded past the total never lands on a zero-probability entry).
    cdf: (B, N) non-decreasing; target: (B,). Returns (B,) long."""
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    last = (cdf < cdf[:, -1:]).sum(-1)                   # first index reaching the total
    return torch.minimum(idx, last)


def _draw_full(logits: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse-CDF draw from softmax(logits), in two levels: pick a block of BLOCK tokens by
    its mass, then the token inside it, both cumulated in fp64. logits: (B, V), overwritten."""
    b, v = logits.shape
    e = logits.sub_(logits.amax(-1, keepdim=True)).exp_()          # (B, V) p * Z, max 1
    full = v // BLOCK * BLOCK
    mass = e[:, :full].view(b, -1, BLOCK).sum(-1)                   # (B, V // BLOCK)
    if full < v:
        mass = torch.cat([mass, e[:, full:].sum(-1, keepdim=True)], dim=-1)
    mass = mass.double()
    cdf = mass.cumsum(-1)
    z = cdf[:, -1]                                                  # (B,) normaliser
    target = u * z                                                  # u ~ U[0, 1)
    blk = first_above(cdf, target)
    rest = target - (cdf.gather(1, blk[:, None]) - mass.gather(1, blk[:, None])).squeeze(-1)
    cols = blk[:, None] * BLOCK + torch.arange(BLOCK, device=blk.device)   # (B, BLOCK)
    inside = e.gather(1, cols.clamp(max=v - 1)).double().masked_fill_(cols >= v, 0.0)
    tok = blk * BLOCK + first_above(inside.cumsum(-1), rest)
    logp = e.gather(1, tok[:, None]).squeeze(-1).double().log() - z.log()   # log p(tok)
    return tok, logp.float()


def _draw_nucleus(logits: Tensor, top_p: float, u: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse-CDF draw from the top-p nucleus: the smallest set of most probable tokens with
    mass >= top_p, renormalised. logits: (B, V), overwritten."""
    e = logits.sub_(logits.amax(-1, keepdim=True)).exp_()          # (B, V) p * Z
    p_sorted, order = e.sort(dim=-1, descending=True)
    cdf = p_sorted.double().cumsum(-1)                              # (B, V)
    before = cdf - p_sorted                                         # mass ranked above
    n_keep = (before <= top_p * cdf[:, -1:]).sum(-1)                # >= 1: before[0] = 0
    z = cdf.gather(1, (n_keep - 1)[:, None]).squeeze(-1)            # nucleus mass
    j = torch.minimum(first_above(cdf, u * z), n_keep - 1)
    tok = order.gather(1, j[:, None]).squeeze(-1)
    logp = p_sorted.gather(1, j[:, None]).squeeze(-1).double().log() - z.log()
    return tok, logp.float()


def draw(logits: Tensor, top_p: float, u: Tensor) -> tuple[Tensor, Tensor]:
    """One sample per row from softmax(logits), restricted to the top-p nucleus when top_p < 1,
    and its log-prob under that distribution, by inverse CDF at u ~ U[0, 1): exact up to the
    rounding of the fp32 probabilities, as torch.multinomial is. logits: (B, V) tempered fp32,
    which this overwrites; u: (B,) fp64. Returns (B,), (B,)."""
    if top_p < 1.0:
        return _draw_nucleus(logits, top_p, u)
    return _draw_full(logits, u)


# -- decoders: tempered next-token logits for a batch --------------------------------------------
class Decoder(Protocol):
    def prefill(self) -> Tensor: ...                  # (B, V) logits of the first token
    def step(self, tokens: Tensor) -> Tensor: ...     # tokens (B,) -> next (B, V) logits


class HFDecoder:
    """Any causal LM through its own forward: left-padded prompts, positions from the mask."""

    def __init__(self, model: torch.nn.Module, prompts: Sequence[Sequence[int]], *,
                 pad_id: int, temperature: float):
        b, width = len(prompts), max(len(p) for p in prompts)
        self.model, self.temperature, self.cache = model, temperature, None
        ids = torch.full((b, width), pad_id, dtype=torch.long)   # cpu: host rows, copied once
        mask = torch.zeros((b, width), dtype=torch.long)          # cpu: host rows, copied once
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)  # cpu: host rows, one copy
            mask[i, width - len(p):] = 1
        device = lm.device_of(model)
        self.ids, self.mask = ids.to(device), mask.to(device)
        accepts = inspect.signature(model.forward).parameters
        self.last_only = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}
        self.next_pos = self.mask.sum(-1)                                  # (B,)

    def _logits(self, ids: Tensor, positions: Tensor) -> Tensor:
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions,
                         cache=self.cache, use_cache=True, **self.last_only)
        self.cache = out.cache
        return out.logits[:, -1].float() / self.temperature                # (B, V)

    def prefill(self) -> Tensor:
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)                # (B, T)
        return self._logits(self.ids, positions)

    def step(self, tokens: Tensor) -> Tensor:
        self.mask = torch.cat([self.mask, torch.ones((len(tokens), 1), dtype=torch.long,
                                                     device=tokens.device)], 1)
        logits = self._logits(tokens[:, None], self.next_pos[:, None])
        self.next_pos = self.next_pos + 1
        return logits


# -- the sampling loop ---------------------------------------------------------------------------
def decoders(model: torch.nn.Module, *, pad_id: int, temperature: float,
              max_new_tokens: int) -> Callable[[Sequence[Sequence[int]]], Decoder]:
    """A maker of one batch's decoder; the fast Llama path reads fused weights built here."""
    if fast_llama.supports(model):
        weights = fast_llama.LlamaWeights(model)
        return lambda prompts: fast_llama.LlamaDecoder(
            weights, prompts, pad_id=pad_id, temperature=temperature,
            max_new_tokens=max_new_tokens)
    return lambda prompts: HFDecoder(model, prompts, pad_id=pad_id, temperature=temperature)


@torch.inference_mode()    # grad mode is per thread: the shard workers need it set here
def sample_rows(dec: Decoder, u: Tensor, *, eos_id: int, pad_id: int,
                 top_p: float) -> list[Sample]:
    """Draw one response per row of the decoder, step t at uniforms u[:, t] (B, T); stops at
    EOS (kept) or after T tokens. u is drawn on the CPU (the seeded generator's draws are the
    same on every device) and copied to the decoder's device once."""
    b, max_new_tokens = u.shape
    logits = dec.prefill()
    device = logits.device
    u = u.to(device)
    tokens = torch.zeros((b, max_new_tokens), dtype=torch.long, device=device)
    logps = torch.zeros((b, max_new_tokens), device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.full((b,), max_new_tokens, dtype=torch.long, device=device)
    for t in range(max_new_tokens):
        # 1. an exact draw from the tempered (and nucleus-filtered) distribution
        tok, logp = draw(logits, top_p, u[:, t])
        tok = tok.masked_fill(done, pad_id)
        # 2. record token and the behaviour log-prob
        tokens[:, t] = tok
        logps[:, t] = logp.masked_fill(done, 0.0)
        newly = (~done) & (tok == eos_id)
        lengths = torch.where(newly, torch.full_like(lengths, t + 1), lengths)
        done |= newly
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        # 3. one cached decoding step
        logits = dec.step(tok)
    samples = []
    tokens, logps, lengths = tokens.cpu(), logps.cpu(), lengths.cpu()   # read back once
    for i in range(b):
        n = int(lengths[i])
        ids_i = tuple(int(x) for x in tokens[i, :n])
        finished = bool(n > 0 and ids_i[-1] == eos_id)
        samples.append(Sample(ids_i, tuple(float(x) for x in logps[i, :n]), finished))
    return samples


@contextmanager
def _single_threaded_ops() -> Iterator[None]:
    """Torch ops run on one thread each inside the block (the count is restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _sample_sharded(make: Callable[[Sequence[Sequence[int]]], Decoder],
                    prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_id: int,
                    pad_id: int, top_p: float, generator: torch.Generator) -> list[Sample]:
    """One batch: the uniforms of every row and step are drawn up front, then the rows are
    split into one contiguous shard per torch thread, each sampled on its own core with
    single-threaded ops. A row's sample depends only on its prompt and its uniforms, so the
    split does not change what is drawn; it replaces intra-op parallelism, whose per-op
    synchronisation dominates at these matrix sizes, by data parallelism."""
    u = batch_uniforms(len(prompts), max_new_tokens, generator)                     # (B, T)
    shards = thread_shards(prompts, torch.get_num_threads())

    def run(rows: slice) -> list[Sample]:
        return sample_rows(make(prompts[rows]), u[rows], eos_id=eos_id, pad_id=pad_id,
                            top_p=top_p)

    if len(shards) == 1:
        return run(shards[0])
    with _single_threaded_ops(), ThreadPoolExecutor(len(shards)) as pool:
        return [s for part in pool.map(run, shards) for s in part]


def batch_uniforms(b: int, max_new_tokens: int, generator: torch.Generator) -> Tensor:
    """The uniforms of one batch, one per row and step, in row order: (B, T) fp64, on the CPU
    with the CPU generator on every device (sample_rows copies them to the model's)."""
    return torch.rand((b, max_new_tokens), generator=generator,  # cpu: the seeded draws
                      dtype=torch.float64)


def thread_shards(prompts: Sequence[Sequence[int]], threads: int) -> list[slice]:
    """One batch's rows as contiguous shards, one per thread (at most), each at least
    MIN_SHARD_ROWS rows, boundaries only between runs of equal prompts. A row's tokens do not
    depend on its shard (tests/test_sampling.py), but the last bits of its log-probs may: the
    shard's shared prefix, its matrix shapes and the threads its ops run on change the
    rounding. So whoever samples a batch elsewhere (Ray workers: `plan`, `sample_on_workers`)
    samples exactly these shards on the same threads."""
    b = len(prompts)
    n = max(1, min(threads, b // MIN_SHARD_ROWS))
    bounds = [_run_start(prompts, b * i // n) for i in range(n + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


@dataclass(frozen=True)
class Shard:
    """One thread shard of one batch as `sample` samples it: its rows' prompts, their uniforms
    (R, T) fp64, and the torch threads its ops run on (1 when its batch is split, else all)."""
    prompts: tuple[tuple[int, ...], ...]
    u: Tensor
    threads: int


def plan(prompts: Sequence[Sequence[int]], *, batch_size: int, max_new_tokens: int,
         generator: torch.Generator, threads: int) -> list[Shard]:
    """`sample`'s work as shards in row order, drawing the generator exactly as it does, for a
    process with `threads` torch threads: sampling each shard anywhere (`sample_shard`) and
    concatenating gives `sample`'s result bit for bit."""
    out = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start: start + batch_size]
        u = batch_uniforms(len(batch), max_new_tokens, generator)                 # (B, T)
        shards = thread_shards(batch, threads)
        ops = threads if len(shards) == 1 else 1
        out += [Shard(tuple(tuple(p) for p in batch[s]), u[s].clone(), ops) for s in shards]
    return out


def sample_shard(make: Callable[[Sequence[Sequence[int]]], Decoder], shard: Shard, *,
                 eos_id: int, pad_id: int, top_p: float) -> list[Sample]:
    """One shard of a `plan`, with the decoders of `decoders(...)`, on the shard's threads."""
    n = torch.get_num_threads()
    torch.set_num_threads(shard.threads)
    try:
        return sample_rows(make(shard.prompts), shard.u, eos_id=eos_id, pad_id=pad_id,
                           top_p=top_p)
    finally:
        torch.set_num_threads(n)


def _run_start(prompts: Sequence[Sequence[int]], i: int) -> int:
    """The first index at or after i that starts a run of equal consecutive prompts (so that a
    shard boundary keeps the K samples of a prompt together)."""
    while 0 < i < len(prompts) and prompts[i] == prompts[i - 1]:
        i += 1
    return i


@torch.no_grad()
def sample_batch(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 eos_id: int, pad_id: int, temperature: float, top_p: float,
                 generator: torch.Generator) -> list[Sample]:
    """Sample one response per prompt, all in one batch."""
    make = decoders(model, pad_id=pad_id, temperature=temperature,
                     max_new_tokens=max_new_tokens)
    return _sample_sharded(make, prompts, max_new_tokens=max_new_tokens, eos_id=eos_id,
                           pad_id=pad_id, top_p=top_p, generator=generator)


@torch.no_grad()
def sample(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, batch_size: int,
           max_new_tokens: int, eos_id: int, pad_id: int, temperature: float, top_p: float,
           generator: torch.Generator) -> list[Sample]:
    """Sample one response per prompt, in batches of batch_size (order preserved). Repeated
    prompts in a batch (K samples of one prompt) share their prompt computation."""
    make = decoders(model, pad_id=pad_id, temperature=temperature,
                     max_new_tokens=max_new_tokens)
    out: list[Sample] = []
    with progress.track(len(prompts), "samples", "tokens") as pg:
        for start in range(0, len(prompts), batch_size):
            batch = _sample_sharded(make, prompts[start: start + batch_size],
                                    max_new_tokens=max_new_tokens, eos_id=eos_id,
                                    pad_id=pad_id, top_p=top_p, generator=generator)
            out.extend(batch)
            pg.step(len(batch), work=sum(len(s.response_ids) for s in batch))
    return out


# -- on Ray workers (rollout.workers, evaluate.workers > 1) -------------------------------------
class ShardSampler:
    """A Ray actor: one replica of the policy, loaded from its directory, sampling shards."""

    def __init__(self, policy_dir: str, *, pad_id: int, eos_id: int, temperature: float,
                 top_p: float, max_new_tokens: int, root: str | None = None):
        # root given: the caller (rollout, evaluate: stages that import tasks.models.adapters
        # and declare it) may pass a LoRA adapter, loaded merged; the others load full models
        model = importlib.import_module("tasks.models.adapters").load_for_inference(
            policy_dir, root) if root is not None else lm.load_causal_lm(policy_dir)
        self.make = decoders(model, pad_id=pad_id, temperature=temperature,
                             max_new_tokens=max_new_tokens)
        self.pad_id, self.eos_id, self.top_p = pad_id, eos_id, top_p

    def run(self, shard: Shard) -> list[Sample]:
        return sample_shard(self.make, shard, eos_id=self.eos_id, pad_id=self.pad_id,
                            top_p=self.top_p)


def sample_on_workers(policy_dir: Path, prompts: Sequence[Sequence[int]], workers: int, *,
                      batch_size: int, max_new_tokens: int, eos_id: int, pad_id: int,
                      temperature: float, top_p: float, generator: torch.Generator,
                      root: Path | None = None) -> list[Sample]:
    """`sample` of the model in policy_dir (a LoRA adapter's base under the workspace `root`)
    on `workers` Ray actors (tasks.runtime.ray_pool), each
    sampling whole shards of `plan`: the shards this process would sample on its own threads,
    so the same samples bit for bit, in prompt order."""
    from tasks.runtime import ray_pool  # only here: nothing imports Ray otherwise
    shards = plan(prompts, batch_size=batch_size, max_new_tokens=max_new_tokens,
                  generator=generator, threads=torch.get_num_threads())
    init = {"policy_dir": str(policy_dir), "pad_id": pad_id, "eos_id": eos_id,
            "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
            "root": str(root) if root is not None else None}
    out: list[Sample] = []
    with ray_pool.cluster(workers), progress.track(len(prompts), "samples", "tokens") as pg:
        for part in ray_pool.map_actors(ShardSampler, init, shards, workers):
            out.extend(part)
            pg.step(len(part), work=sum(len(s.response_ids) for s in part))
    return out
