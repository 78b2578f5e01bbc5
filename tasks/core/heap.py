"""glibc's malloc settings for stage processes: freed tensor memory is kept and reused.

glibc serves every allocation above its mmap threshold (at most 32 MB) with a fresh mapping
and unmaps it on free, so the next training step's tensor of the same size faults in every
page again, each one zeroed by the kernel. A DPO step on the default model makes ~1 GB of
such tensors (the (8, ~90, 49152) logits, fp32, their softmax and gradients): ~0.6M minor
faults and ~2 s of system time for two steps and the reference pass on 16 pairs. With mmap
off (`mmap_max=0`: large blocks come from the heap; glibc still maps memory when the heap
cannot grow) and the heap's top never given back (`trim_threshold`), freed blocks are reused
by later allocations. The arithmetic is untouched (same kernels, same order: losses equal to
the bit). Measured side by side (`python -m benchmarks.heap_ab`, fresh processes as stages
are): DPO update x1.32, PPO x1.11, the RM's two steps x1.00. The price: a process keeps its
peak heap until it exits, and the peak is higher (DPO 5.1 -> 5.9 GB, PPO 5.1 -> 5.5 GB).

glibc reads its tunables once, when a process starts, so `flows/dag.reproduce` puts them into
the environment while DVC runs a stage's command (the stage process and what it starts
inherit them; the caller's environment is as before afterwards). A GLIBC_TUNABLES the user
set, even empty, wins: `GLIBC_TUNABLES= alignloop run ...` runs the stages on glibc's
defaults. Not glibc (musl, macOS): nothing is set.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

ENV = "GLIBC_TUNABLES"
TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"  # 1 TiB: never


def is_glibc() -> bool:
    """Whether this Python runs on glibc (its processes' children do too)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False


def stage_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables to add to the environment of stage processes: the tunables, on glibc,
    unless the user set GLIBC_TUNABLES."""
    if ENV in environ or not is_glibc():
        return {}
    return {ENV: TUNABLES}


@contextlib.contextmanager
def for_stage_processes() -> Iterator[None]:
    """`stage_environment()` in os.environ for the duration (processes started inside inherit
    it), the environment as it was afterwards."""
    extra = stage_environment()
    os.environ.update(extra)
    try:
        yield
    finally:
        for key in extra:
            os.environ.pop(key, None)
