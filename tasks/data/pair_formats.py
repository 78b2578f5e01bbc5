"""TRL's preference formats, rewritten into the one explicit form `records.parse_pair` reads.

Accepted (https://huggingface.co/docs/trl/dataset_formats):
- standard, explicit prompt:        {"prompt": str, "chosen": str, "rejected": str}
- conversational, explicit prompt:  {"prompt": [messages], "chosen": [one assistant message], ...}
- standard, implicit prompt:        {"chosen": str, "rejected": str}, the prompt being their
  shared beginning; Anthropic-HH dialogues ("\\n\\nHuman: ...\\n\\nAssistant: ...") are turned
  into user/assistant messages, so the prompt goes through the model's chat template;
- conversational, implicit prompt:  {"chosen": [messages], "rejected": [messages]}, the prompt
  being the messages both start with.

Extraction follows TRL's `extract_prompt`: the prompt is the longest common prefix (characters
or whole messages); a space just before the first difference goes to the completions. HH text
instead cuts the common prefix back to its last "\\n\\nAssistant:", so a response that happens to
start with the same words as the other stays whole. As in TRL's `maybe_extract_prompt`, a
`prompt` whose kind (text or messages) differs from the completions' is ignored and extracted
again from them. Messages may carry extra keys whose value is None (HF `datasets` unifies the
schema of every row and adds them); any other extra key is an error.

Pure functions on plain records: no I/O. Errors are DataError naming `where` and the field.
"""
from __future__ import annotations

import re
from typing import Any

from tasks.core.jsonl import DataError

MESSAGE_KEYS = ("role", "content")
HH_ASSISTANT = "\n\nAssistant:"
HH_TURN = re.compile(r"\n\n(Human|Assistant):")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}

Messages = list[dict[str, Any]]


class IdenticalPair(DataError):
    """`chosen` equals `rejected`: no preference to learn (importers count and skip these)."""


def explicit(rec: dict[str, Any], where: str) -> dict[str, Any]:
    """`rec` in any accepted format -> the same record with an explicit `prompt` (text or
    messages) and `chosen` / `rejected` completions; other keys are kept. An implicit-prompt
    pair whose two sides are identical raises IdenticalPair (there is no prompt to extract);
    an explicit one is returned as it is."""
    out = dict(rec)
    for key in ("prompt", "chosen", "rejected"):
        if isinstance(out.get(key), list):
            out[key] = clean_messages(out[key], key, where)
    chosen, rejected, prompt = out.get("chosen"), out.get("rejected"), out.get("prompt")
    if prompt is not None and not _mixed(prompt, chosen, rejected):
        return out                                    # explicit prompt, nothing to extract
    out.pop("prompt", None)
    for key in ("chosen", "rejected"):
        if key not in rec:
            raise DataError(f"{where}: missing field '{key}'")
    if isinstance(chosen, str) and isinstance(rejected, str):
        out.update(_text_implicit(chosen, rejected, where))
    elif isinstance(chosen, list) and isinstance(rejected, list):
        out.update(conversation_implicit(chosen, rejected, where))
    elif prompt is None:
        raise DataError(f"{where}: missing field 'prompt' (and 'chosen' and 'rejected' are "
                        "not both text or both message lists, to extract it from)")
    return out


def _mixed(prompt: Any, chosen: Any, rejected: Any) -> bool:
    """TRL's rule: a text prompt beside whole conversations (or the reverse) is not the
    prompt of these completions. Completions of one assistant message after a text prompt
    are the explicit form, as before."""
    if isinstance(prompt, str) and isinstance(chosen, list) and isinstance(rejected, list):
        return any(m.get("role") != "assistant" for m in chosen + rejected)
    return False


def clean_messages(value: list[Any], key: str, where: str) -> Messages:
    """Messages with None-valued extra keys dropped; other extra keys are an error."""
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: field '{key}[{i}]' must be an object with role and "
                            f"content, got {type(m).__name__}")
        extra = sorted(k for k, v in m.items() if k not in MESSAGE_KEYS and v is not None)
        if extra:
            raise DataError(f"{where}: field '{key}[{i}].{extra[0]}': unknown message key "
                            f"(a message holds only role and content; got "
                            f"{m[extra[0]]!r})")
        out.append({k: m[k] for k in MESSAGE_KEYS if k in m})
    return out


def common_prefix_length(a: str | Messages, b: str | Messages) -> int:
    """Index of the first difference of a and b (characters or messages); TRL's rule: a space
    right before it belongs to the completions. When one is a prefix of the other, its length."""
    n = min(len(a), len(b))
    idx = next((i for i in range(n) if a[i] != b[i]), n)
    if 0 < idx < n and a[idx - 1] == " ":
        idx -= 1
    return idx


def conversation_implicit(chosen: Messages, rejected: Messages, where: str
                          ) -> dict[str, Messages]:
    """The messages both conversations start with are the prompt; the rest, the completions."""
    if chosen == rejected:
        raise IdenticalPair(f"{where}: 'chosen' == 'rejected'")
    idx = common_prefix_length(chosen, rejected)
    if idx == 0:
        raise DataError(f"{where}: missing field 'prompt' ('chosen' and 'rejected' share no "
                        "leading message to extract it from)")
    for key, conv in (("chosen", chosen), ("rejected", rejected)):
        if idx == len(conv):
            raise DataError(f"{where}: field '{key}' has no message after the prompt it "
                            "shares with the other side")
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def is_hh(text: str) -> bool:
    """An Anthropic-HH style dialogue: "Human: ..." turns and at least one assistant turn."""
    return text.lstrip("\n").startswith("Human:") and HH_ASSISTANT in text


def _text_implicit(chosen: str, rejected: str, where: str) -> dict[str, Any]:
    for key, text in (("chosen", chosen), ("rejected", rejected)):
        if not text.strip():
            raise DataError(f"{where}: field '{key}' is empty")
    if chosen == rejected:
        raise IdenticalPair(f"{where}: 'chosen' == 'rejected'")
    if is_hh(chosen) and is_hh(rejected):
        return hh_implicit(chosen, rejected, where)
    idx = common_prefix_length(chosen, rejected)
    if not chosen[:idx].strip():
        raise DataError(f"{where}: missing field 'prompt' ('chosen' and 'rejected' share no "
                        "beginning to extract it from)")
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def hh_implicit(chosen: str, rejected: str, where: str) -> dict[str, Any]:
    """HH dialogues -> prompt messages and the two final assistant replies.

    The prompt is the longest common prefix cut back to its last "\\n\\nAssistant:"; each reply
    is what follows it (surrounding whitespace removed) and must be a single assistant turn.
    """
    a, b = _hh_normal(chosen), _hh_normal(rejected)
    shared = a[:common_prefix_length(a, b)]
    cut = shared.rfind(HH_ASSISTANT)
    if cut < 0:
        raise DataError(f"{where}: field 'chosen': the two dialogues differ before their first "
                        "'Assistant:' turn, so they share no prompt")
    prompt = hh_messages(a[:cut], where)
    out: dict[str, Any] = {"prompt": prompt}
    for key, text in (("chosen", a), ("rejected", b)):
        reply = text[cut + len(HH_ASSISTANT):].strip()
        if HH_TURN.search(reply):
            raise DataError(f"{where}: field '{key}': more than one turn after the shared "
                            "prompt (the dialogues differ before their last assistant reply)")
        if not reply:
            raise DataError(f"{where}: field '{key}': empty assistant reply")
        out[key] = reply
    return out


def _hh_normal(text: str) -> str:
    return "\n\n" + text.lstrip("\n")


def hh_messages(text: str, where: str) -> Messages:
    """"\\n\\nHuman: a\\n\\nAssistant: b ..." -> [{"role": "user", "content": "a"}, ...]."""
    parts = HH_TURN.split(text)       # ["", "Human", " a", "Assistant", " b", ...]
    if parts[0].strip():
        raise DataError(f"{where}: field 'chosen': text before the first 'Human:' turn")
    out = []
    for n, (speaker, content) in enumerate(zip(parts[1::2], parts[2::2]), start=1):
        if not content.strip():
            raise DataError(f"{where}: field 'chosen': turn {n} ({speaker}) is empty")
        out.append({"role": HH_ROLES[speaker], "content": content.strip()})
    return out
