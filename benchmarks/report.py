"""The benchmark's result object: figures from every section, and which targets they meet.

Pure functions on plain dicts (no model, no timing), so tests can check them on fake numbers.
"""
from __future__ import annotations

from typing import Any

TARGETS = {
    "train_mfu": 0.5,                # of the matmul peak of the precision used (fp32 or bf16)
    "rollout_speedup": 3.0,          # rollout sampler new tokens/s over plain model.generate,
                                     # on every alternating pass (the worst pass's ratio)
    "logprob_max_abs_err": 1e-3,     # sampler's stored log-probs vs a full forward pass
    "cached_rerun_s": 1.0,           # fully cached rerun, beyond interpreter + server start-up
    "vs_trl": 2.0,                   # our DPO and RM updates' pairs/s over TRL's trainers, in
                                     # fp32 and in bf16 (autocast on both sides; our bf16 losses
                                     # within the stated tolerance of fp32: vs_trl.bf16_deviation)
    "vs_trl_ppo": 1.5,               # our PPO update's rollouts/s over TRL 1.12's PPOTrainer on
                                     # the same rollouts (benchmarks/trl_ppo.py), fp32
    "scaling": "t(s)/t(1) <= s",     # linear or better, for every scale s measured
}


def scaling_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """t_s / t_1 for every measured scale s other than 1."""
    t1 = next((r["seconds"] for r in rows if r["scale"] == 1), None)
    if not t1:
        return {}
    return {f"t{r['scale']}/t1": round(r["seconds"] / t1, 2) for r in rows if r["scale"] != 1}


def targets_met(result: dict[str, Any]) -> dict[str, bool | None]:
    """One boolean per target; None where the section was not run (or failed)."""
    out: dict[str, bool | None] = {}
    train = result.get("train_mfu") or {}
    for kind in ("dpo", "rm", "ppo"):
        mfu = (train.get(kind) or {}).get("mfu")
        out[f"train_mfu_{kind}"] = None if mfu is None else mfu >= TARGETS["train_mfu"]
    speedup, err = result.get("rollout_speedup"), result.get("logprob_max_abs_err")
    worst = (result.get("rollout") or {}).get("rollout_speedup_worst_pass")   # None: unknown
    out["rollout_speedup"] = None if speedup is None else speedup >= TARGETS["rollout_speedup"]
    out["rollout_speedup_every_pass"] = (None if worst is None
                                         else worst >= TARGETS["rollout_speedup"])
    out["logprob_max_abs_err"] = None if err is None else err <= TARGETS["logprob_max_abs_err"]
    rerun = result.get("cached_rerun_s")
    out["cached_rerun_s"] = None if rerun is None else rerun <= TARGETS["cached_rerun_s"]
    vs_trl = result.get("vs_trl") or {}
    for kind in ("dpo", "rm"):
        ratio = (vs_trl.get(kind) or {}).get("ratio")
        out[f"vs_trl_{kind}"] = None if ratio is None else ratio >= TARGETS["vs_trl"]
        bf16 = vs_trl.get(f"{kind}_bf16") or {}          # both sides in bf16 autocast
        ratio = bf16.get("ratio")
        out[f"vs_trl_{kind}_bf16"] = None if ratio is None else ratio >= TARGETS["vs_trl"]
        out[f"vs_trl_{kind}_bf16_loss"] = (bf16.get("bf16_deviation") or {}).get(
            "within_tolerance")
    ratio = (vs_trl.get("ppo") or {}).get("ratio")       # None: ours alone (no TRL side)
    out["vs_trl_ppo"] = None if ratio is None else ratio >= TARGETS["vs_trl_ppo"]
    rows = result.get("scaling") or []
    ratios = scaling_ratios(rows)
    out["scaling_linear"] = None if not ratios else all(
        r["seconds"] <= r["scale"] * next(x["seconds"] for x in rows if x["scale"] == 1)
        for r in rows)
    return out


def assemble(peaks: dict[str, Any] | None, train: dict[str, Any] | None,
             rollout: dict[str, Any] | None, cached: dict[str, Any] | None,
             scaling: list[dict[str, Any]] | None, meta: dict[str, Any],
             errors: dict[str, str] | None = None,
             vs_trl: dict[str, Any] | None = None) -> dict[str, Any]:
    """The one JSON object `benchmarks/run.py` prints last."""
    result: dict[str, Any] = {"peaks": peaks, "train_mfu": None, "rollout_speedup": None,
                              "logprob_max_abs_err": None, "rollout": rollout,
                              "cached_rerun_s": None, "cached_rerun": cached,
                              "scaling": scaling, "scaling_ratios": None, "vs_trl": vs_trl}
    if train is not None:
        result["train_mfu"] = {k: v for k, v in train.items()}
        result["train_mfu_summary"] = {
            k: {"mfu": v["mfu"], "precision": v["best"],
                "peak_gflops": v[v["best"]]["peak_gflops"],
                "fp32_mfu": v["fp32"]["mfu"], "fp32_peak_gflops": v["fp32"]["peak_gflops"],
                **({"bf16_mfu": v["bf16"]["mfu"], "bf16_peak_gflops": v["bf16"]["peak_gflops"],
                    "bf16_loss_within_tolerance": v["loss_check"]["within"]}
                   if "bf16" in v else {})}
            for k, v in train.items() if k in ("dpo", "rm", "ppo")}
    if rollout is not None:
        result["rollout_speedup"] = rollout.get("rollout_speedup")
        result["logprob_max_abs_err"] = rollout.get("logprob_max_abs_err")
    if cached is not None:
        result["cached_rerun_s"] = cached.get("cached_rerun_s")
    if scaling:
        result["scaling_ratios"] = scaling_ratios(scaling)
    result["targets"] = TARGETS
    result["targets_met"] = targets_met(result)
    result["meta"] = meta
    if errors:
        result["errors"] = errors
    return result
