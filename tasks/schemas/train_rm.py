"""The reward model (`train_rm:`): Bradley-Terry fine-tuning or the probe."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TrainRMParams:
    lr: float = 1e-3
    epochs: int = 2
    batch_size: int = 16
    heldout_fraction: float = 0.2
    max_length: int = 96
    weight_decay: float = 0.0
    margin: float = 0.0             # Bradley-Terry margin m: -log sigma(r_c - r_r - m)
    ensemble: int = 1               # K members, differing by seed (head init, data order)
    audit_top_n: int = 8            # audit queue: new pairs the members disagree on most
    audit_random_n: int = 8         # audit queue: plus a seeded random sample of judge labels
    precision: Literal["auto", "fp32", "bf16"] = "fp32"  # bf16: autocast matmuls (training,
                                    # scoring); auto: bf16 where the CPU has native bf16 matmuls
    num_layers: int = 0             # keep the backbone's first N blocks (0 = all)
    num_layers_grid: tuple[int, ...] = ()   # probe alone: choose N from these with the L2, by
                                    # the same CV (no key, or < 5 prompts: num_layers as is)
    pooling: Literal["last", "mean"] = "last"     # the head reads the last token, or the mean
    head_init: Literal["random", "probe"] = "random"  # probe: fitted on frozen features first
    probe_l2: float = 0.1           # probe: L2 strength (on standardised features)
    probe_l2_grid: tuple[float, ...] = ()   # probe: choose the L2 from these by 5-fold CV
                                    # over the training prompts (empty: probe_l2 as is)
    processes: int = 1              # > 1: fine-tuning epochs on N ranks under torchrun (DDP)
