"""This machine's matmul peak, measured with torch at the thread count the stages use.

The peak is the best sustained GFLOP/s of square `n x n @ n x n` matmuls (2 n^3 FLOPs each)
over a few timed repeats after a warm-up, in fp32 and in bf16. It is the denominator of every
model-FLOP utilisation (MFU) figure in this harness, measured in the same run so that load from
other processes on the machine weighs on both sides of the ratio alike.
"""
from __future__ import annotations

import time

import torch

from tasks.models import lm


def matmul_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5, inner: int = 3) -> float:
    """Best GFLOP/s over `repeats` timings of `inner` back-to-back n^3 matmuls."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.matmul(a, b, out=out)                          # warm-up (kernel selection, pages)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.matmul(a, b, out=out)
        best = min(best, (time.perf_counter() - t0) / inner)
    return 2.0 * n**3 / best / 1e9


def measure_peaks(n: int = 2048, repeats: int = 5) -> dict[str, float]:
    """{"fp32_gflops", "bf16_gflops", "bf16_native", "threads", "n"} at the current torch
    thread count. Without native bf16 kernels (tasks/models/lm.py: native_bf16) bf16 is timed at
    n = 256 (torch's reference kernels: ~1 GFLOP/s, minutes at n = 2048)."""
    native = lm.native_bf16()
    return {"fp32_gflops": round(matmul_gflops(torch.float32, n, repeats), 1),
            "bf16_gflops": round(matmul_gflops(torch.bfloat16, n if native else 256,
                                               repeats if native else 2,
                                               1 if not native else 3), 1),
            "bf16_native": float(native), "threads": torch.get_num_threads(), "n": n}
