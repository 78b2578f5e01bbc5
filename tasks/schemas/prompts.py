"""The prompt sets (`prompts:`): the versioned subject and template files, the split sizes."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptParams:
    subjects_file: str = "params/prompts/movies.txt"
    templates_file: str = "params/prompts/templates.txt"
    n_train: int = 32
    n_heldout: int = 16
