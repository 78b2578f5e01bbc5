"""The records that flow between stages, and their strict parsing from stored JSON.

Preference pairs are accepted in every TRL preference format: standard or conversational, with
an explicit or an implicit prompt (Anthropic-HH dialogues included); tasks/data/pair_formats.py
rewrites the implicit ones into the explicit form:
- standard:        {"prompt": str, "chosen": str, "rejected": str}
- conversational:  {"prompt": [{"role", "content"}...], "chosen": [{"role": "assistant", ...}],
                    "rejected": [...]}
Both normalise to a PreferencePair whose prompt is a tuple of chat messages.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.core.jsonl import DataError
from tasks.data.pair_formats import explicit
from tasks.schemas.generation import GenerationParams

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Message:
    role: str
    content: str


Prompt = tuple[Message, ...]


@dataclass(frozen=True)
class Sampled:
    """The tokens a policy sampled for a response: ids as drawn (ending with EOS when it
    finished; a response cut at max_new_tokens has none), whether it finished, and the
    sampler's log-prob of each id (the behaviour policy's, as drawn: its temperature and
    nucleus included; empty when not recorded), which off-policy reuse weighs against."""
    ids: tuple[int, ...]
    finished: bool
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class PreferencePair:
    """A preference; judged pairs of rollouts also carry each side's sampled tokens, so that
    training sees the sequences the policy produced (imported text pairs are tokenised).

    `sampled` is keyed by the response text: a pair whose sides are exchanged
    (`replace(pair, chosen=pair.rejected, rejected=pair.chosen)`, as an audit swap does) keeps
    every text with its own tokens. Stored as chosen_ids / rejected_ids / chosen_finished /
    rejected_finished, present only when sampled, and chosen_logprobs / rejected_logprobs,
    present only when both sides' sampler log-probs are known."""
    prompt: Prompt
    chosen: str
    rejected: str
    source: str                                  # "import", "cold_start", "iter_3", ...
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    sampled: dict[str, Sampled] = field(default_factory=dict, hash=False)

    def tokens(self, text: str) -> Sampled | None:
        """The sampled tokens of one side's text (None: text only, e.g. imported)."""
        return self.sampled.get(text)

    def to_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"prompt": prompt_to_record(self.prompt), "chosen": self.chosen,
                               "rejected": self.rejected, "source": self.source}
        c, r = self.tokens(self.chosen), self.tokens(self.rejected)
        if c is not None and r is not None:
            rec.update({"chosen_ids": list(c.ids), "rejected_ids": list(r.ids),
                        "chosen_finished": c.finished, "rejected_finished": r.finished})
            if c.logprobs and r.logprobs:
                rec.update({"chosen_logprobs": list(c.logprobs),
                            "rejected_logprobs": list(r.logprobs)})
        return {**rec, "meta": self.meta}


@dataclass(frozen=True)
class Rollout:
    """One sampled response with everything needed to reuse it later off-policy."""
    prompt_id: str
    prompt: Prompt
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]       # sampler's per-token log-probs, one per response token
    finished: bool                    # True: ended with EOS; False: truncated at max_new_tokens
    text: str
    policy: str                       # version of the policy that sampled it (md5 of its weights)
    iteration: int
    sampling: GenerationParams = field(default_factory=GenerationParams, hash=False,
                                       compare=False)   # the settings it was drawn with

    def to_record(self) -> dict[str, Any]:
        return {"prompt_id": self.prompt_id, "prompt": prompt_to_record(self.prompt),
                "prompt_ids": list(self.prompt_ids), "response_ids": list(self.response_ids),
                "logprobs": list(self.logprobs), "finished": self.finished, "text": self.text,
                "policy": self.policy, "iteration": self.iteration,
                "sampling": dataclasses.asdict(self.sampling)}


def with_sampler_logprobs(pairs: Sequence[PreferencePair], rollouts: Sequence[Rollout]
                          ) -> list[PreferencePair]:
    """The pairs with each sampled side's per-token sampler log-probs, from the rollout that
    drew it (the same prompt id, `meta.prompt_id`, and ids): what off-policy reuse weighs the
    pair by later. A side no rollout matches keeps what it has."""
    found = {(r.prompt_id, r.response_ids): r.logprobs for r in rollouts}
    out = []
    for p in pairs:
        pid = str(p.meta.get("prompt_id"))
        sampled = {text: dataclasses.replace(s, logprobs=found.get((pid, s.ids), s.logprobs))
                   for text, s in p.sampled.items()}
        out.append(dataclasses.replace(p, sampled=sampled))
    return out


def prompt_to_record(prompt: Prompt) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in prompt]


def _where(source: str, line: int) -> str:
    return f"{source}:{line}"


def _text(rec: dict[str, Any], key: str, where: str) -> str:
    if key not in rec:
        raise DataError(f"{where}: missing field '{key}'")
    value = rec[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field '{key}' is empty")
    return value


def _messages(value: Any, key: str, where: str) -> Prompt:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field '{key}' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m:
            raise DataError(f"{where}: field '{key}[{i}]' must be an object with role and content")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: field '{key}[{i}].role' must be one of {ROLES}, "
                            f"got {m['role']!r}")
        out.append(Message(m["role"], _content(m, key, i, where)))
    return tuple(out)


def _content(m: dict[str, Any], key: str, i: int, where: str) -> str:
    c = m.get("content")
    if not isinstance(c, str) or not c.strip():
        raise DataError(f"{where}: field '{key}[{i}].content' must be a non-empty string")
    return c


def parse_prompt(rec: dict[str, Any], where: str, key: str = "prompt") -> Prompt:
    if key not in rec:
        raise DataError(f"{where}: missing field '{key}'")
    if isinstance(rec[key], str):
        return (Message("user", _text(rec, key, where)),)
    return _messages(rec[key], key, where)


def _completion(rec: dict[str, Any], key: str, where: str) -> str:
    if key not in rec:
        raise DataError(f"{where}: missing field '{key}'")
    if isinstance(rec[key], str):
        return _text(rec, key, where)
    msgs = _messages(rec[key], key, where)
    if len(msgs) != 1 or msgs[0].role != "assistant":
        raise DataError(f"{where}: field '{key}' must hold exactly one assistant message "
                        "(the one reply that follows the prompt)")
    return msgs[0].content


def parse_pair(rec: dict[str, Any], source: str, line: int, default_source: str,
               where: str | None = None) -> PreferencePair:
    """Normalise one stored pair; `where` overrides the "source:line" prefix of errors."""
    where = where or _where(source, line)
    rec = explicit(rec, where)                  # implicit-prompt formats -> explicit prompt
    prompt = parse_prompt(rec, where)
    chosen, rejected = _completion(rec, "chosen", where), _completion(rec, "rejected", where)
    meta = rec.get("meta", {})
    if not isinstance(meta, dict):
        raise DataError(f"{where}: field 'meta' must be an object")
    return PreferencePair(prompt, chosen, rejected, str(rec.get("source", default_source)), meta,
                          _sampled(rec, chosen, rejected, where))


SAMPLED_KEYS = ("chosen_ids", "rejected_ids", "chosen_finished", "rejected_finished")
LOGPROB_KEYS = ("chosen_logprobs", "rejected_logprobs")   # optional, both or neither


def _sampled(rec: dict[str, Any], chosen: str, rejected: str, where: str) -> dict[str, Sampled]:
    """A stored pair's sampled tokens: all four SAMPLED_KEYS or none (a text-only pair), and
    with them both LOGPROB_KEYS or neither (one number per id)."""
    present = [k for k in SAMPLED_KEYS if k in rec]
    if not present:
        if any(k in rec for k in LOGPROB_KEYS):
            key = next(k for k in LOGPROB_KEYS if k in rec)
            raise DataError(f"{where}: field '{key}' without sampled tokens (log-probs need "
                            f"{', '.join(SAMPLED_KEYS)})")
        return {}
    if len(present) < len(SAMPLED_KEYS):
        missing = [k for k in SAMPLED_KEYS if k not in rec]
        raise DataError(f"{where}: field '{missing[0]}' missing (sampled tokens need all of "
                        f"{', '.join(SAMPLED_KEYS)})")
    out = {}
    for side, text in (("chosen", chosen), ("rejected", rejected)):
        ids, finished = rec[f"{side}_ids"], rec[f"{side}_finished"]
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise DataError(f"{where}: field '{side}_ids' must be a non-empty list of token ids")
        if not isinstance(finished, bool):
            raise DataError(f"{where}: field '{side}_finished' must be true or false")
        out[text] = Sampled(tuple(ids), finished, _logprobs(rec, side, len(ids), where))
    return out


def _logprobs(rec: dict[str, Any], side: str, n: int, where: str) -> tuple[float, ...]:
    """One side's sampler log-probs: a list of n finite numbers <= 0, or () when the pair
    records none (both sides or neither)."""
    present = [k for k in LOGPROB_KEYS if k in rec]
    if not present:
        return ()
    if len(present) == 1:
        missing = next(k for k in LOGPROB_KEYS if k not in rec)
        raise DataError(f"{where}: field '{missing}' missing (log-probs are stored for both "
                        "sides or neither)")
    key, value = f"{side}_logprobs", rec[f"{side}_logprobs"]
    if not isinstance(value, list) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and x <= 0 for x in value):
        raise DataError(f"{where}: field '{key}' must be a list of finite log-probs (<= 0)")
    if len(value) != n:
        raise DataError(f"{where}: field '{key}' has {len(value)} entries for {n} sampled ids")
    return tuple(float(x) for x in value)


def parse_sampling(value: Any, where: str) -> GenerationParams:
    """A rollout's stored sampling settings: every field of GenerationParams, of its type."""
    if not isinstance(value, dict):
        raise DataError(f"{where}: field 'sampling' must be a mapping of the sampling settings")
    fields = {f.name: f for f in dataclasses.fields(GenerationParams)}
    for name in sorted(set(fields) | set(value)):
        if name not in fields:
            raise DataError(f"{where}: field 'sampling.{name}' is not a sampling setting "
                            f"(have: {', '.join(fields)})")
        if name not in value:
            raise DataError(f"{where}: missing field 'sampling.{name}'")
        v, whole = value[name], fields[name].type == "int"    # the annotations are strings
        if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)):
            raise DataError(f"{where}: field 'sampling.{name}' must be "
                            f"{'an integer' if whole else 'a number'}, got {v!r}")
    return GenerationParams(**{k: v if fields[k].type == "int" else float(v)
                               for k, v in value.items()})


def parse_rollout(rec: dict[str, Any], source: str, line: int) -> Rollout:
    where = _where(source, line)
    if "sampling" not in rec:
        raise DataError(f"{where}: missing field 'sampling'")
    sampling = parse_sampling(rec["sampling"], where)
    try:
        r = Rollout(
            prompt_id=str(rec["prompt_id"]), prompt=parse_prompt(rec, where),
            prompt_ids=tuple(int(t) for t in rec["prompt_ids"]),
            response_ids=tuple(int(t) for t in rec["response_ids"]),
            logprobs=tuple(float(x) for x in rec["logprobs"]), finished=bool(rec["finished"]),
            text=str(rec["text"]), policy=str(rec["policy"]), iteration=int(rec["iteration"]),
            sampling=sampling)
    except KeyError as e:
        raise DataError(f"{where}: missing field '{e.args[0]}'") from None
    except (TypeError, ValueError) as e:
        raise DataError(f"{where}: malformed rollout: {e}") from None
    if len(r.logprobs) != len(r.response_ids):
        raise DataError(f"{where}: field 'logprobs' has {len(r.logprobs)} entries for "
                        f"{len(r.response_ids)} response tokens")
    return r
