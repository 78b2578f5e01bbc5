"""The AI judge (`judge:`): its kind, identity and how its verdicts become pairs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class JudgeParams:
    kind: Literal["lexicon", "lexicon_topic", "lexicon_review", "llm", "http",
                  "reward_model"] = "lexicon"  # lexicon (VADER) | lexicon_topic (VADER, penalised
                                    #   unless the response names the subject: a lexical check, not
                                    #   the gold embedder) | lexicon_review (lexicon_topic, also
                                    #   penalised when it reads as a letter, a reply or a request:
                                    #   lexical cues, not gold's check) | llm | http (pairwise LLM
                                    #   judges: a local model, or an OpenAI-compatible server) |
                                    #   reward_model (a trained RM's scores, judge.model: its
                                    #   directory)
    version: str = "vader-v1"       # lexicon kinds: their identity, recorded with every label and
                                    #   registered model (llm/http: model + template md5;
                                    #   reward_model: its directory name and weights md5)
    tie_margin: float = 0.05        # score gaps (|score_a - score_b|) below this are ties, not
                                    #   preferences
    min_words: int = 1              # responses with fewer words are judged invalid
    off_topic_penalty: float = 1.0  # lexicon_topic: subtracted when the response does not name
                                    #   the subject (title_match)
    title_match: Literal["any", "all"] = "any"  # lexicon_topic / lexicon_review: a response
                                    #   names the subject with any one title word (the year
                                    #   counts) | all of them but the year
    register_penalty: float = 1.0   # lexicon_review: subtracted when the response reads as
                                    #   correspondence
    pairs_per_prompt: int = 1       # pairs per prompt: i-th best vs i-th worst of the K samples,
                                    #   i < this (disjoint ranks)
    pool_pairs: Literal["ranked", "all"] = "ranked"  # the reward model's pairs: ranked (DPO's) |
                                    #   all (every pair of the K samples whose scores differ by
                                    #   pool_margin: ~10x more pairs)
    pool_margin: float = 0.2        # all: the score gap a pair needs (at least tie_margin)
    template: str = "params/judges/pairwise_review.txt"  # llm / http: the versioned pairwise
                                    #   prompt
    model: str = ""                 # llm: a local HF model directory; http: the served model's
                                    #   name ("" = the one the server lists first in /v1/models);
                                    #   reward_model: a reward-model directory
    max_length: int = 512           # reward_model: tokens kept of the prompt and of the response
    decoding: Literal["greedy", "logprob"] = "greedy"  # llm: greedy (generate) | logprob (argmax
                                    #   of the verdicts' log-probs)
    max_new_tokens: int = 4         # llm greedy / http: reply length cap (a verdict is one word)
    comparisons_per_prompt: int = 4  # llm / http: seeded pairs of the K samples compared per
                                    #   prompt
    max_concurrency: int = 4        # http: requests in flight at once
    timeout_s: float = 60.0         # http: seconds per request
    max_retries: int = 3            # http: retries on 429, 5xx and timeouts (then: invalid)
    backoff_s: float = 1.0          # http: first retry delay, doubled on each further retry
    max_requests_per_tick: int = 0  # http: requests one run of a `judge` stage may send (a tick
                                    #   runs one), counted from its rollouts, the audited pairs
                                    #   and the verdict cache before any is sent; more fails the
                                    #   stage, and the run, before judging. Retries (429, 5xx,
                                    #   timeouts) are not counted. 0 = no limit
    workers: int = 1                # Ray workers judging shards of the prompts (1 = no Ray);
                                    #   pointwise kinds (lexicons, reward_model) only
