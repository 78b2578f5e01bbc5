"""The off-policy cold start or import (`offpolicy:`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tasks.schemas.generation import GenerationParams


@dataclass(frozen=True)
class OffpolicyParams:
    source: Literal["cold_start", "import"] = "cold_start"
    import_path: str = "data/import/pairs.jsonl"   # JSONL file or a saved HF datasets directory
    n_prompts: int = 16
    samples_per_prompt: int = 4
    generation: GenerationParams = field(default_factory=GenerationParams)
