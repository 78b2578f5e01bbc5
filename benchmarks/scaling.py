"""Time and peak memory of one real-model iteration at 1x, 2x and 4x the prompts.

One iteration is the stage chain rollout -> judge -> train_rm -> update -> evaluate, each run
as its dvc.yaml command runs it (`python -m tasks.stages.X --it 1`, a fresh interpreter) in a
prepared workspace directory. The profile is params/default.yaml (the real SmolLM2 model, its
batch sizes, epochs and precision) with the prompt counts scaled: `rollout.n_prompts` = base x s
(K samples each) and the held-out prompts of `evaluate` (and its Best-of-N baseline) = eval
base x s. The set-up stages (prompts, prepare_model, collect_offpolicy, reference_samples)
run untimed before each scale. Peak memory is each stage process's own peak RSS (VmHWM of
/proc/PID/status, polled every 20 ms while it runs: wait4's ru_maxrss is no use here, since
Linux carries the parent's peak into a child across fork and exec, and the benchmark's own
process holds models from the train and rollout sections: every stage read 7.9 GB); an
iteration's is the largest of its stages (they run one after another).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from benchmarks.isolation import REPO, isolated_env
from tasks.core import layout

SETUP_STAGES = layout.SETUP_STAGES[:3]   # reference_samples: scale-specific, run untimed below
ITERATION = layout.LOOP_STAGES[:5]        # one iteration's stages, gate aside (it trains nothing)


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set a dotted key that the profile has (keys it lacks are left out, not invented)."""
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        if not isinstance(node.get(key), dict):
            return
        node = node[key]
    if last in node:
        node[last] = value


def scaled_params(model_dir: Path, n_prompts: int, n_eval: int, max_prompts: int,
                  max_eval: int, k: int, max_new_tokens: int) -> dict[str, Any]:
    """params/default.yaml, one iteration, the converted model, prompt counts of one scale."""
    data = yaml.safe_load((REPO / "params" / "default.yaml").read_text())
    data["iterations"] = {"1": {"prev": 0}}
    edits = {"model.source": "hf_dir", "model.path": str(model_dir),
             "prompts.n_train": max_prompts, "prompts.n_heldout": max_eval,
             "offpolicy.n_prompts": 4, "offpolicy.samples_per_prompt": 2,
             "rollout.n_prompts": n_prompts, "rollout.samples_per_prompt": k,
             "evaluate.n_prompts": n_eval, "evaluate.best_of_n.n_prompts": n_eval}
    for section in ("offpolicy", "rollout", "evaluate"):
        edits[f"{section}.generation.max_new_tokens"] = max_new_tokens
    for dotted, value in edits.items():
        _set(data, dotted, value)
    return data


def _vm_hwm_kib(pid: int) -> int:
    """The process's peak resident set (VmHWM, KiB) so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
    except (OSError, ValueError):
        return 0


def watch_peak(pid: int, done: threading.Event, peak: list[int]) -> None:
    """Until `done` is set, `peak[0]` = the largest VmHWM (KiB) of process `pid` seen, polled
    every 20 ms: the child's own peak (wait4's carries the parent's over)."""
    while not done.wait(0.02):
        peak[0] = max(peak[0], _vm_hwm_kib(pid))


def run_stage(module: str, root: Path, it: int, env: dict[str, str]) -> dict[str, Any]:
    """`python -m tasks.stages.<module> --it IT --root ROOT`: seconds and the process's peak RSS."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", f"tasks.stages.{module}", "--it", str(it),
                             "--root", str(root)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    done, peak = threading.Event(), [0]
    watcher = threading.Thread(target=watch_peak, args=(proc.pid, done, peak), daemon=True)
    watcher.start()
    try:
        output = proc.stdout.read()
        done.set()
        watcher.join()
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:                      # interrupted: leave no stage running
        done.set()
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"tasks.stages.{module} --it {it} exited {proc.returncode}:\n"
                           f"{output.decode(errors='replace')[-3000:]}")
    return {"stage": module, "seconds": round(seconds, 2),
            "peak_rss_mb": round(peak[0] / 1024, 1),
            "ru_maxrss_mb": round(usage.ru_maxrss / 1024, 1)}      # an upper bound (see above)


def prepare_base(base: Path, env: dict[str, str], params: dict[str, Any]) -> None:
    """The set-up stages shared by every scale (prompts for the largest one)."""
    if base.exists():
        shutil.rmtree(base)
    shutil.copytree(REPO / "params" / "prompts", base / "params" / "prompts")
    (base / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for stage in SETUP_STAGES:
        run_stage(stage, base, 0, env)


def measure_scaling(work: Path, model_dir: Path, scales: Sequence[int] = (1, 2, 4),
                    base_prompts: int = 8, base_eval: int = 16, k: int = 4,
                    max_new_tokens: int = 40, log: Callable[[str], None] = print
                    ) -> list[dict[str, Any]]:
    """Seconds, per-stage split and peak RSS of one iteration at each scale."""
    env = isolated_env(work / "stores")
    top = max(scales)
    common = dict(model_dir=model_dir.resolve(), max_prompts=base_prompts * top,
                  max_eval=base_eval * top, k=k, max_new_tokens=max_new_tokens)
    base = work / "base"
    log(f"scaling: set-up stages in {base} ...")
    prepare_base(base, env, scaled_params(n_prompts=base_prompts, n_eval=base_eval,
                                                     **common))
    out = []
    for s in scales:
        root = work / f"x{s}"
        if root.exists():
            shutil.rmtree(root)
        shutil.copytree(base, root, copy_function=os.link)   # hard links: set-up outputs shared
        params = scaled_params(n_prompts=base_prompts * s, n_eval=base_eval * s, **common)
        (root / "params.yaml").unlink()
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        run_stage("reference_samples", root, 0, env)           # scale-specific, untimed
        stages = [run_stage(m, root, 1, env) for m in ITERATION]
        row = {"scale": s, "n_prompts": base_prompts * s, "samples": base_prompts * s * k,
               "eval_prompts": base_eval * s,
               "seconds": round(sum(x["seconds"] for x in stages), 1),
               "peak_rss_mb": max(x["peak_rss_mb"] for x in stages), "stages": stages}
        split = ", ".join(f"{x['stage']} {x['seconds']}" for x in stages)
        log(f"scaling x{s}: {row['seconds']} s, peak RSS {row['peak_rss_mb']} MB ({split})")
        out.append(row)
        shutil.rmtree(root)
    shutil.rmtree(base)
    return out

