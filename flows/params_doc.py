"""`alignloop params`: every params key with its value, type, default and meaning.

Each field is documented once, in its schema (tasks/schemas/): the comment on the field's line
and the comment lines indented under it. The profiles carry values, and a comment only where a
profile says why it picks its value; what a key means is read from here.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from tasks.config.params import Params


@dataclass(frozen=True)
class Entry:
    key: str                 # dotted, as params.yaml and dvc.yaml name it
    type: str
    default: Any
    doc: str


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The comment documenting each field of a dataclass, from its source: the comments on the
    field's (logical) line, continued by comment-only lines below it indented past the field."""
    source = textwrap.dedent(inspect.getsource(cls))
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    docs: dict[str, list[str]] = {}
    current: str | None = None              # the field whose doc the comments continue
    in_field, line_start = False, True
    for n, tok in enumerate(tokens):
        if tok.type == tokenize.NEWLINE:
            in_field, line_start = False, True
        elif tok.type == tokenize.COMMENT:
            comment_only = tok.line.lstrip().startswith("#")
            if current is not None and (in_field or (comment_only and tok.start[1] > 4)):
                docs[current].append(tok.string.lstrip("#").strip())
            elif comment_only:
                current = None
        elif tok.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT) and line_start:
            line_start = False
            is_field = tok.type == tokenize.NAME and tok.start[1] == 4 and \
                tokens[n + 1].string == ":"
            current, in_field = (tok.string, True) if is_field else (None, False)
            if is_field:
                docs[current] = []
    return {name: " ".join(parts) for name, parts in docs.items() if parts}


REQUIRED = object()                       # a field without a default


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is not None:    # tuple[float, ...], dict[str, Iteration]
        return str(tp).replace("tasks.config.params.", "")
    return getattr(tp, "__name__", str(tp))


def entries(cls: type = Params, prefix: str = "") -> Iterator[Entry]:
    """Every leaf key of the schema under `cls`, in declaration order."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from entries(tp, key + ".")      # type: ignore[arg-type]
            continue
        default = f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else REQUIRED
        yield Entry(key, _type_name(tp), default, docs.get(f.name, ""))


def lookup(params: Any, key: str) -> Any:
    for part in key.split("."):
        params = params[part] if isinstance(params, dict) else getattr(params, part)
    return params


def render(params: Params | None, selector: str = "") -> list[str]:
    """The lines `alignloop params [KEY]` prints: each key under `selector` (a key or a section
    prefix; "" = all), its value in `params` when given, and its meaning."""
    out = []
    for e in entries():
        if selector and e.key != selector and not e.key.startswith(selector + "."):
            continue
        value = f" = {lookup(params, e.key)!r}" if params is not None else ""
        default = "required" if e.default is REQUIRED else f"default {e.default!r}"
        out.append(f"{e.key}{value}    ({e.type}, {default})")
        out += ["    " + line for line in textwrap.wrap(e.doc or "(undocumented)", 92)]
    return out
