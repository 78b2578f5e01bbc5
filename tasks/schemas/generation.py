"""Sampling settings, shared by the sections that sample (`offpolicy`, `rollout`, `evaluate`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 16        # response length cap (responses cut there are flagged: no EOS)
    temperature: float = 1.0        # sampling temperature (PPO's ratio compares untempered
                                    #   policies: keep 1.0 for it; it refuses a batch drawn at two
                                    #   temperatures)
    top_p: float = 1.0              # nucleus mass (1.0 = off)
    batch_size: int = 16            # sequences sampled together (a shard per core)

    @property
    def untempered(self) -> bool:
        """Sampled at temperature 1 without a nucleus: a sample's stored per-token log-probs
        are the policy's own (within the sampler's 1e-3 of a full forward pass)."""
        return self.temperature == 1.0 and self.top_p >= 1.0
