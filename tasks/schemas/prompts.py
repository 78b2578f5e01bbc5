"""The prompt sets (`prompts:`): the versioned subject and template files, the split sizes."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptParams:
    subjects_file: str = "params/prompts/movies.txt"  # one subject (movie) per line, versioned (a
                                    #   dep of the prompts stage)
    templates_file: str = "params/prompts/templates.txt"  # instruction templates with {movie},
                                    #   versioned
    n_train: int = 32               # prompts the loop samples from (a rotating window per
                                    #   iteration)
    n_heldout: int = 16             # prompts about other subjects, only for evaluation
    n_select: int = 0               # prompts about subjects in neither set, only for promotion
                                    #   decisions (candidate vs champion,
                                    # tasks/evaluation/headtohead.py):
                                    #   the subjects left after train and held-out, each with
                                    #   several templates when there are fewer; 0 = none
