"""DPO update throughput on 1 vs N processes (`update.processes`, torchrun, gloo on CPU).

What is timed is the stage itself, `python -m tasks.stages.update --it 1`, as DVC runs it, on a tiny
workspace (set-up, rollout@1 and judge@1 of params/tiny.yaml; 8 on-policy + 8 off-policy
pairs, batches of 8). Rank 0 reports the seconds of its whole `train_dpo` call (reference pass,
every step and its all-reduces) in the debug side file (ALIGNLOOP_STEP_LOSSES), so:
- throughput = pairs * epochs / train seconds (pairs/s);
- launch overhead of N processes = (wall - train)(N) - (wall - train)(1): torchrun, N
  interpreters importing torch and transformers, N model loads, the process group.
A third row runs one process on one thread: a control for how much of the ratio is the
intra-op threading of the one-process run (on a loaded machine two threads can lose to one).
Each point is the fastest of `--repeats` runs (timeit's convention: load from other processes
only ever adds). Every run uses the same ALIGNLOOP_THREADS (default: all cores), split over
the ranks.

Usage: python -m benchmarks.ddp_scaling [--processes 2] [--epochs 8] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from flows.shipped import PARAMS_DATA
from tasks.core import layout
from tasks.runtime import distributed, stage

ROOT = Path(__file__).resolve().parent.parent

SETUP = ["prompts", "prepare_model", "collect_offpolicy", "reference_samples"]


def _run(module: str, root: Path, it: int = 0, env: dict[str, str] | None = None) -> float:
    """Run one stage as DVC would; its wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", f"tasks.stages.{module}", "--root", str(root),
                    "--it", str(it)], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def build_workspace(root: Path) -> None:
    """The tiny profile's set-up and iteration 1 up to the judge: update@1's inputs."""
    (root / "params").mkdir(parents=True)
    for name in PARAMS_DATA:
        shutil.copytree(ROOT / "params" / name, root / "params" / name)
    shutil.copy(ROOT / "params" / "tiny.yaml", root / layout.PARAMS_FILE)
    (root / layout.IMPORT_DIR).mkdir(parents=True)
    for module in SETUP:
        _run(module, root)
    for module in ("rollout", "judge"):
        _run(module, root, 1)


def timed_update(root: Path, processes: int, epochs: int,
                 threads: str | None = None) -> tuple[float, float]:
    """update@1 with `processes` ranks and `epochs` passes: (wall, train) seconds."""
    data = yaml.safe_load((root / layout.PARAMS_FILE).read_text())
    data["update"]["processes"] = processes
    data["update"]["dpo"].update(epochs=epochs, offpolicy_mix=0.5)   # 16 pairs
    (root / layout.PARAMS_FILE).write_text(yaml.safe_dump(data, sort_keys=False))
    shutil.rmtree(root / layout.policy(1), ignore_errors=True)
    side = root.parent / "losses.json"
    env = {distributed.LOSSES_ENV: str(side), **({stage.THREADS_ENV: threads} if threads else {})}
    wall = _run("update", root, 1, env)
    return wall, float(json.loads(side.read_text())["train_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="runs per point; the fastest counts")
    args = ap.parse_args()
    pairs = 16
    print(f"threads: {os.environ.get(stage.THREADS_ENV, os.cpu_count())} (ALIGNLOOP_THREADS), "
          f"cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}; tiny model, "
          f"{pairs} pairs, batch 8, {args.epochs} epochs")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ws"
        build_workspace(root)
        for n, threads in ((1, None), (args.processes, None), (1, "1")):
            runs = [timed_update(root, n, args.epochs, threads) for _ in range(args.repeats)]
            wall, train = min(r[0] for r in runs), min(r[1] for r in runs)
            rows[(n, threads)] = (pairs * args.epochs / train, min(r[0] - r[1] for r in runs))
            print(f"processes {n}{', 1 thread (control)' if threads else ''}: wall {wall:.2f} s, "
                  f"train_dpo {train:.2f} s ({rows[(n, threads)][0]:.1f} pairs/s), outside "
                  f"training {rows[(n, threads)][1]:.2f} s")
    (r1, f1), (rn, fn) = rows[(1, None)], rows[(args.processes, None)]
    print(f"ratio (pairs/s, {args.processes} vs 1 process): {rn / r1:.2f}x; launch overhead of "
          f"{args.processes} processes: {fn - f1:+.2f} s; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
