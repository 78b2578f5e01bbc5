"""AI judges (RLAIF): they turn responses into verdicts and, where they can, scores.

A judge compares two responses to one prompt and returns a Verdict: "A", "B", "tie" or
"invalid". Every comparison is shown in both orders (position swap); a judge that changes its
mind with the order gets "tie", never a coin flip. Judges that also score single responses
(pointwise judges) let the pipeline pick best-vs-worst of K samples.

Pointwise kinds (the lexicons) register in `JUDGES`, and `reward_model` (a trained RM's scores,
tasks/judging/judge_rm.py) is pointwise too; the pairwise LLM judges (`llm`: a local causal LM,
`http`: an OpenAI-compatible server) judge many comparisons at a time (`judge_pairs`). Every
kind is built by `make_judge` (tasks/judging/judge_factory.py).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from tasks.data.records import Prompt
from tasks.schemas.judge import JudgeParams

Verdict = Literal["A", "B", "tie", "invalid"]
VERDICTS: tuple[Verdict, ...] = ("A", "B", "tie", "invalid")


class PairwiseJudge(Protocol):
    kind: str
    version: str

    def compare(self, prompt: Prompt, first: str, second: str) -> Verdict:
        """Verdict on two responses in the order shown ("A" means `first` is better)."""
        ...


class PointwiseJudge(PairwiseJudge, Protocol):
    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float | None]:
        """A score per response (higher is better); None marks an invalid response."""
        ...


_FLIP: dict[Verdict, Verdict] = {"A": "B", "B": "A", "tie": "tie", "invalid": "invalid"}


def judge_pair(judge: PairwiseJudge, prompt: Prompt, a: str, b: str) -> Verdict:
    """Compare a and b in both orders; agreeing verdicts stand, disagreeing ones are a tie."""
    return swapped(judge.compare(prompt, a, b), judge.compare(prompt, b, a))


def swapped(forward: Verdict, reverse: Verdict) -> Verdict:
    """The verdict on (a, b) from `forward` = compare(a, b) and `reverse` = compare(b, a)."""
    backward = _FLIP[reverse]
    if "invalid" in (forward, backward):
        return "invalid"
    return forward if forward == backward else "tie"


def position_flipped(forward: Verdict, reverse: Verdict) -> bool:
    """Both orders answered, and the verdict changed with the order (position bias)."""
    backward = _FLIP[reverse]
    return "invalid" not in (forward, backward) and forward != backward


def judge_pairs(judge: PairwiseJudge, items: Sequence[tuple[Prompt, str, str]]
                ) -> list[tuple[Verdict, Verdict, Verdict]]:
    """(verdict, forward, reverse) for every (prompt, a, b): `judge_pair` for many at once.
    A judge with `compare_many` (the pairwise LLM judges) gets all 2N orders in one call."""
    orders = [(p, a, b) for p, a, b in items] + [(p, b, a) for p, a, b in items]
    many = getattr(judge, "compare_many", None)
    raw = many(orders) if many else [judge.compare(*o) for o in orders]
    n = len(items)
    return [(swapped(raw[i], raw[n + i]), raw[i], raw[n + i]) for i in range(n)]


@dataclass(frozen=True)
class LexiconJudge:
    """Sentiment by the VADER lexicon: the compound score of the response in [-1, 1].

    Hackable on purpose-free text (it rewards gushing words wherever they appear), which is
    why evaluation reports more than its win rate.
    """
    tie_margin: float
    min_words: int
    version: str
    kind: str = "lexicon"

    def __post_init__(self) -> None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        object.__setattr__(self, "_vader", SentimentIntensityAnalyzer())

    def _one(self, text: str) -> float | None:
        if len(text.split()) < self.min_words:
            return None
        return float(self._vader.polarity_scores(text)["compound"])  # type: ignore[attr-defined]

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float | None]:
        return [self._one(r) for r in responses]

    def compare(self, prompt: Prompt, first: str, second: str) -> Verdict:
        return verdict_from_scores(self._one(first), self._one(second), self.tie_margin)


_STOPWORDS = frozenset("a an and at by for from in into is it of on or the to with".split())


def title_words(prompt: Prompt, year: bool = True) -> frozenset[str]:
    """The subject's words in the last user message: capitalised words and numbers after the
    message's first word ("Write a short review of Dr. Strangelove (1964)." -> dr, strangelove,
    1964), lower-cased, punctuation stripped, stopwords dropped; without `year`, not the
    parenthesised year."""
    user = [m for m in prompt if m.role == "user"]
    words = user[-1].content.split()[1:] if user else []
    out = set()
    for w in words:
        if not year and w.startswith("(") and w.strip("().,;:!?").isdigit():
            continue
        w = w.strip(".,;:!?()\"'")
        if w and (w[0].isupper() or w.isdigit()) and w.lower() not in _STOPWORDS:
            out.add(w.lower())
    return frozenset(out)


def mentions(prompt: Prompt, response: str, match: str = "any") -> bool:
    """The response names the subject. `any`: it contains one of its title words as a word (the
    year counts: "A classic from 1964!"); `all`: every title word but the year ("Dr.
    Strangelove" for Dr. Strangelove (1964)), so that one common word of a title ("baby",
    "space") or its year does not pass for the film."""
    said = {w.strip(".,;:!?()\"'*").lower() for w in response.split()}
    if match == "any":
        return bool(title_words(prompt) & said)
    named = title_words(prompt, year=False)
    return bool(named) and named <= said


@dataclass(frozen=True)
class TopicLexiconJudge(LexiconJudge):
    """VADER sentiment, minus `off_topic_penalty` when the response does not name the subject
    (a title word from the prompt). A lexical check — deliberately not the gold evaluator's
    embedding model — that closes the cheapest hack of the plain lexicon (gushing thank-you
    notes about nothing)."""
    off_topic_penalty: float = 1.0
    kind: str = "lexicon_topic"
    title_match: str = "any"

    def _scored(self, prompt: Prompt, text: str) -> float | None:
        s = self._one(text)
        if s is None:
            return None
        return s if mentions(prompt, text, self.title_match) else s - self.off_topic_penalty

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float | None]:
        return [self._scored(p, r) for p, r in zip(prompts, responses)]

    def compare(self, prompt: Prompt, first: str, second: str) -> Verdict:
        return verdict_from_scores(self._scored(prompt, first), self._scored(prompt, second),
                                   self.tie_margin)


# Correspondence cues: a salutation or sign-off, thanks, talk about the conversation or the
# reader, an offer of help, a question put to the reader; and (v2, after reading seed 0's
# iteration-2 rollouts) announcements about the writer ("I'm thrilled to announce that I've
# completed a positive review of ...") and the assistant's maker named in the text. Written
# from what a review is not (the genres a review prompt can drift into), independently of the
# gold evaluator's classifier (tasks/evaluation/genre.py), which the loop never sees.
_CORRESPONDENCE = re.compile(r"""
    ^\W*(dear|hi|hello|hey|greetings)\b
  | \b(best|kind|warm)\ regards\b | \bsincerely\b | \byours\ truly\b | \[your\ name\]
  | \bthank(s|\ you)\b | \bgrateful\b | \bappreciate\ (you|your|it)\b
  | \b(i'm|i\ am)\ (so\ )?(glad|happy|thrilled|excited|delighted|sorry)
        \ (you|to\ (help|share|hear|assist))
  | \b(i'm|i\ am)\ (so\ |extremely\ )?(glad|happy|thrilled|excited|delighted|proud|pleased)
        \ to\ (announce|be|have|introduce|report\ that\ i)
  | \bannounc(e|es|ed|ing)\b
  | \b(i've|i\ have)\ (just\ )?(completed|written|dedicated|finished|posted|given)\b[^.!?]*\breview
  | \b(i'm|i\ am)\ (reviewing|writing|working\ on)\b
  | \bhugging\ ?face\b | \bsmollm\b
  | \bhope\ (this|you|my)\b | \bfinds\ you\b
  | \blet\ me\ know\b | \btell\ me\b
  | \byour\ (thoughts|opinion|recommendation|message|blog|question)
  | \bwhat\ do\ you\ think\b | \bfeel\ free\b | \bhappy\ to\ help\b | \bcan\ i\ help\b
  | \bas\ an\ ai\b | \bai\ (language\ )?(model|assistant|system)\b
  | \byou[^.!?]*\?
""", re.IGNORECASE | re.VERBOSE)


def correspondence(response: str) -> bool:
    """The response reads as a letter, an assistant's reply, a request for the reader's opinion
    or a thank-you note rather than a review: one lexical cue anywhere is enough."""
    return bool(_CORRESPONDENCE.search(response.replace("\u2019", "'")))


@dataclass(frozen=True)
class ReviewLexiconJudge(TopicLexiconJudge):
    """`lexicon_topic`, minus `register_penalty` when the response reads as correspondence
    (`correspondence`): the judge's own register check, so that the loop does not learn that a
    happy letter naming the film beats a review."""
    register_penalty: float = 1.0
    kind: str = "lexicon_review"

    def _scored(self, prompt: Prompt, text: str) -> float | None:
        s = super()._scored(prompt, text)
        return s if s is None or not correspondence(text) else s - self.register_penalty


def verdict_from_scores(a: float | None, b: float | None, tie_margin: float) -> Verdict:
    if a is None or b is None:
        return "invalid"
    if abs(a - b) < tie_margin:
        return "tie"
    return "A" if a > b else "B"


JUDGES: dict[str, Callable[[JudgeParams], PointwiseJudge]] = {
    "lexicon": lambda p: LexiconJudge(p.tie_margin, p.min_words, p.version),
    "lexicon_topic": lambda p: TopicLexiconJudge(p.tie_margin, p.min_words, p.version,
                                                 off_topic_penalty=p.off_topic_penalty,
                                                 title_match=p.title_match),
    "lexicon_review": lambda p: ReviewLexiconJudge(p.tie_margin, p.min_words, p.version,
                                                   off_topic_penalty=p.off_topic_penalty,
                                                   title_match=p.title_match,
                                                   register_penalty=p.register_penalty),
}


PAIRWISE_KINDS = ("llm", "http")


# the judge's keys that build it and shape its verdicts (judge_factory.make_judge): what a stage
# that only asks the judge for verdicts reads (evaluate). How the judge stage turns verdicts into
# pairs (pairs_per_prompt, pool_pairs, pool_margin, comparisons_per_prompt) and its workers are
# not among them: changing those reruns the judge stage, not evaluate.
BUILD_KEYS = ("kind", "version", "tie_margin", "min_words", "off_topic_penalty", "title_match",
              "register_penalty", "template", "model", "max_length", "decoding",
              "max_new_tokens", "max_concurrency", "timeout_s", "max_retries", "backoff_s")


def is_pointwise(judge: PairwiseJudge) -> bool:
    return getattr(judge, "pointwise", True) and hasattr(judge, "score")


def verdict_rates(verdicts: Sequence[Verdict]) -> dict[str, float]:
    """Counts and rates of each verdict, plus the sample size."""
    n = len(verdicts)
    out: dict[str, float] = {"n": float(n)}
    for v in VERDICTS:
        k = sum(1 for x in verdicts if x == v)
        out[f"n_{v}"] = float(k)
        out[f"rate_{v}"] = k / n if n else 0.0
    return out
