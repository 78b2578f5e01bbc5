"""Rollout throughput on 1 process (no Ray) against 2 Ray workers, side by side.

    python -m benchmarks.ray_scaling [--model DIR] [--n-prompts 48] [--k 4] ...

Both sides run the rollout stage's own call (`sample_rollouts`) on the same prompts (the first
n_prompts train prompts, K samples each), settings and seed: once with `workers: 1` (this
process, its torch threads) and once with `workers: 2` (two Ray actors, each loading the
policy from DIR). The Ray side runs on a local cluster started here first (its start-up is
timed on its own, as every stage with workers > 1 pays it when RAY_ADDRESS is unset); its time
includes what each call pays: starting the actors and their model loads; a third figure times
the same shards on 2 actors that already hold the model (the workers' own throughput). The two
sides' rollouts are compared byte for byte. Without --model a tiny random model (the tiny profile's)
is built in a temp dir. Prints JSON: samples/s of each side, their ratio, Ray start-up
seconds, the byte-identity check, thread count and the 1-minute load average.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.rollout_bench import train_prompts
from tasks.config.params import GenerationParams, TinyModelParams, load_params
from tasks.models import lm, sampling
from tasks.models.generation import sample_rollouts
from tasks.models.tiny_model import save_tiny
from tasks.runtime import ray_pool, stage

REPO = Path(__file__).resolve().parent.parent


def timed_rollouts(model_dir: Path, prompts: list, k: int, gen: GenerationParams,
                   workers: int, seed: int) -> tuple[float, bytes]:
    """Seconds of one `sample_rollouts` call and its rollouts as JSONL bytes."""
    model, tok = lm.load_causal_lm(model_dir), lm.load_tokenizer(model_dir)
    t0 = time.perf_counter()
    max_prompt_tokens = load_params(REPO / "params" / "tiny.yaml").model.max_prompt_tokens
    rollouts = sample_rollouts(model, tok, prompts, k, gen, max_prompt_tokens, "bench", 1,
                               torch.Generator().manual_seed(seed), workers, model_dir)
    seconds = time.perf_counter() - t0
    return seconds, "".join(json.dumps(r.to_record()) + "\n" for r in rollouts).encode()


def warm_workers_s(model_dir: Path, prompts: list, k: int, gen: GenerationParams,
                   seed: int) -> float:
    """Seconds of the same sampling on 2 Ray actors that already hold the model (started and
    warmed up on one shard first): the workers' own throughput, without their start-up."""
    import ray
    from ray.util import ActorPool
    tok = lm.load_tokenizer(model_dir)
    max_prompt_tokens = load_params(REPO / "params" / "tiny.yaml").model.max_prompt_tokens
    ids = [lm.render_prompt(tok, prompt, max_prompt_tokens) for _, prompt in prompts]
    shards = sampling.plan([i for i in ids for _ in range(k)], batch_size=gen.batch_size,
                           max_new_tokens=gen.max_new_tokens,
                           generator=torch.Generator().manual_seed(seed),
                           threads=torch.get_num_threads())
    actor = ray.remote(num_cpus=1)(sampling.ShardSampler)
    actors = [actor.remote(str(model_dir), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                           temperature=gen.temperature, top_p=gen.top_p,
                           max_new_tokens=gen.max_new_tokens) for _ in range(2)]
    ray.get([a.run.remote(shards[0]) for a in actors])
    t0 = time.perf_counter()
    list(ActorPool(actors).map(lambda a, shard: a.run.remote(shard), shards))
    return time.perf_counter() - t0


def measure(model_dir: Path, n_prompts: int, k: int, max_new_tokens: int, batch_size: int,
            seed: int) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    prompts = train_prompts(n_prompts, seed)
    gen = GenerationParams(max_new_tokens=max_new_tokens, batch_size=batch_size)
    one_s, one = timed_rollouts(model_dir, prompts, k, gen, 1, seed)
    os.environ.pop(ray_pool.ADDRESS_ENV, None)
    t0 = time.perf_counter()
    with ray_pool.cluster(2):
        start_s = time.perf_counter() - t0
        two_s, two = timed_rollouts(model_dir, prompts, k, gen, 2, seed)
        warm_s = warm_workers_s(model_dir, prompts, k, gen, seed)
    n = n_prompts * k
    return {"samples": n, "one_process_samples_s": n / one_s, "two_workers_samples_s": n / two_s,
            "ratio_two_over_one": one_s / two_s, "ray_startup_s": start_s,
            "two_warm_workers_samples_s": n / warm_s, "ratio_warm_two_over_one": one_s / warm_s,
            "two_workers_with_startup_samples_s": n / (two_s + start_s),
            "one_process_s": one_s, "two_workers_s": two_s, "byte_identical": one == two,
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "load_1min": max(load_before, os.getloadavg()[0])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a saved transformers model directory "
                    "(default: the tiny profile's random model, built in a temp dir)")
    ap.add_argument("--n-prompts", type=int, default=48)
    ap.add_argument("--k", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get(stage.THREADS_ENV, os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(a.model) if a.model else Path(tmp) / "tiny"
        if not a.model:
            model_dir.mkdir()
            save_tiny(TinyModelParams(), 0, model_dir)
        result = measure(model_dir, a.n_prompts, a.k, a.max_new_tokens, a.batch_size, a.seed)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
