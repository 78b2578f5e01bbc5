"""Model-FLOP utilisation (MFU) of the three training updates on the real model.

Each update is the stage's own training function, called as the stage calls it:
`tasks.policy.dpo.train_dpo` (update, DPO), `tasks.reward.reward_model.train_reward` (train_rm) and
`tasks.policy.ppo.train_ppo` (update, PPO, as `tasks.stages.update.run_ppo` calls it), with the
batch sizes, epochs and learning rates of params/default.yaml, on realistic inputs: the default
train prompts chat-rendered as the stages render them (~47 tokens) and the model's own responses of
up to 40 tokens, sampled once by the rollout stage's sampler (`sample_inputs`).

FLOP convention ("model FLOPs", PaLM-style; stated again in the result):
- N_body = the parameters a token's forward pass multiplies with, except the output head:
  every parameter but the embedding table (a lookup) and lm_head. N_head = lm_head's
  (SmolLM2 ties it to the embedding: vocab x hidden = 28.3M; the reward model has none).
- a forward pass over a sequence of T tokens with R response tokens costs
  2 (N_body T + N_head R): logits are only needed where a response token is predicted, so
  lm_head work on prompt positions (which tasks/models/lm.py mostly skips) is not counted.
- trained: 3x that (forward + backward); no-grad passes (DPO's reference pass; PPO's pi_old
  and value pass and its reference pass): 1x. Both are reported (`train_flops`,
  `nograd_flops`) and MFU uses their sum.
- attention's score and value matmuls are not counted: at T ~ 90 they would add ~1-2%
  (`attention_share`). Tokens are real (unpadded) tokens: padding computed on is waste. A
  DPO or RM pair is one packed row, its prompt counted once (`lm.pack` computes it once).

Timing: one warm-up call of the function on two items (one small step: allocator, lazy
inits, first optimizer state), then the timed call on the full input. The timed call is the
whole function (no-grad passes, every step, metrics), so the MFU is end to end. MFU = FLOPs /
seconds / peak, the peak (benchmarks/peaks.py) being the mean of a measurement right before
and one right after the update, so that load from other processes weighs on both sides.

Precision: where a params class has a bf16-autocast switch (a field named like `precision`,
`autocast`, `bf16`), the update runs with it off (fp32, against the fp32 peak) and on (against
the bf16 peak). bf16 counts only if its loss matches fp32's within LOSS_TOLERANCE: the fp32
run's trained model scored on one batch in both precisions (same weights, same batch), and the
two runs' first-step losses (same initial weights, same batch).
"""
from __future__ import annotations

import dataclasses
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.peaks import measure_peaks
from tasks.config.params import Params, load_params
from tasks.data.records import Rollout, parse_prompt
from tasks.models import lm
from tasks.stages.prompts import build_prompts, read_lines

ROOT = Path(__file__).resolve().parent.parent
RESPONSE_TOKENS = 40
WARMUP = 2                       # items in the warm-up call (one small step)
LOSS_TOLERANCE = 0.02            # |loss_bf16 - loss_fp32| on the same batch, absolute (loss ~0.7)
PRECISION_FIELDS = ("precision", "autocast", "bf16", "mixed_precision", "amp")
PEAK_KEYS = ("fp32_gflops", "bf16_gflops")
CONVENTION = {
    "forward_flops_per_sequence": "2 * (N_body * T + N_head * R), T tokens, R response tokens",
    "trained": "3x forward", "nograd": "1x forward",
    "N_body": "parameters used in a matmul per token, embedding table and lm_head excluded",
    "N_head": "lm_head (tied to the embedding in SmolLM2), only where a response token is "
              "predicted",
    "attention": "score/value matmuls not counted (see attention_share)",
    "tokens": "real (unpadded)", "timing": "whole training call after a two-item warm-up",
    "peak": "mean of the matmul peak right before and right after each update",
    "loss_tolerance_bf16": LOSS_TOLERANCE}


# 1. inputs and FLOPs ------------------------------------------------------------------------

def sample_inputs(model_dir: Path, params: Params, n_prompts: int, seed: int = 0
                  ) -> list[Rollout]:
    """Two samples of the model for each of n_prompts default train prompts, drawn by the
    rollout stage's own code (`sample_rollouts`: chat rendering, RESPONSE_TOKENS new tokens,
    temperature 1, the sampler's per-token log-probs), grouped by prompt. Sample 2i and 2i+1
    answer prompt i: they are a DPO/RM pair's chosen and rejected; sample 2i is a PPO rollout."""
    from tasks.models.generation import sample_rollouts
    p = params.prompts
    subjects, templates = read_lines(ROOT / p.subjects_file), read_lines(ROOT / p.templates_file)
    train, _ = build_prompts(subjects, templates, replace(p, n_train=max(n_prompts, 1),
                                                          n_heldout=0), seed)
    prompts = [(rec["prompt_id"], parse_prompt(rec, "prompt")) for rec in train[:n_prompts]]
    gen = replace(params.rollout.generation, max_new_tokens=RESPONSE_TOKENS, temperature=1.0,
                  top_p=1.0)
    model, tok = lm.load_causal_lm(model_dir), lm.load_tokenizer(model_dir)
    return sample_rollouts(model, tok, prompts, 2, gen, params.model.max_prompt_tokens,
                           "bench", 1, torch.Generator().manual_seed(seed))


def pairs_from(samples: Sequence[Rollout], n: int) -> list[Any]:
    """n (prompt, chosen, rejected) pairs: the two samples of each of the first n prompts."""
    from tasks.reward.features import EncodedPair
    return [EncodedPair(samples[2 * i].prompt_ids, samples[2 * i].response_ids,
                        samples[2 * i + 1].response_ids) for i in range(n)]


def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(N_body, N_head) of a causal LM or a sequence-classification (reward) model."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    total = sum(p.numel() for p in model.parameters())              # tied tensors once
    n_head = head.weight.numel() if head is not None else 0
    tied = head is not None and head.weight is emb
    return total - emb.numel() - (0 if tied else n_head), n_head


def forward_flops(counts: tuple[int, int], seqs: Sequence[tuple[int, int]]) -> float:
    """2 (N_body T + N_head R) summed over sequences given as (T, R)."""
    n_body, n_head = counts
    return float(sum(2 * (n_body * t + n_head * r) for t, r in seqs))


def attention_share(model: torch.nn.Module, counts: tuple[int, int],
                    seqs: Sequence[tuple[int, int]]) -> float:
    """Causal attention matmul FLOPs (QK^T and AV, forward) over the counted forward FLOPs."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    attn = sum(2 * t * t * c.num_attention_heads * head_dim * c.num_hidden_layers
               for t, _ in seqs)                                    # 2 matmuls x T^2/2 x 2
    return round(attn / forward_flops(counts, seqs), 4)


# 2. precision switch -----------------------------------------------------------------------

def precision_field(p: Any) -> str | None:
    """The name of p's bf16-autocast switch, or None when its class has none."""
    return next((f.name for f in dataclasses.fields(p) if f.name in PRECISION_FIELDS), None)


def with_precision(p: Any, precision: str) -> Any | None:
    """p with its precision switch set to fp32 or bf16; None when it has no such switch."""
    name = precision_field(p)
    if name is None:
        return None
    tp = typing.get_type_hints(type(p))[name]
    if tp is bool:
        return replace(p, **{name: precision == "bf16"})
    wanted = ("bf16", "bfloat16") if precision == "bf16" else ("fp32", "float32")
    value = next((a for a in typing.get_args(tp) if isinstance(a, str) and a.lower() in wanted),
                 None)
    return None if value is None else replace(p, **{name: value})


def _autocast(precision: str) -> Any:
    return lm.autocast(precision) if hasattr(lm, "autocast") else \
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")


# 3. the loss in both precisions, same weights, same batch ----------------------------------

@torch.no_grad()
def dpo_losses(policy: Any, ref: Any, batch: Sequence[Any], p: Any, pad: int) -> dict[str, float]:
    """The DPO loss of the trained policy against the reference on one batch, with both
    passes in fp32 and both in bf16 autocast (as train_dpo runs them)."""
    from tasks.functional.losses import DPO_LOSSES, LENGTH_NORMALISED_LOSSES
    from tasks.policy.dpo import pair_logprobs
    mean_lp = p.loss in LENGTH_NORMALISED_LOSSES
    out = {}
    for precision in ("fp32", "bf16"):
        with _autocast(precision):
            ref_c, ref_r = pair_logprobs(ref, batch, pad, mean_lp)
            pi_c, pi_r = pair_logprobs(policy, batch, pad, mean_lp)
        loss = DPO_LOSSES[p.loss](pi_c.float(), pi_r.float(), ref_c.float(), ref_r.float(),
                                  p.beta, p.label_smoothing)
        out[precision] = float(loss.mean())
    return out


@torch.no_grad()
def rm_losses(model: Any, batch: Sequence[Any], p: Any, pad: int) -> dict[str, float]:
    """The Bradley-Terry loss of the trained reward model on one batch, fp32 and bf16."""
    from tasks.functional.losses import bradley_terry_margin_loss
    from tasks.reward.reward_model import member_margins
    out = {}
    for precision in ("fp32", "bf16"):
        with _autocast(precision):
            margins = member_margins(model, batch, pad)[0].float()
        out[precision] = float(bradley_terry_margin_loss(margins, torch.zeros_like(margins),
                                                         p.margin).mean())
    return out


# 4. the three updates: each returns seconds, FLOPs, tokens and losses ----------------------

def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def frozen_ref(model_dir: Path) -> torch.nn.Module:
    """The model at `model_dir`, every weight frozen: the reference of a DPO or PPO update."""
    ref = lm.load_causal_lm(model_dir)
    for w in ref.parameters():
        w.requires_grad_(False)
    return ref


def bench_dpo(model_dir: Path, samples: Sequence[Rollout], n_pairs: int, epochs: int, p: Any,
              loss_check: bool) -> dict[str, Any]:
    from tasks.policy.dpo import train_dpo
    pad = lm.load_tokenizer(model_dir).pad_token_id
    p = replace(p, epochs=epochs)
    pairs = pairs_from(samples, n_pairs)

    def run(items: Sequence[Any], q: Any) -> tuple[float, dict[str, float], Any, Any]:
        policy, ref = lm.load_causal_lm(model_dir), frozen_ref(model_dir)
        seconds, metrics = _timed(lambda: train_dpo(policy, ref, items, p=q, pad_id=pad,
                                                    rng=torch.Generator().manual_seed(0)))
        return seconds, metrics, policy, ref

    run(pairs[:WARMUP], replace(p, epochs=1))                                # warm-up
    seconds, metrics, policy, ref = run(pairs, p)
    seqs = [packed_row(e, True) for e in pairs]
    return flop_record(
        policy, seconds, seqs, p.epochs, 1,
        {"pairs": n_pairs, "epochs": p.epochs, "batch_size": p.batch_size,
         "steps": int(metrics["update/steps"]),
         "nograd": "reference log-probs, one pass over the pairs"},
        loss_first=metrics.get("update/loss_first"),
        trained_loss=dpo_losses(policy, ref, pairs[: p.batch_size], p, pad)
        if loss_check else None)


def packed_row(pair: Any, head: bool) -> tuple[int, int]:
    """(T, R) of a pair as the DPO and RM updates compute it: one packed row, the prompt once
    and both responses (`lm.pack`); R = both responses where lm_head runs, else 0."""
    r = len(pair.chosen_ids) + len(pair.rejected_ids)
    return len(pair.prompt_ids) + r, r if head else 0


def flop_record(model: torch.nn.Module, seconds: float, seqs: Sequence[tuple[int, int]],
                train_passes: int, nograd_passes: int, extra: dict[str, Any],
                **fields: Any) -> dict[str, Any]:
    """What every update's benchmark reports: FLOPs and tokens of `train_passes` trained and
    `nograd_passes` no-grad passes over `seqs` ((T, R) per sequence), plus `fields`."""
    counts = param_counts(model)
    one_pass, tokens = forward_flops(counts, seqs), sum(t for t, _ in seqs)
    return {"seconds": seconds, "counts": counts, "train_flops": 3 * train_passes * one_pass,
            "nograd_flops": nograd_passes * one_pass, "train_tokens": train_passes * tokens,
            "nograd_tokens": nograd_passes * tokens, **fields,
            "extra": {**extra, "attention_share": attention_share(model, counts, seqs)}}


def bench_rm(model_dir: Path, samples: Sequence[Rollout], n_pairs: int, epochs: int, p: Any,
             loss_check: bool) -> dict[str, Any]:
    """The reward model's fine-tuning epochs (`epochs`, not the profile's: the default
    profile's train_rm runs 0, its probe on frozen features alone, which trains nothing)."""
    from tasks.reward.reward_model import init_reward_model, train_reward
    tok = lm.load_tokenizer(model_dir)
    pairs = pairs_from(samples, n_pairs)
    p = replace(p, epochs=epochs)

    def run(items: Sequence[Any], q: Any) -> tuple[float, dict[str, float], Any]:
        model = init_reward_model(model_dir, torch.Generator().manual_seed(0))
        seconds, metrics = _timed(lambda: train_reward(model, items, q, tok.pad_token_id,
                                                       torch.Generator().manual_seed(1)))
        return seconds, metrics, model

    run(pairs[:WARMUP], replace(p, epochs=1))                                # warm-up
    seconds, metrics, model = run(pairs, p)
    seqs = [packed_row(e, False) for e in pairs]                      # no lm_head: R = 0
    return flop_record(
        model, seconds, seqs, p.epochs, 0,
        {"pairs": n_pairs, "epochs": p.epochs, "batch_size": p.batch_size,
         "steps": int(metrics["steps"]),
         "nograd": "none (held-out metrics are computed outside train_reward)"},
        loss_first=metrics.get("loss_first"),
        trained_loss=rm_losses(model, pairs[: p.batch_size], p, tok.pad_token_id)
        if loss_check else None)


def bench_ppo(model_dir: Path, samples: Sequence[Rollout], n_rollouts: int, epochs: int,
              p: Any, loss_check: bool) -> dict[str, Any]:
    """PPO on n rollouts (with the sampler's stored log-probs as pi_old) and standard-normal
    normalised RM scores (the scoring pass belongs to update's edge, not to train_ppo)."""
    from tasks.policy.ppo import train_ppo
    from tasks.policy.value_head import ValueHead
    tok = lm.load_tokenizer(model_dir)
    p = replace(p, epochs=epochs)
    rollouts = list(samples[: 2 * n_rollouts: 2])
    scores = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(6))

    def run(rs: list[Rollout], sc: torch.Tensor, q: Any) -> tuple[float, dict[str, float], Any]:
        policy, ref = lm.load_causal_lm(model_dir), frozen_ref(model_dir)
        head = ValueHead(policy.config.hidden_size)
        seconds, metrics = _timed(lambda: train_ppo(policy, head, ref, rs, sc, p=q,
                                                    pad_id=tok.pad_token_id,
                                                    rng=torch.Generator().manual_seed(0), it=1))
        return seconds, metrics, policy

    run(rollouts[:WARMUP], scores[:WARMUP], replace(p, epochs=1))            # warm-up
    seconds, metrics, policy = run(rollouts, scores, p)
    seqs = [(len(r.prompt_ids) + len(r.response_ids), len(r.response_ids)) for r in rollouts]
    return flop_record(
        policy, seconds, seqs, int(metrics["update/epochs_run"]), 2,
        {"rollouts": n_rollouts, "epochs": p.epochs, "minibatch_size": p.minibatch_size,
         "steps": int(metrics["update/steps"]),
         "nograd": "pi_old log-probs + values, and reference log-probs: two passes over the "
                   "rollouts"},
        loss_first=None, loss_last=metrics.get("update/loss_last"), trained_loss=None)


# 5. all of them, each against the peak measured around it ---------------------------------

SIZES = {"default": {"dpo_pairs": 16, "dpo_epochs": 2, "rm_pairs": 32, "rm_epochs": 3,
                     "ppo_rollouts": 32, "ppo_epochs": 2},
         "quick": {"dpo_pairs": 8, "dpo_epochs": 1, "rm_pairs": 16, "rm_epochs": 1,
                   "ppo_rollouts": 16, "ppo_epochs": 1}}


def loss_check(fp32: dict[str, Any], bf16: dict[str, Any]) -> dict[str, Any]:
    """bf16 against fp32 (see the module docstring); within tolerance iff every check is."""
    trained = fp32.get("trained_loss") or {}
    diffs = {}
    if "fp32" in trained and "bf16" in trained:
        diffs["trained_loss"] = abs(trained["fp32"] - trained["bf16"])
    a, b = fp32.get("loss_first"), bf16.get("loss_first")
    if a is not None and b is not None:
        diffs["loss_first"] = abs(a - b)
    return {"trained_loss": trained, "loss_first": {"fp32": a, "bf16": b},
            "abs_diff": {k: round(v, 5) for k, v in diffs.items()},
            "tolerance": LOSS_TOLERANCE,
            "within": bool(diffs) and all(v <= LOSS_TOLERANCE for v in diffs.values())}


def _result(r: dict[str, Any], precision: str, before: dict[str, float],
            after: dict[str, float]) -> dict[str, Any]:
    peaks = {k: round((before[k] + after[k]) / 2, 1) for k in PEAK_KEYS}
    peak = peaks["bf16_gflops" if precision == "bf16" else "fp32_gflops"]
    flops = r["train_flops"] + r["nograd_flops"]
    gflops = flops / r["seconds"] / 1e9
    return {"precision": precision, "seconds": round(r["seconds"], 2),
            "n_body": r["counts"][0], "n_head": r["counts"][1],
            "train_tokens": r["train_tokens"], "nograd_tokens": r["nograd_tokens"],
            "train_tokens_per_s": round(r["train_tokens"] / r["seconds"], 1),
            "train_flops": r["train_flops"], "nograd_flops": r["nograd_flops"],
            "achieved_gflops": round(gflops, 1), "peak_gflops": peak,
            "mfu": round(gflops / peak, 3), "peaks_before": before, "peaks_after": after,
            "loss_first": r.get("loss_first"), "loss_last": r.get("loss_last"),
            "trained_loss": r.get("trained_loss"), **r["extra"]}


def measure_train_mfu(model_dir: Path, quick: bool = False,
                      kinds: Sequence[str] = ("dpo", "rm", "ppo"),
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """{kind: {"fp32": ..., "bf16": ... (if switchable), "loss_check", "best", "mfu"}}."""
    params = load_params(ROOT / "params" / "default.yaml")
    size = SIZES["quick" if quick else "default"]
    t0 = time.perf_counter()
    samples = sample_inputs(model_dir, params, max(size["dpo_pairs"], size["rm_pairs"],
                                                   size["ppo_rollouts"]))
    log(f"train_mfu: {len(samples)} responses sampled in {time.perf_counter() - t0:.0f} s")
    benches: dict[str, tuple[Any, Callable[[Any, bool], dict[str, Any]]]] = {
        "dpo": (params.update.dpo, lambda q, c: bench_dpo(
            model_dir, samples, size["dpo_pairs"], size["dpo_epochs"], q, c)),
        "rm": (params.train_rm, lambda q, c: bench_rm(model_dir, samples, size["rm_pairs"],
                                                      size["rm_epochs"], q, c)),
        "ppo": (params.update.ppo, lambda q, c: bench_ppo(
            model_dir, samples, size["ppo_rollouts"], size["ppo_epochs"], q, c)),
    }
    lengths = [len(r.response_ids) for r in samples]
    out: dict[str, Any] = {"convention": CONVENTION, "sizes": size, "inputs": {
        "prompt_tokens_mean": round(sum(len(r.prompt_ids) for r in samples) / len(samples), 1),
        "response_tokens_mean": round(sum(lengths) / len(lengths), 1),
        "responses_cut_at_40": sum(not r.finished for r in samples) / len(samples)}}
    for kind in kinds:
        base, bench = benches[kind]
        # the profile may already pick bf16: fp32 is set explicitly, not taken as given
        variants = [("fp32", with_precision(base, "fp32") or base)]
        if (bf16 := with_precision(base, "bf16")) is not None and lm.native_bf16():
            variants.append(("bf16", bf16))       # not without native bf16 kernels: ~70x slower
        entry: dict[str, Any] = {"precision_switch": precision_field(base),
                                 "profile_precision": getattr(base, precision_field(base) or "",
                                                              "fp32")}
        for precision, q in variants:
            before = measure_peaks()
            r = bench(q, precision == "fp32" and len(variants) > 1)
            entry[precision] = _result(r, precision, before, measure_peaks())
            log(f"train_mfu {kind} {precision}: MFU {entry[precision]['mfu']:.3f} "
                f"({entry[precision]['achieved_gflops']} of {entry[precision]['peak_gflops']} "
                f"GFLOP/s, {r['seconds']:.1f} s)")
        if "bf16" in entry:
            entry["loss_check"] = loss_check(entry["fp32"], entry["bf16"])
        usable = ["fp32"] + (["bf16"] if entry.get("loss_check", {}).get("within") else [])
        entry["best"] = max(usable, key=lambda v: entry[v]["mfu"])
        entry["mfu"] = entry[entry["best"]]["mfu"]
        out[kind] = entry
    return out
