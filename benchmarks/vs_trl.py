"""Our DPO and reward-model updates against TRL's DPOTrainer and RewardTrainer, in one run.

    python -m benchmarks.vs_trl [--model DIR] [--kinds dpo,rm,ppo] [--pairs 48] [--repeats 3]
                                [--precisions fp32,bf16] [--heap stage|stock]

TRL is a benchmark-only dependency (`pip install -e '.[bench]'`: trl==1.16.0); without it the
section reports itself skipped. Both sides get the same model (the converted default model, or
--model), the same pairs as token ids, the same batches in the same order and the same
hyperparameters (params/default.yaml's update.dpo / train_rm), the same precision on both
sides, fp32 and bf16 autocast each measured side by side (`--precisions`):
- pairs: `common.build_pairs`, deterministic: the default train prompts chat-rendered as the stages
  render them, chosen = hand-written review sentences, rejected = hand-written correspondence
  sentences (params/gold/register_examples.jsonl), each response cut to RESPONSE_TOKENS ids.
- order: ours draws each epoch's order from its rng (`train_dpo`: randperm; `train_reward`:
  `prompt_batches`); TRL's train sampler is replaced by one that yields exactly those orders
  (`trl_side._FixedOrder`), its dataset otherwise unshuffled.
- optimiser: AdamW (torch's, betas 0.9/0.999, eps 1e-8, our weight decay), constant learning
  rate, no warm-up, no gradient clipping (ours clips nothing: TRL's max_grad_norm=0), batch =
  ours, gradient accumulation 1; TRL at its fastest CPU settings: gradient checkpointing off,
  reference log-probs precomputed (`precompute_ref_log_probs`), no reporting, no saving.
- timing: only training, model loading excluded. Ours: the whole `train_dpo` / `train_reward`
  call (the DPO reference pass included). TRL: `train()` plus, for DPO, its reference-log-prob
  precompute (which it runs inside the trainer's constructor): the reference pass counted on
  both sides. The rest of TRL's constructor (accelerator set-up, a hash of the model's
  weights for its precompute cache) is not counted. Sides alternate (ours, trl, ours, ...)
  `--repeats` times; the fastest and the median of each are reported.
- heap: glibc's malloc settings are the process's, so both sides alike: by default the ones
  our stage processes run with (`--heap stage`, tasks/core/heap.py: freed tensor memory reused, not
  unmapped and faulted in again), or glibc's defaults (`--heap stock`); the program starts
  itself again with them when its environment does not hold them (`glibc_tunables` in the
  result). TRL gains more from them than ours (its full-sequence logits are larger).
- losses: ours from the per-step loss file `train_dpo` / `train_reward` write when
  ALIGNLOOP_STEP_LOSSES is set, TRL's from its `compute_loss` each step; the largest absolute
  per-step difference over all repeats is reported (both are deterministic on CPU, so repeats
  agree with themselves).

Settings that differ from the default profile, and why (they are the same on both sides):
- precision (profile: auto = bf16 autocast on this CPU): fp32, and bf16 where TRL runs the
  Trainer's mixed precision (`bf16=True`), which on the CPU is torch.autocast with the weights
  in fp32, as ours (`trl_side._check_precision` asserts both). bf16's per-step losses are
  compared with the same side's fp32 losses (`bf16_deviation`: the stated tolerance).
- DPO without the SFT anchor (profile: sft_weight 1, RPO): TRL 1.16 has no rpo_alpha; its
  `sft` loss term averages the NLL over all chosen tokens of a batch, ours per pair then over
  pairs, so the two differ whenever lengths differ. The term is one extra sum over log-probs
  the forward pass already has, so it does not move the speed.
- RM: pooling `last` (profile: mean; TRL reads the last token only), head drawn at random from
  the same seed on both sides (profile: probe-fitted; TRL has no probe), 1 epoch (profile: 0,
  the probe alone), the profile's 12 backbone blocks kept on both sides (the same model object
  type, copied), every weight trained (profile: the embeddings kept; TRL's trainer trains
  them). Responses end without EOS, as most sampled ones (cut at max_new_tokens) do:
  with EOS = pad, HF's sequence-classification read-out would take the token before EOS.

PPO: TRL 1.16 ships no PPO trainer (the wheel has no ppo module): it moved to trl.experimental
in v1.10 (huggingface/trl#4482), the old import went in #5051 and the experimental trainer in
#7020, after 1.12. So the `ppo` kind runs benchmarks/trl_ppo.py: our PPO update against TRL
1.12.0's `trl.experimental.ppo.PPOTrainer` on the same rollouts (n_pairs // 8 prompts x 8
responses), each side in its own process (that TRL installed apart, in benchmarks/.cache; its
docstring states what differs). Where that TRL cannot be installed, ours is reported alone
(`ppo_section`: rollouts/s, tokens/s and GFLOP/s in benchmarks/train_bench.py's convention).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import isolation
from benchmarks.common import RESPONSE_TOKENS, build_pairs, ensure_model, log
from benchmarks.trl_side import trl_dpo, trl_rm
from tasks.config.params import DPOParams, Params, TrainRMParams, load_params
from tasks.core import heap
from tasks.models import lm
from tasks.reward.features import EncodedPair
from tasks.reward.reward_model import prompt_batches
from tasks.runtime.distributed import LOSSES_ENV

ROOT = Path(__file__).resolve().parent.parent

TRL_VERSION = "1.16.0"


def trl_version() -> str | None:
    """The installed TRL's version, or None when it is not installed."""
    try:
        import trl
    except ImportError:
        return None
    return str(trl.__version__)


# 1. batch orders (the pairs: common.build_pairs) --------------------------------------------

def dpo_orders(n: int, epochs: int, seed: int) -> list[list[int]]:
    """The pair order of each epoch of `train_dpo` with rng seeded `seed`."""
    rng = torch.Generator().manual_seed(seed)
    return [torch.randperm(n, generator=rng).tolist() for _ in range(epochs)]


def rm_orders(pairs: Sequence[EncodedPair], epochs: int, seed: int) -> list[list[int]]:
    """The pair order of each epoch of `train_reward` with rng seeded `seed` (prompt_batches)."""
    rng = torch.Generator().manual_seed(seed)
    at = {id(e): i for i, e in enumerate(pairs)}
    return [[at[id(e)] for batch in prompt_batches(pairs, len(pairs), rng) for e in batch]
            for _ in range(epochs)]


def pair_tokens(pairs: Sequence[EncodedPair]) -> int:
    """Real tokens of one pass over the pairs, counted as two sequences per pair
    (prompt + chosen, prompt + rejected) on both sides, whether a side packs them or not."""
    return sum(2 * len(e.prompt_ids) + len(e.chosen_ids) + len(e.rejected_ids) for e in pairs)


@dataclass(frozen=True)
class Side:
    seconds: float
    losses: list[float]


# 2. our side: the stages' own training functions ------------------------------------------

def _ours(train: Callable[[], Any]) -> Side:
    """Run one of our training calls with its per-step loss file (tasks/runtime/distributed.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "losses.json"
        old = os.environ.get(LOSSES_ENV)
        os.environ[LOSSES_ENV] = str(path)
        try:
            t0 = time.perf_counter()
            train()
            seconds = time.perf_counter() - t0
        finally:
            os.environ.pop(LOSSES_ENV) if old is None else os.environ.update({LOSSES_ENV: old})
        return Side(seconds, [float(x) for x in json.loads(path.read_text())["losses"]])


def ours_dpo(model_dir: Path, pairs: Sequence[EncodedPair], p: DPOParams, pad: int,
             seed: int) -> Side:
    from tasks.policy.dpo import train_dpo
    policy, ref = lm.load_causal_lm(model_dir), lm.load_causal_lm(model_dir)
    for w in ref.parameters():
        w.requires_grad_(False)
    return _ours(lambda: train_dpo(policy, ref, pairs, p=p, pad_id=pad,
                                   rng=torch.Generator().manual_seed(seed)))


def rm_model(model_dir: Path, p: TrainRMParams) -> Any:
    """The reward model both sides start from: the profile's blocks, the head from seed 0."""
    from tasks.reward.reward_model import init_reward_model
    return init_reward_model(model_dir, torch.Generator().manual_seed(0), p.num_layers)


def ours_rm(model_dir: Path, pairs: Sequence[EncodedPair], p: TrainRMParams, pad: int,
            seed: int) -> Side:
    from tasks.reward.reward_model import train_reward
    model = rm_model(model_dir, p)
    return _ours(lambda: train_reward(model, pairs, p, pad, torch.Generator().manual_seed(seed)))


# 3. both sides alternating (TRL's: benchmarks/trl_side.py), summarised ------------------

def _rates(runs: Sequence[Side], pairs_per_run: int, tokens_per_run: int) -> dict[str, Any]:
    secs = [r.seconds for r in runs]
    best, median = min(secs), statistics.median(secs)
    return {"seconds": [round(s, 2) for s in secs], "fastest_s": round(best, 2),
            "median_s": round(median, 2), "pairs_per_s": round(pairs_per_run / best, 3),
            "pairs_per_s_median": round(pairs_per_run / median, 3),
            "tokens_per_s": round(tokens_per_run / best, 1), "losses": runs[0].losses}


def compare(run_ours: Callable[[], Side], run_trl: Callable[[], Side], repeats: int,
            pairs_per_run: int, tokens_per_run: int,
            log: Callable[[str], None] = print, name: str = "") -> dict[str, Any]:
    """ours, trl, ours, trl, ... `repeats` times each; rates of the fastest and median run and
    the largest per-step loss difference over all pairs of runs."""
    ours, trl = [], []
    for i in range(repeats):
        ours.append(run_ours())
        trl.append(run_trl())
        log(f"vs_trl {name} pass {i + 1}/{repeats}: ours {ours[-1].seconds:.1f} s, "
            f"trl {trl[-1].seconds:.1f} s")
    diffs = [abs(a - b) for o, t in zip(ours, trl) for a, b in zip(o.losses, t.losses)]
    same_steps = all(len(o.losses) == len(t.losses) for o, t in zip(ours, trl))
    a, b = _rates(ours, pairs_per_run, tokens_per_run), _rates(trl, pairs_per_run, tokens_per_run)
    return {"ours": a, "trl": b, "repeats": repeats, "steps": len(ours[0].losses),
            "same_steps": same_steps,
            "ratio": round(a["pairs_per_s"] / b["pairs_per_s"], 3),
            "ratio_median": round(a["pairs_per_s_median"] / b["pairs_per_s_median"], 3),
            "loss_max_abs_diff": max(diffs) if diffs and same_steps else None}


def settings(params: Params, kind: str, epochs: int | None,
             precision: str = "fp32") -> tuple[Any, dict[str, Any]]:
    """The params one update runs with here, and what was changed from the profile."""
    if kind == "dpo":
        base = params.update.dpo
        p = replace(base, precision=precision, sft_weight=0.0, epochs=epochs or base.epochs)
        return p, {"loss": p.loss, "beta": p.beta, "lr": p.lr, "batch_size": p.batch_size,
                   "epochs": p.epochs, "max_length": params.update.max_length,
                   "precision": precision,
                   "changed": {"precision": f"{base.precision} -> {precision}",
                               "sft_weight": f"{base.sft_weight} -> 0 (TRL: no rpo_alpha)"}}
    base = params.train_rm
    p = replace(base, precision=precision, pooling="last", head_init="random",
                freeze_embeddings=False, epochs=epochs or max(base.epochs, 1))
    return p, {"lr": p.lr, "batch_size": p.batch_size, "epochs": p.epochs,
               "weight_decay": p.weight_decay, "margin": p.margin, "num_layers": p.num_layers,
               "max_length": p.max_length, "precision": precision,
               "changed": {"precision": f"{base.precision} -> {precision}",
                           "pooling": f"{base.pooling} -> last (TRL's read-out)",
                           "head_init": f"{base.head_init} -> random, seed 0 on both sides",
                           "freeze_embeddings": f"{base.freeze_embeddings} -> False (TRL "
                                                "trains every weight)",
                           "epochs": f"{base.epochs} -> {p.epochs}"}}


def ppo_section(model_dir: Path, params: Params, pairs: Sequence[EncodedPair],
                epochs: int | None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Our PPO update alone (no TRL counterpart: module docstring) on one rollout per pair (its
    chosen response, pi_old = the policy's own log-probs), through train_bench.bench_ppo."""
    from benchmarks.train_bench import bench_ppo
    from tasks.data.records import Rollout
    from tasks.schemas.generation import GenerationParams
    model = lm.load_causal_lm(model_dir)
    pad = lm.load_tokenizer(model_dir).pad_token_id
    with torch.no_grad():
        logp, mask = lm.response_logprobs(model, [e.prompt_ids for e in pairs],
                                          [e.chosen_ids for e in pairs], pad)       # (B, R)
    rollouts = []
    for i, e in enumerate(pairs):
        one = Rollout(f"bench-{i}", (), e.prompt_ids, e.chosen_ids,
                      tuple(logp[i, : len(e.chosen_ids)].tolist()), False, "", "bench", 1,
                      GenerationParams(temperature=1.0))
        rollouts += [one, one]                      # bench_ppo takes every second sample
    base = params.update.ppo
    p = replace(base, epochs=epochs or base.epochs)
    r = bench_ppo(model_dir, rollouts, len(pairs), p.epochs, p, False)
    tokens = r["train_tokens"] + r["nograd_tokens"]
    out = {"trl": f"none: TRL {trl_version() or TRL_VERSION} ships no PPO trainer (moved to "
                  "trl.experimental by huggingface/trl#4482, v1.10; the old import removed in "
                  "#5051, the experimental trainer in #7020); its RLOO/GRPO trainers sample "
                  "inside train() and have no value head or GAE: no side-by-side",
           "ours": {"seconds": round(r["seconds"], 2), "rollouts": len(pairs),
                    "epochs": r["extra"]["epochs"], "steps": r["extra"]["steps"],
                    "rollouts_per_s": round(len(pairs) * r["extra"]["epochs"] / r["seconds"], 3),
                    "tokens_per_s": round(tokens / r["seconds"], 1),   # trained + no-grad
                    "gflops": round((r["train_flops"] + r["nograd_flops"]) / r["seconds"] / 1e9, 1),
                    "flop_convention": "benchmarks/train_bench.py",
                    "minibatch_size": p.minibatch_size, "lr": p.lr, "precision": "fp32"}}
    log(f"vs_trl ppo: ours alone, {out['ours']['rollouts_per_s']} rollouts/s, "
        f"{out['ours']['gflops']} GFLOP/s ({out['trl']})")
    return out


def _measure_one(model_dir: Path, params: Params, pairs: Sequence[EncodedPair], pad_id: int,
                 kind: str, precision: str, repeats: int, epochs: int | None,
                 batch_size: int | None, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    """One update kind at one precision, both sides alternating (`compare`)."""
    p, stated = settings(params, kind, epochs, precision)
    if batch_size:
        p = replace(p, batch_size=batch_size)
        stated["batch_size"] = batch_size
    tokens = pair_tokens(pairs) * p.epochs
    if kind == "dpo":
        orders = dpo_orders(len(pairs), p.epochs, seed)
        run_ours = lambda: ours_dpo(model_dir, pairs, p, pad_id, seed)
        run_trl = lambda: Side(*trl_dpo(model_dir, pairs, p,
                                        params.update.max_length, orders))
    else:
        orders = rm_orders(pairs, p.epochs, seed)
        run_ours = lambda: ours_rm(model_dir, pairs, p, pad_id, seed)
        run_trl = lambda: Side(*trl_rm(model_dir, rm_model(model_dir, p), pairs, p,
                                       orders))
    name = kind if precision == "fp32" else f"{kind} {precision}"
    r = compare(run_ours, run_trl, repeats, len(pairs) * p.epochs, tokens, log, name)
    log(f"vs_trl {name}: ours {r['ours']['pairs_per_s']} vs trl {r['trl']['pairs_per_s']} "
        f"pairs/s (x{r['ratio']}, median x{r['ratio_median']}), tokens/s "
        f"{r['ours']['tokens_per_s']} vs {r['trl']['tokens_per_s']}; per-step loss max "
        f"|diff| {r['loss_max_abs_diff']} over {r['steps']} steps")
    return {**r, "settings": stated}


def _max_diff(a: Sequence[float], b: Sequence[float]) -> float | None:
    return max((abs(x - y) for x, y in zip(a, b)), default=None) if len(a) == len(b) else None


def bf16_deviation(fp32: dict[str, Any], bf16: dict[str, Any]) -> dict[str, Any]:
    """How far each side's bf16 per-step losses move from its own fp32 ones over the run (the
    weights drift apart after the first step, so this bounds the whole trajectory), and the
    stated tolerance: ours may move no further than the house bf16 tolerance
    (train_bench.LOSS_TOLERANCE, 0.02 on a loss of ~0.7) or than TRL's own mixed precision
    moves on the same pairs (the same autocast), whichever is larger."""
    from benchmarks.train_bench import LOSS_TOLERANCE
    ours = _max_diff(fp32["ours"]["losses"], bf16["ours"]["losses"])
    trl = _max_diff(fp32["trl"]["losses"], bf16["trl"]["losses"])
    bound = max(LOSS_TOLERANCE, trl or 0.0)
    return {"ours_loss_vs_fp32_max_abs_diff": ours, "trl_loss_vs_fp32_max_abs_diff": trl,
            "tolerance": round(bound, 6),
            "tolerance_rule": f"max({LOSS_TOLERANCE}, TRL's own bf16-vs-fp32 deviation)",
            "within_tolerance": None if ours is None else ours <= bound}


def measure_vs_trl(model_dir: Path, kinds: Sequence[str] = ("dpo", "rm", "ppo"),
                   n_pairs: int = 48, repeats: int = 3, epochs: int | None = None,
                   batch_size: int | None = None, seed: int = 0,
                   log: Callable[[str], None] = print,
                   precisions: Sequence[str] = ("fp32",)) -> dict[str, Any]:
    """{"trl": version, kind: comparison, ...}; {"skipped": why} without TRL installed. Each
    precision in `precisions` (fp32, bf16) is measured on both sides: `kind` holds fp32,
    `kind_bf16` bf16 with its per-step deviation from fp32 (`bf16_deviation`)."""
    unknown = set(precisions) - {"fp32", "bf16"}
    if unknown:
        raise ValueError(f"precisions: {sorted(unknown)} (have: fp32, bf16)")
    version = trl_version()
    if version is None:
        msg = f"trl is not installed (pip install -e '.[bench]': trl=={TRL_VERSION})"
        log(f"vs_trl: skipped: {msg}")
        return {"skipped": msg}
    params = load_params(ROOT / "params" / "default.yaml")
    tok = lm.load_tokenizer(model_dir)
    pairs = build_pairs(tok, params, n_pairs, seed)
    out: dict[str, Any] = {"trl": version, "pairs": n_pairs, "model": str(model_dir),
                           "threads": torch.get_num_threads(),
                           "glibc_tunables": os.environ.get(heap.ENV),
                           "response_tokens": RESPONSE_TOKENS,
                           "prompt_tokens_mean": round(sum(len(e.prompt_ids) for e in pairs)
                                                       / len(pairs), 1)}
    for kind in kinds:
        if kind == "ppo":          # TRL 1.12's PPO trainer, in its own processes
            from benchmarks.trl_ppo import PPO_K, measure_vs_trl_ppo
            out["ppo"] = measure_vs_trl_ppo(model_dir, max(1, n_pairs // PPO_K), PPO_K, repeats,
                                            epochs, seed, log)
            if "skipped" in out["ppo"]:
                out["ppo"] = {**ppo_section(model_dir, params, pairs, epochs, log),
                              "trl": f"none: {out['ppo']['skipped']}"}
            continue
        for precision in precisions:
            key = kind if precision == "fp32" else f"{kind}_{precision}"
            out[key] = _measure_one(model_dir, params, pairs, tok.pad_token_id, kind,
                                    precision, repeats, epochs, batch_size, seed, log)
        if kind in out and f"{kind}_bf16" in out:
            out[f"{kind}_bf16"]["bf16_deviation"] = bf16_deviation(out[kind], out[f"{kind}_bf16"])
            log(f"vs_trl {kind} bf16 vs fp32 losses: {out[f'{kind}_bf16']['bf16_deviation']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a converted HF model directory (default: the default "
                                    "model, converted into benchmarks/.cache)")
    ap.add_argument("--kinds", default="dpo,rm,ppo")
    ap.add_argument("--pairs", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per side")
    ap.add_argument("--epochs", type=int, help="default: the profile's (RM: at least 1)")
    ap.add_argument("--batch-size", type=int, help="default: the profile's")
    ap.add_argument("--precisions", default="fp32,bf16",
                    help="fp32 and/or bf16 (autocast on both sides), each side by side")
    ap.add_argument("--heap", choices=isolation.HEAP_CHOICES, default="stage",
                    help=isolation.HEAP_HELP)
    a = ap.parse_args(argv)
    precisions = [x for x in a.precisions.split(",") if x]
    if set(precisions) - {"fp32", "bf16"}:
        ap.error(f"--precisions {a.precisions}: fp32 and/or bf16")
    if argv is None:
        isolation.restart_with_heap(a.heap)
    torch.set_num_threads(int(os.environ.get("ALIGNLOOP_THREADS", isolation.THREADS)))
    out = measure_vs_trl(ensure_model(a.model), [k for k in a.kinds.split(",") if k], a.pairs,
                         a.repeats, a.epochs, a.batch_size, log=log,
                         precisions=precisions)
    print(json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
