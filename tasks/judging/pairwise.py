"""Pairwise AI judges (`judge.kind: llm | http`): a versioned template, a strict parser, a
verdict cache, and the counters every judge report needs.

A pairwise judge renders (prompt, first, second) through a template file from params/judges/, asks a
backend (a local causal LM, or an OpenAI-compatible server) and parses the reply into "A" | "B" |
"tie" | "invalid"; the caller shows both orders (tasks/judging/judges.py: `judge_pairs`). Its
identity is model + template md5 + decoding: recorded in every pair's meta and keying the persistent
verdict cache, so a killed stage resumes and a rerun pays nothing. A reply that never came (timeouts
and server errors after the retries) is `invalid`, counted, and not cached: the next run asks again.
A pairwise judge has no pointwise score.
"""
from __future__ import annotations

import hashlib
import os
import re
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Protocol

from tasks.core import layout
from tasks.core.errors import InputError
from tasks.data.records import Prompt
from tasks.judging.judges import Verdict
from tasks.judging.verdict_cache import VerdictCache, cache_key

CRASH_ENV = "ALIGNLOOP_JUDGE_CRASH_AFTER"   # tests only: SIGKILL after N cached batches
SLOTS = ("prompt", "first", "second")
_SLOT = re.compile(r"\{(prompt|first|second)\}")
_PREFIX = re.compile(r"^(verdict|answer|winner|better)\s*[:\-]\s*", re.IGNORECASE)


@dataclass(frozen=True)
class Template:
    """A judge prompt with the slots {prompt}, {first} and {second}; md5 of its bytes."""
    text: str
    md5: str
    path: str

    def render(self, prompt: Prompt, first: str, second: str) -> str:
        values = {"prompt": prompt_text(prompt), "first": first, "second": second}
        return _SLOT.sub(lambda m: values[m.group(1)], self.text)   # one pass: values stay literal


def load_template(root: Path, rel: str) -> Template:
    path = root / rel
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: judge template not found (judge.template)") from None
    text = data.decode("utf-8")
    missing = [s for s in SLOTS if "{" + s + "}" not in text]
    if missing:
        raise InputError(f"{path}: judge template lacks the slot(s) "
                         + ", ".join("{" + s + "}" for s in missing))
    return Template(text, hashlib.md5(data).hexdigest(), rel)


def prompt_text(prompt: Prompt) -> str:
    """The request the responses answer: its user turns (the system prompt is the policy's)."""
    turns = [m for m in prompt if m.role != "system"]
    if len(turns) == 1:
        return turns[0].content
    return "\n".join(f"{m.role}: {m.content}" for m in turns)


def parse_verdict(reply: str) -> Verdict:
    """Strict: the reply's first non-empty line must be exactly one verdict word, optionally
    after "Verdict:"/"Answer:", wrapped in quotes, brackets or bold, with a final period.
    "A", "b.", "**Tie**", "Answer: [[B]]" parse; "A because ...", "A or B", "" are invalid."""
    lines = [x.strip() for x in reply.strip().splitlines() if x.strip()]
    if not lines:
        return "invalid"
    word = _PREFIX.sub("", lines[0]).strip()
    word = word.rstrip(".").strip().strip("*\"'`[]()").strip().lower()
    return {"a": "A", "b": "B", "tie": "tie"}.get(word, "invalid")


@dataclass(frozen=True)
class Reply:
    """One backend answer. `answered` is False when no reply came (after retries): such a
    verdict is `invalid` and never cached."""
    verdict: Verdict
    text: str = ""
    answered: bool = True
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Backend(Protocol):
    def ask_many(self, texts: Sequence[str], stats: JudgeStats) -> list[Reply]:
        """One reply per rendered judge prompt, in order."""
        ...


@dataclass
class JudgeStats:
    """Counters of one judge over a stage run (thread-safe increments)."""
    comparisons: int = 0        # one order of one pair
    cache_hits: int = 0
    cache_misses: int = 0
    requests: int = 0           # HTTP requests sent (retries included) or local LM prompts
    retries: int = 0
    failed: int = 0             # no reply after the retries: invalid, not cached
    timeouts: int = 0           # requests that timed out (retried or not)
    unparsed: int = 0           # replies the strict parser refused: invalid
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _last_error: str = field(default="", repr=False, compare=False)

    def note_error(self, text: str) -> None:
        """The last failed request's message, for the error a judge that never answers raises."""
        self._last_error = text

    def add(self, **counts: float) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def check_answered(self, where: str) -> None:
        """Refuse a run in which the judge answered none of the comparisons it was asked
        (server down, wrong URL or key): that is no verdict on the responses but a broken
        endpoint, and an iteration trained on nothing. Verdicts already cached are kept."""
        if self.cache_misses and self.failed == self.cache_misses:
            raise JudgeUnavailable(f"{where}: the judge answered none of {self.cache_misses} "
                                   f"comparisons ({self.requests} requests, {self.timeouts} "
                                   f"timed out; last: {self._last_error or 'no reply'})")

    def summary(self) -> str:
        return (f"{self.comparisons} comparisons, {self.cache_hits} from the cache, "
                f"{self.requests} requests ({self.retries} retries, {self.failed} unanswered, "
                f"{self.unparsed} unparsable), {self.prompt_tokens + self.completion_tokens} "
                f"tokens, {self.seconds:.1f} s")

    def metrics(self, prefix: str) -> dict[str, float]:
        out = {f"{prefix}{f.name}": float(getattr(self, f.name))
               for f in fields(self) if not f.name.startswith("_")}
        out[f"{prefix}tokens"] = float(self.prompt_tokens + self.completion_tokens)
        return out


class PairwiseLLMJudge:
    """A pairwise judge: template + backend + cache. `compare` is one order; `compare_many`
    asks for many at once (a backend may run them concurrently), cached per batch."""
    pointwise = False

    def __init__(self, kind: str, model: str, decoding: str, template: Template,
                 backend: Backend, cache: VerdictCache | None, batch_size: int = 64):
        self.kind, self.template, self.backend, self.cache = kind, template, backend, cache
        self.version = f"{model}|template={template.md5}|{decoding}"   # the judge's identity
        self.batch_size = batch_size
        self.stats = JudgeStats()
        self._batches = 0

    def compare(self, prompt: Prompt, first: str, second: str) -> Verdict:
        return self.compare_many([(prompt, first, second)])[0]

    def uncached(self, items: Sequence[tuple[Prompt, str, str]]) -> int:
        """How many requests `compare_many(items)` would send: distinct orders its cache
        lacks (asks nothing)."""
        keys = {cache_key(self.version, p, a, b) for p, a, b in items}
        hits = self.cache.get_many(sorted(keys)) if self.cache is not None else {}
        return len(keys - hits.keys())

    def compare_many(self, items: Sequence[tuple[Prompt, str, str]]) -> list[Verdict]:
        start = time.monotonic()
        keys = [cache_key(self.version, p, a, b) for p, a, b in items]
        out: list[Verdict | None] = [None] * len(items)
        hits = self.cache.get_many(keys) if self.cache is not None else {}
        todo, asked = [], set()
        for i, k in enumerate(keys):
            if k in hits:
                out[i] = hits[k]        # type: ignore[assignment]
            elif k not in asked:        # the same order twice in one call: asked once
                todo.append(i)
                asked.add(k)
        self.stats.add(comparisons=len(items), cache_hits=sum(k in hits for k in keys),
                       cache_misses=len(todo))
        for s in range(0, len(todo), self.batch_size):   # 1. ask, 2. store: one batch at a time
            chunk = todo[s: s + self.batch_size]
            replies = self.backend.ask_many([self.template.render(*items[i]) for i in chunk],
                                            self.stats)
            for i, r in zip(chunk, replies):
                out[i] = r.verdict
            self.stats.add(unparsed=sum(r.answered and r.verdict == "invalid" for r in replies),
                           failed=sum(not r.answered for r in replies))
            errors = [r.text for r in replies if not r.answered]
            if errors:
                self.stats.note_error(errors[-1])
            if self.cache is not None:
                self.cache.put_many([(keys[i], r.verdict, r.text)
                                     for i, r in zip(chunk, replies) if r.answered])
            self._batches += 1
            if os.environ.get(CRASH_ENV) == str(self._batches):   # as a kill -9 would
                os.kill(os.getpid(), signal.SIGKILL)
        by_key = {keys[i]: out[i] for i in todo}          # duplicates inside one call
        self.stats.add(seconds=time.monotonic() - start)
        return [v if v is not None else by_key[keys[i]] for i, v in enumerate(out)]  # type: ignore[misc]


class JudgeUnavailable(InputError):
    """The judge's endpoint answered nothing: one line, exit 2, nothing written."""


def cache_path(root: Path, identity: str) -> Path:
    digest = hashlib.sha256(identity.encode()).hexdigest()[:20]
    return root / layout.JUDGE_CACHE_DIR / f"{digest}.sqlite"
