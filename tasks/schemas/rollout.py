"""On-policy sampling each iteration (`rollout:`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tasks.schemas.generation import GenerationParams


@dataclass(frozen=True)
class RolloutParams:
    n_prompts: int = 16             # prompts per iteration, a fresh window of the train prompts
    samples_per_prompt: int = 4     # K samples per prompt (pairs: the judge's highest against
                                    #   its lowest)
    generation: GenerationParams = field(default_factory=GenerationParams)
    workers: int = 1                # Ray workers sampling shards of the batches (1 = no Ray)
    offline: tuple[int, ...] = ()   # iterations that sample nothing: judge@k adds no pairs,
                                    #   train_rm@k and update@k (DPO) train on the pool they
                                    #   inherit (the mistake book: update.dpo.offline_pairs)
