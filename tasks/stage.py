"""The thin edge every stage shares: argument parsing, params, threads, RNG, metrics files."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks import atomic, layout
from tasks.errors import InputError
from tasks.params import Params, load_params

THREADS_ENV = "ALIGNLOOP_THREADS"   # a machine setting, not an experiment param: not in params


@dataclass(frozen=True)
class StageArgs:
    params: Params
    root: Path
    it: int


def parse(argv: list[str] | None, description: str) -> StageArgs:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--it", type=int, default=0, help="iteration number (0: set-up stages)")
    ap.add_argument("--root", default=".", help="workspace root (default: current directory)")
    ns = ap.parse_args(argv)
    root = Path(ns.root).resolve()
    params = load_params(root / layout.PARAMS_FILE)
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, os.cpu_count() or 1)))
    torch.manual_seed(params.seed)      # implicit inits (a new reward head) are reproducible
    return StageArgs(params, root, ns.it)


def generator(seed: int, *salt: int) -> torch.Generator:
    """A torch RNG derived from the run seed and a stage-specific salt."""
    s = seed
    for x in salt:
        s = (s * 1_000_003 + x) % (2**63 - 1)
    return torch.Generator().manual_seed(s)


def write_metrics(root: Path, rel: str, metrics: dict[str, float]) -> None:
    atomic.write_json(root / rel, {k: float(v) for k, v in sorted(metrics.items())})


def run_main(body: Callable[[], None]) -> None:
    """Run a stage body; user errors print one clear line and exit 2, without a traceback."""
    try:
        body()
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
