"""The AI judge (`judge:`): its kind, identity and how its verdicts become pairs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class JudgeParams:
    kind: Literal["lexicon", "lexicon_topic", "lexicon_review", "llm", "http",
                  "reward_model"] = "lexicon"
    version: str = "vader-v1"      # lexicon kinds: their identity (llm/http: model+template md5,
                                   #   reward_model: its directory name and weights md5)
    tie_margin: float = 0.05       # |score_a - score_b| below this is a tie
    min_words: int = 1             # responses with fewer words are judged invalid
    off_topic_penalty: float = 1.0  # lexicon_topic: subtracted when no title word is mentioned
    register_penalty: float = 1.0   # lexicon_review: subtracted when it reads as correspondence
    pairs_per_prompt: int = 1      # i-th best vs i-th worst of K, i < this (disjoint ranks)
    pool_pairs: Literal["ranked", "all"] = "ranked"   # the RM's pairs: DPO's, or every pair
    pool_margin: float = 0.2       # all: score gap a pair needs (at least tie_margin)
    template: str = "params/judges/pairwise_review.txt"  # llm/http: the versioned prompt
    model: str = ""                # llm: a local HF model directory; http: the model name ("" =
                                   #   the one the server lists first in /v1/models);
                                   #   reward_model: a reward-model directory
    max_length: int = 512          # reward_model: tokens kept of the prompt and of the response
    decoding: Literal["greedy", "logprob"] = "greedy"   # llm: generate, or argmax of verdict log-probs
    max_new_tokens: int = 4        # llm greedy / http: reply length cap (a verdict is one word)
    comparisons_per_prompt: int = 4  # llm/http: seeded pairs of the K samples compared per prompt
    max_concurrency: int = 4       # http: requests in flight at once
    timeout_s: float = 60.0        # http: per request
    max_retries: int = 3           # http: retries on 429, 5xx and timeouts (then: invalid)
    backoff_s: float = 1.0         # http: first retry delay, doubled on each further retry
    workers: int = 1               # Ray workers judging shards of the prompts (1 = no Ray);
                                   #   pointwise kinds (lexicons, reward_model) only
