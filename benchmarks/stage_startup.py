"""What a loop stage's process costs before its first line of work: the interpreter, the
imports (torch, transformers' model classes, the stage's own) and the exit, per stage, side by
side in one run.

    python -m benchmarks.stage_startup [--stages rollout,judge,...] [--repeat 3]

Each measurement starts `python -m tasks.stages.<stage> --help` as DVC starts the stage (the
same interpreter, the stage programs' heap settings, `tasks.core.heap`), so it pays every
module-level import and the exit of a real stage and stops at argument parsing. The stages run
in turn, `--repeat` rounds, so that a machine whose speed drifts slows every stage alike; the
median of the rounds is reported. Two references are measured the same way: `python -c pass`
(the interpreter alone) and `import torch` followed by transformers' model classes
(`transformers.modeling_utils`), the floor any process that builds a model pays. Every
iteration starts each loop stage once, so their sum is a fixed cost of an iteration's minutes
(`targets: max_minutes`). Each stage is started a second way in the same rounds: through a fork
server (tasks/runtime/forkserver.py, what a run's CLI starts), whose child has the imports
done already. Prints a table with the commit and CPU model, then JSON on the last line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.lora_cost import cpu_model
from tasks.core import heap, layout
from tasks.runtime import forkserver

REPO = Path(__file__).resolve().parent.parent
REFERENCES = {"interpreter": ["-c", "pass"],
              "torch + transformers models": [
                  "-c", "import torch; from transformers import modeling_utils"]}


def timed(args: list[str], env: dict[str, str]) -> float:
    """Wall seconds of one `python ARGS` run from the checkout root; a failure is an error."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"python {' '.join(args)} exited {proc.returncode}: "
                         f"{proc.stderr.strip()[-500:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default=",".join(layout.LOOP_STAGES),
                    help="loop stages to start, comma-separated (default: every loop stage)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the median is reported")
    args = ap.parse_args()
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in layout.STAGES]
    if unknown or args.repeat < 1:
        raise SystemExit(f"--stages: unknown {unknown}" if unknown else "--repeat: at least 1")
    env = {k: v for k, v in os.environ.items() if k != forkserver.ENV}
    env.update(heap.stage_environment(env))
    runs: dict[str, list[str]] = {**REFERENCES,
                                  **{s: ["-m", f"tasks.stages.{s}", "--help"] for s in stages}}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    forked: dict[str, list[float]] = {name: [] for name in stages}
    server = forkserver.Server().start(env)
    served = {**env, forkserver.ENV: server.path}
    try:
        timed(["-m", "tasks.stages.gate", "--help"], served)   # waits for the server's imports
        for _ in range(args.repeat):
            for name, cmd in runs.items():
                seconds[name].append(timed(cmd, env))
                if name in forked:
                    forked[name].append(timed(cmd, served))
    finally:
        server.stop()
    median = {name: statistics.median(xs) for name, xs in seconds.items()}
    median_forked = {name: statistics.median(xs) for name, xs in forked.items()}
    per_iteration = sum(median[s] for s in stages)
    per_iteration_forked = sum(median_forked.values())
    head = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                     capture_output=True, text=True).stdout.strip(),
            "cpu": cpu_model(), "threads": os.cpu_count(), "repeat": args.repeat}
    print(f"commit {head['commit']}, {head['cpu']}, {head['threads']} CPUs, median of "
          f"{args.repeat}")
    print(f"  {'':<32} {'fresh':>8}  {'range':<11}  {'fork server':>11}")
    for name in runs:
        label = name if name in REFERENCES else f"tasks.stages.{name}"
        line = f"  {label:<32} {median[name]:6.2f} s  {min(seconds[name]):.2f}-" \
               f"{max(seconds[name]):.2f}"
        if name in forked:
            line += f"  {median_forked[name]:9.2f} s"
        print(line)
    print(f"  {'these stages together':<32} {per_iteration:6.2f} s  {'':<9}  "
          f"{per_iteration_forked:9.2f} s")
    print(json.dumps({**head, "seconds": {k: round(v, 3) for k, v in median.items()},
                      "per_iteration": round(per_iteration, 3),
                      "forked": {k: round(v, 3) for k, v in median_forked.items()},
                      "per_iteration_forked": round(per_iteration_forked, 3)}))


if __name__ == "__main__":
    main()
