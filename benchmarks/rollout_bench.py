"""Rollout sampling throughput: our sampler against plain `model.generate`, side by side.

    python -m benchmarks.rollout_bench [--model DIR] [--n-prompts 48] [--k 4] ...

Every side samples the same batch in one process: K samples of each of n_prompts train prompts
(chat-rendered as the rollout stage renders them, the K copies consecutive), batch_size rows
at a time, max_new_tokens new tokens, temperature 1, top-p 1 (the rollout defaults), fp32.
The sampler side is the rollout stage's own call (`sample_rollouts`); the generate sides are
transformers' `generate(do_sample=True, top_k=0)` on the same left-padded rows, once with its
default (dynamic) KV cache and once with `cache_implementation="static"` (preallocated: HF's
fastest stock setting without compiling the model), so the baseline is not a straw man. New
tokens count each response up to and including its EOS. With `repeats` > 1 the sides
alternate (sampler, generate, static, sampler, ...) and each side's fastest pass counts
(timeit's convention: the slower passes measured the machine's interference, not the code);
every pass's ratio is kept beside it, and the worst pass's ratio is reported too
(`*_worst_pass`). Finally every token the sampler stored is checked against a full fp32
forward pass of the policy (`lm.response_logprobs`).
Prints the result of `measure_rollout` as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tasks.config.params import GenerationParams, load_params
from tasks.data.records import Prompt, Rollout, parse_prompt
from tasks.models import lm
from tasks.models.generation import sample_rollouts
from tasks.runtime import stage
from tasks.stages.prompts import build_prompts, read_lines

ROOT = Path(__file__).resolve().parent.parent
TEMPERATURE, TOP_P = 1.0, 1.0       # the rollout stage's defaults (params/default.yaml)
CHECK_ROWS = 16                     # rows per full forward of the log-prob check


def train_prompts(n_prompts: int, seed: int) -> list[tuple[str, Prompt]]:
    """The first n_prompts train prompts the `prompts` stage would build from the default files."""
    p = load_params(ROOT / "params" / "default.yaml").prompts
    subjects, templates = read_lines(ROOT / p.subjects_file), read_lines(ROOT / p.templates_file)
    train, _ = build_prompts(subjects, templates, replace(p, n_train=n_prompts, n_heldout=0), seed)
    return [(rec["prompt_id"], parse_prompt(rec, f"train prompt {i}"))
            for i, rec in enumerate(train)]


def generate_new_tokens(model: torch.nn.Module, rows: Sequence[Sequence[int]], *,
                        batch_size: int, max_new_tokens: int, eos_id: int, pad_id: int,
                        cache: str | None = None) -> int:
    """Sample every row with plain `generate`; returns the new tokens produced (EOS included).
    `cache`: transformers' `cache_implementation` ("static": the KV cache preallocated once
    at its full length, HF's fastest stock setting without compilation), None its default
    dynamic cache."""
    extra = {"cache_implementation": cache} if cache else {}
    n = 0
    for start in range(0, len(rows), batch_size):
        batch = rows[start: start + batch_size]
        width = max(len(r) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in batch])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch])
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                             temperature=TEMPERATURE, top_p=TOP_P, top_k=0,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_id,
                             pad_token_id=pad_id, **extra)
        new = out[:, width:]                                            # (B, <= max_new)
        is_eos = (new == eos_id).long()
        before_eos = (is_eos.cumsum(-1) - is_eos) == 0                  # up to the first EOS
        n += int(before_eos.sum())
    return n


def logprob_max_abs_err(model: torch.nn.Module, rollouts: Sequence[Rollout], pad_id: int) -> float:
    """max |stored - full fp32 forward| over every sampled token."""
    err = 0.0
    with torch.no_grad():
        for start in range(0, len(rollouts), CHECK_ROWS):
            chunk = rollouts[start: start + CHECK_ROWS]
            ref, mask = lm.response_logprobs(model, [r.prompt_ids for r in chunk],
                                             [r.response_ids for r in chunk], pad_id, TEMPERATURE)
            stored = torch.zeros_like(ref)
            for i, r in enumerate(chunk):
                stored[i, : len(r.logprobs)] = torch.tensor(r.logprobs)
            err = max(err, float(((stored - ref).abs() * mask).max()))
    return err


def measure_rollout(model_dir: str | Path, n_prompts: int = 48, k: int = 4,
                    max_new_tokens: int = 40, batch_size: int = 192, seed: int = 0,
                    repeats: int = 1) -> dict[str, Any]:
    """New tokens/s of the rollout sampler and of plain `generate` on the same batch, their
    ratio, and the sampler's worst stored log-prob error against a full fp32 forward; with the
    torch thread count and the machine's 1-minute load average (the higher of before and
    after): on a shared machine a load above the core count makes both timings unreliable,
    `generate`'s most (its every op synchronises its threads)."""
    load_before = os.getloadavg()[0]
    model, tok = lm.load_causal_lm(model_dir), lm.load_tokenizer(model_dir)
    max_prompt_tokens = load_params(ROOT / "params" / "default.yaml").model.max_prompt_tokens
    prompts = train_prompts(n_prompts, seed)
    gen = GenerationParams(max_new_tokens=max_new_tokens, temperature=TEMPERATURE, top_p=TOP_P,
                           batch_size=batch_size)
    rows = [lm.render_prompt(tok, prompt, max_prompt_tokens) for _, prompt in prompts
            for _ in range(k)]                                  # as sample_rollouts lays out
    eos, pad = tok.eos_token_id, tok.pad_token_id

    # 0. warm both paths up (kernel selection, first-touch pages)
    sample_rollouts(model, tok, prompts[:2], 2, replace(gen, max_new_tokens=2, batch_size=4),
                    max_prompt_tokens, "bench", 0, torch.Generator().manual_seed(seed))
    for cache in (None, "static"):
        generate_new_tokens(model, rows[:4], batch_size=4, max_new_tokens=2, eos_id=eos,
                            pad_id=pad, cache=cache)

    sampler_runs, generate_runs, static_runs = [], [], []
    for _ in range(max(1, repeats)):
        # 1. the rollout stage's sampler
        t0 = time.perf_counter()
        rollouts = sample_rollouts(model, tok, prompts, k, gen, max_prompt_tokens, "bench", 0,
                                   torch.Generator().manual_seed(seed))
        sampler_runs.append(time.perf_counter() - t0)
        sampler_tokens = sum(len(r.response_ids) for r in rollouts)
        # 2. plain generate, same rows and settings
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.no_grad():
            generate_tokens = generate_new_tokens(model, rows, batch_size=batch_size,
                                                  max_new_tokens=max_new_tokens, eos_id=eos,
                                                  pad_id=pad)
        generate_runs.append(time.perf_counter() - t0)
        # 3. generate with a static KV cache, same rows and settings
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.no_grad():
            static_tokens = generate_new_tokens(model, rows, batch_size=batch_size,
                                                max_new_tokens=max_new_tokens, eos_id=eos,
                                                pad_id=pad, cache="static")
        static_runs.append(time.perf_counter() - t0)

    sampler_s, generate_s, static_s = min(sampler_runs), min(generate_runs), min(static_runs)
    sampler_tok_s, generate_tok_s = sampler_tokens / sampler_s, generate_tokens / generate_s
    static_tok_s = static_tokens / static_s
    per_pass = [(sampler_tokens / a) / (generate_tokens / b)
                for a, b in zip(sampler_runs, generate_runs)]
    per_pass_static = [(sampler_tokens / a) / (static_tokens / b)
                       for a, b in zip(sampler_runs, static_runs)]
    return {"sampler_tok_s": sampler_tok_s, "generate_tok_s": generate_tok_s,
            "generate_static_tok_s": static_tok_s,
            "rollout_speedup": sampler_tok_s / generate_tok_s,
            "rollout_speedup_worst_pass": min(per_pass),
            "rollout_speedup_vs_static": sampler_tok_s / static_tok_s,
            "rollout_speedup_vs_static_worst_pass": min(per_pass_static),
            "logprob_max_abs_err": logprob_max_abs_err(model, rollouts, pad),
            "sampler_s": sampler_s, "generate_s": generate_s, "repeats": len(sampler_runs),
            "static_s": static_s, "sampler_s_all": sampler_runs,
            "generate_s_all": generate_runs, "static_s_all": static_runs,
            "speedup_per_pass": per_pass, "speedup_vs_static_per_pass": per_pass_static,
            "threads": torch.get_num_threads(),
            "load_1min": max(load_before, os.getloadavg()[0])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/smol", help="a saved transformers model directory")
    ap.add_argument("--n-prompts", type=int, default=48)
    ap.add_argument("--k", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="alternating passes per side")
    a = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get(stage.THREADS_ENV, os.cpu_count() or 1)))
    print(json.dumps(measure_rollout(a.model, a.n_prompts, a.k, a.max_new_tokens, a.batch_size,
                                     a.seed, a.repeats), indent=1))


if __name__ == "__main__":
    main()
