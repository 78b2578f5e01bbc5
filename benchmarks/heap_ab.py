"""glibc's malloc defaults against the stage processes' settings (tasks/core/heap.py), side by side.

    python -m benchmarks.heap_ab [--model DIR] [--kinds dpo,rm,ppo] [--repeats 3]

Each run is a fresh process, as a stage is: load the model, build the inputs, call the stage's
training function once (the first call in a process, the one a stage pays), report its
seconds, minor page faults, system time and peak RSS. Sides alternate (stock, stage, stock,
...); stock sets GLIBC_TUNABLES empty, stage sets it as `flows/dag.reproduce` does. Printed:
each kind's fastest and median seconds per side, their ratio, and whether the per-step losses
are equal to the bit (they must be: the allocator moves no arithmetic).

Inputs, at the default profile's settings (params/default.yaml): DPO `train_dpo` on 48 pairs
(benchmarks/common.build_pairs), the profile's precision, batch and epochs (12 steps);
RM `train_reward` on 64 pairs, 1 epoch, last-token read-out (vs_trl's RM settings);
PPO `train_ppo` on 32 of the model's own rollouts (benchmarks/train_bench.sample_inputs),
default-ppo's settings, 1 epoch.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tasks.core import heap

ROOT = Path(__file__).resolve().parent.parent

KINDS = ("dpo", "rm", "ppo")
SIZES = {"dpo": 48, "rm": 64, "ppo": 32}


def _train(kind: str, model_dir: Path) -> None:
    """One training call, as the stage makes it (the child's work)."""
    import torch

    from benchmarks import vs_trl
    from benchmarks.common import build_pairs
    from tasks.config.params import load_params
    from tasks.models import lm
    from tasks.runtime.distributed import LOSSES_ENV
    tok = lm.load_tokenizer(model_dir)
    if kind == "ppo":
        from benchmarks.train_bench import sample_inputs
        from tasks.policy.ppo import train_ppo
        from tasks.policy.value_head import ValueHead
        params = load_params(ROOT / "params/default-ppo.yaml")
        rollouts = sample_inputs(model_dir, params, SIZES[kind])[::2]
        scores = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(6))
        policy, ref = lm.load_causal_lm(model_dir), lm.load_causal_lm(model_dir)
        ref.requires_grad_(False)
        head = ValueHead(policy.config.hidden_size)
        p = replace(params.update.ppo, epochs=1)
        train = lambda: train_ppo(policy, head, ref, rollouts, scores, p=p,
                                  pad_id=tok.pad_token_id,
                                  rng=torch.Generator().manual_seed(0), it=1)
    else:
        params = load_params(ROOT / "params/default.yaml")
        pairs = build_pairs(tok, params, SIZES[kind])
        if kind == "dpo":
            from tasks.policy.dpo import train_dpo
            p = params.update.dpo
            policy, ref = lm.load_causal_lm(model_dir), lm.load_causal_lm(model_dir)
            ref.requires_grad_(False)
            train = lambda: train_dpo(policy, ref, pairs, p=p, pad_id=tok.pad_token_id,
                                      rng=torch.Generator().manual_seed(0))
        else:
            from tasks.reward.reward_model import train_reward
            p, _ = vs_trl.settings(params, "rm", 1, params.train_rm.precision)
            model = vs_trl.rm_model(model_dir, p)
            train = lambda: train_reward(model, pairs, p, tok.pad_token_id,
                                         torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[LOSSES_ENV] = str(Path(tmp) / "losses.json")
        before = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        train()
        seconds = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
        losses = json.loads((Path(tmp) / "losses.json").read_text())["losses"]
    print(json.dumps({"seconds": seconds, "minor_faults": after.ru_minflt - before.ru_minflt,
                      "system_s": after.ru_stime - before.ru_stime,
                      "peak_rss_mb": after.ru_maxrss // 1024, "losses": losses}))


def _child(kind: str, model_dir: Path, tunables: str) -> dict[str, Any]:
    env = {**os.environ, heap.ENV: tunables}
    out = subprocess.run([sys.executable, "-m", "benchmarks.heap_ab", "--child", kind,
                          "--model", str(model_dir)], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    secs = [r["seconds"] for r in runs]
    return {"seconds": [round(s, 2) for s in secs], "fastest_s": round(min(secs), 2),
            "median_s": round(statistics.median(secs), 2),
            "minor_faults": [r["minor_faults"] for r in runs],
            "system_s": [round(r["system_s"], 2) for r in runs],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}


def measure(model_dir: Path, kinds: list[str], repeats: int) -> dict[str, Any]:
    """stock, stage, stock, stage, ... `repeats` times per kind."""
    result: dict[str, Any] = {"tunables": heap.TUNABLES, "glibc": heap.is_glibc()}
    for kind in kinds:
        runs: dict[str, list[dict[str, Any]]] = {"stock": [], "stage": []}
        for i in range(repeats):
            for side, tunables in (("stock", ""), ("stage", heap.TUNABLES)):
                runs[side].append(_child(kind, model_dir, tunables))
            print(f"heap_ab {kind} pass {i + 1}/{repeats}: stock {runs['stock'][-1]['seconds']:.1f}"
                  f" s, stage {runs['stage'][-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
        a, b = _side(runs["stock"]), _side(runs["stage"])
        result[kind] = {"stock": a, "stage": b,
                        "speedup": round(a["fastest_s"] / b["fastest_s"], 3),
                        "speedup_median": round(a["median_s"] / b["median_s"], 3),
                        "steps": len(runs["stock"][0]["losses"]),
                        "losses_equal": all(r["losses"] == runs["stock"][0]["losses"]
                                            for side in runs.values() for r in side)}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a converted HF model directory (default: the default "
                                    "model, converted into benchmarks/.cache)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per side")
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _train(a.child, Path(a.model))
        return 0
    kinds = [k for k in a.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        print(f"error: --kinds: unknown {', '.join(unknown)} (known: {', '.join(KINDS)})",
              file=sys.stderr)
        return 2
    from benchmarks.common import ensure_model
    print(json.dumps(measure(ensure_model(a.model), kinds, a.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
