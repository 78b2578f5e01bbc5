"""Is it a review? The gold evaluator's register check (evaluation only, like all of gold).

A response to "review movie X" can name the film, gush, read fluently and still not be a review:
a letter ("Dear Hugging Face, I hope this message finds you well..."), an assistant's reply to
the reader ("I'm glad you're excited about X!"), a request for the reader's opinion ("What do
you think?") or a thank-you note. The lexicon judge and the rest of gold cannot tell; this can.

How: every sentence of the response is embedded with all-MiniLM-L6-v2 (the gold embedder) and
scored by a logistic regression fitted, at load time, on hand-written sentences labelled
`review` or `correspondence` (`gold.register_examples_file`, versioned data under params/gold/).
The response's register score is the highest correspondence probability of its sentences: one
salutation, thank-you or "tell me what you think" makes the whole response correspondence. It is
a review when that score is below `gold.review_threshold`, calibrated on hand-labelled reference
and policy samples by `benchmarks/calibrate_genre.py` (its labelled set lives beside it).

The loop's judge has a register check of its own (a lexical one, tasks/judging/judges.py), built
separately: the loop never sees this classifier.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tasks.core import jsonl
from tasks.core.jsonl import DataError
from tasks.functional.logistic import fit_logistic

LABELS = ("review", "correspondence")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def sentences(text: str) -> list[str]:
    """The response's sentences (split after . ! ? and at line breaks), blanks dropped; a text
    without an end mark is one sentence."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def read_examples(path: Path) -> tuple[list[str], list[int]]:
    """(texts, labels) from JSONL rows {"text": ..., "label": "review" | "correspondence"};
    label 1 = correspondence. A bad row is a DataError naming file, line and field."""
    texts, labels = [], []
    for n, rec in jsonl.read(str(path)):
        text, label = rec.get("text"), rec.get("label")
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{path}:{n}: field 'text' must be a non-empty string")
        if label not in LABELS:
            raise DataError(f"{path}:{n}: field 'label' must be one of {', '.join(LABELS)}, "
                            f"got {label!r}")
        texts.append(text)
        labels.append(LABELS.index(label))
    if len(set(labels)) < 2:
        raise DataError(f"{path}: needs examples of both labels ({', '.join(LABELS)})")
    return texts, labels


@dataclass(frozen=True)
class RegisterClassifier:
    """Correspondence probability of sentences; `embed` maps texts to (N, D) unit vectors."""
    embed: Callable[[Sequence[str]], Tensor]
    weight: Tensor
    bias: Tensor

    @classmethod
    def fit(cls, embed: Callable[[Sequence[str]], Tensor], path: Path,
            l2: float) -> RegisterClassifier:
        texts, labels = read_examples(path)
        x = embed(texts)
        w, b = fit_logistic(x, torch.tensor(labels, dtype=torch.float32, device=x.device), l2)
        return cls(embed, w, b)

    @torch.no_grad()
    def register(self, responses: Sequence[str]) -> list[float]:
        """Per response, the highest correspondence probability of its sentences (0 for an
        empty response: nothing said is judged by fluency, not here)."""
        split = [sentences(r) for r in responses]
        flat = [s for ss in split for s in ss]
        probs = torch.sigmoid(self.embed(flat) @ self.weight + self.bias).tolist() \
            if flat else []
        out, k = [], 0
        for ss in split:
            out.append(max(probs[k: k + len(ss)], default=0.0))
            k += len(ss)
        return out
