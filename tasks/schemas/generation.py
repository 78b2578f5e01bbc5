"""Sampling settings, shared by the sections that sample (`offpolicy`, `rollout`, `evaluate`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 16
