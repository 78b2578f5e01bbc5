"""The off-policy cold start or import (`offpolicy:`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tasks.schemas.generation import GenerationParams


@dataclass(frozen=True)
class OffpolicyParams:
    source: Literal["cold_start", "import"] = "cold_start"  # cold_start (sample the initial model,
                                    #   judge) | import (your pairs: `alignloop import`)
    import_path: str = "data/import/pairs.jsonl"  # import only: a JSONL file or a saved HF
                                    #   datasets directory
    n_prompts: int = 16             # cold_start: prompts to sample
    samples_per_prompt: int = 4     # cold_start: K responses per prompt; best vs worst become a
                                    #   pair
    generation: GenerationParams = field(default_factory=GenerationParams)
