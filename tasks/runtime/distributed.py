"""Training on several processes (`update.processes`, `train_rm.processes`): the stage re-launches
itself under torchrun, and each rank trains on its shard of every global batch.

The global batches and their order are the single-process run's (every rank draws the same
randperm from the same seeded generator); rank r takes a disjoint slice of each, and its loss is
(sum over its slice of w_i * l_i) / |global batch|, so the gradients summed over ranks
(all_reduce) are the single-process gradient of mean_i(w_i * l_i). Every rank then takes the
same optimizer step from the same weights, so the weights stay identical on all ranks; only
rank 0 writes outputs. gloo for CPU tensors, NCCL for CUDA ones. With one process nothing here
runs: `SINGLE` leaves the single-process arithmetic exactly as it was.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

import tasks
from tasks.core.errors import InputError
from tasks.runtime.device import Device
from tasks.runtime.stage import THREADS_ENV

MARK_ENV = "ALIGNLOOP_DDP"                 # set by `relaunch`: this process is one of its ranks
LOSSES_ENV = "ALIGNLOOP_STEP_LOSSES"       # debug: rank 0 writes the per-step losses (JSON) here
REPO = Path(tasks.__file__).resolve().parent.parent   # where `-m tasks.stages.<stage>` imports from


class LaunchError(InputError):
    """A rank failed; its one-line error (or torchrun's last line) is the message."""


@dataclass(frozen=True)
class Group:
    """This process's place among the ranks; `SINGLE` is the one-process run."""
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, idx: Tensor) -> Tensor:
        """This rank's disjoint, contiguous slice of a global batch's indices (maybe empty)."""
        return idx if self.world == 1 else torch.tensor_split(idx, self.world)[self.rank]

    def batch_loss(self, weighted: Tensor, n: int) -> Tensor:
        """mean_i(w_i l_i) on one process; on several, this shard's sum / global batch size n."""
        return weighted.mean() if self.world == 1 else weighted.sum() / n

    def sum_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum the gradients over ranks (a rank with an empty shard contributes zeros)."""
        if self.world == 1:
            return
        for q in params:
            if q.requires_grad:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
                dist.all_reduce(q.grad)

    def owns(self, chunk: int) -> bool:
        """Whether this rank computes chunk number `chunk` of a no-grad pass (round robin)."""
        return chunk % self.world == self.rank

    def share(self, x: Tensor | None, n: int | tuple[int, ...], chunk: int,
              device: Device = "cpu") -> Tensor:
        """Chunk `chunk`'s result of shape n, computed by its owner, on every rank (as float32,
        on `device`: the owner's x is there, NCCL broadcasts only between CUDA tensors)."""
        if self.world == 1:
            assert x is not None
            return x
        t = x.detach().float().contiguous() if x is not None else torch.zeros(n, device=device)
        dist.broadcast(t, src=chunk % self.world)
        return t

    def total(self, x: Tensor) -> float:
        """A per-rank scalar summed over ranks (the batch loss: each rank's share of it)."""
        if self.world == 1:
            return x.item()
        t = x.detach().float().reshape(1).clone()
        dist.all_reduce(t)
        return t.item()

    def means(self, values: Sequence[Tensor], n: int | float) -> list[float]:
        """Batch means of per-example values (each (B_shard,)) over the global batch of n."""
        if self.world == 1:
            return [float(v.detach().mean()) for v in values]
        t = torch.stack([v.detach().float().sum() for v in values])
        dist.all_reduce(t)
        return (t / n).tolist()


SINGLE = Group()


def launched() -> bool:
    """True in a rank started by `relaunch` (not merely under some torchrun)."""
    return os.environ.get(MARK_ENV) == "1" and "WORLD_SIZE" in os.environ


def init() -> Group:
    """Join the process group; threads = machine threads / N. Collectives go by the tensor's
    device: gloo for CPU tensors, NCCL for CUDA ones when present. Each rank's current CUDA
    device is its LOCAL_RANK, so `device: cuda` (torch.device("cuda")) puts rank r on GPU r."""
    world = int(os.environ["WORLD_SIZE"])
    cores = int(os.environ.get(THREADS_ENV, os.cpu_count() or 1))
    torch.set_num_threads(max(1, cores // world))
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend)
    return Group(dist.get_rank(), world)


def close(g: Group) -> None:
    if g.world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _first_error(log: str) -> str:
    lines = [x.strip() for x in log.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error:")]
    return errors[0].removeprefix("error:").strip() if errors else (lines or ["no output"])[-1]


def relaunch(module: str, argv: Sequence[str], processes: int) -> None:
    """Run `python -m <module> <argv>` on `processes` ranks under torchrun and wait. Its stderr
    is replayed after the run (kept whole, so that a failure gives one line, not torchrun's
    traceback per rank)."""
    cores = int(os.environ.get(THREADS_ENV, os.cpu_count() or 1))
    env = {**os.environ, MARK_ENV: "1", "OMP_NUM_THREADS": str(max(1, cores // processes)),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(processes), "-m", module, *argv]
    with tempfile.TemporaryFile("w+", encoding="utf-8") as err:
        rc = subprocess.run(cmd, env=env, stderr=err, check=False).returncode
        err.seek(0)
        log = err.read()
    if rc != 0:
        raise LaunchError(f"{module} on {processes} processes: {_first_error(log)}")
    sys.stderr.write(log)


def enter(module: str, argv: Sequence[str] | None, processes: int) -> Group | None:
    """A stage edge's first step: with processes > 1, outside a rank, re-run the stage on that
    many ranks and return None (the stage is done); inside a rank, join the group; else SINGLE."""
    if processes > 1 and not launched():
        relaunch(module, sys.argv[1:] if argv is None else argv, processes)
        return None
    return init() if launched() else SINGLE


def record_losses(g: Group, losses: Sequence[float], seconds: float) -> None:
    """Debug side file for the equal-loss test and benchmarks/ddp_scaling.py: rank 0 writes the
    per-step losses and the training call's seconds where ALIGNLOOP_STEP_LOSSES says (outside
    the workspace; unset in a pipeline run)."""
    path = os.environ.get(LOSSES_ENV)
    if path and g.main:
        Path(path).write_text(json.dumps({"losses": list(losses), "train_s": seconds}),
                              encoding="utf-8")
