"""Reading a profile file: YAML with the file and line of every key, and `base:` overlays.

A profile may start from another: `base: default.yaml` (relative to the profile's own
directory) merges it under the profile, mapping by mapping; any other value the profile sets
(a number, a string, a list) replaces the base's. So `params/default-ppo.yaml` holds only what
differs from `params/default.yaml`. Every key keeps the file and line it was written at, so an
error names the file that holds the bad value, base or overlay.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tasks.core.errors import InputError

BASE_KEY = "base"
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~8x faster, same marks
Where = tuple[str, int]                                       # (file, line)


class ParamsError(InputError):
    """A params file that does not match the schema; the message names file, line and key."""


@dataclass(frozen=True)
class Profile:
    data: Any                                   # the merged mapping, as YAML reads it
    lines: dict[tuple[str, ...], Where]         # each key path: the file and line that set it
    files: tuple[str, ...]                      # the files merged, the first base first


def parse_text(text: str, source: str) -> Profile:
    """One file's YAML and its key lines; a key twice in one mapping is refused (YAML lets
    the last one win silently)."""
    try:
        node = yaml.compose(text, Loader=SAFE_LOADER)
        data = yaml.load(text, Loader=SAFE_LOADER)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        raise ParamsError(f"{source}:{line}: invalid YAML: {getattr(e, 'problem', e)}") from None
    lines: dict[tuple[str, ...], Where] = {}
    if node is not None:
        _line_index(node, (), source, lines)
    return Profile(data if data is not None else {}, lines, (source,))


def _line_index(node: yaml.Node, path: tuple[str, ...], source: str,
                out: dict[tuple[str, ...], Where]) -> None:
    out[path] = (source, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            sub = path + (str(key.value),)
            if str(key.value) in seen:
                raise ParamsError(f"{source}:{key.start_mark.line + 1}: {'.'.join(sub)}: "
                                  "duplicate key")
            seen.add(str(key.value))
            out[sub] = (source, key.start_mark.line + 1)
            _line_index(value, sub, source, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_index(item, path + (str(i),), source, out)


def read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ParamsError(f"{path}: params file not found") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ParamsError(f"{path}:{line}: not valid UTF-8 (byte {e.start})") from None


def read_profile(path: str | Path, _chain: tuple[Path, ...] = ()) -> Profile:
    """A profile file with its `base:` chain merged under it (`merge`)."""
    path = Path(path)
    own = parse_text(read_text(path), str(path))
    if not (isinstance(own.data, dict) and BASE_KEY in own.data):
        return own
    file, line = own.lines[(BASE_KEY,)]
    where = f"{file}:{line}: {BASE_KEY}"
    rel = own.data[BASE_KEY]
    if not isinstance(rel, str) or not rel:
        raise ParamsError(f"{where}: expected the file name of the profile this one starts from")
    base_path = (path.parent / rel).resolve()
    if base_path in _chain + (path.resolve(),):
        raise ParamsError(f"{where}: {rel} is this profile or one it starts from (a cycle)")
    if not base_path.is_file():
        raise ParamsError(f"{where}: {rel}: no such file (relative to {path.parent})")
    base = read_profile(base_path, _chain + (path.resolve(),))
    data = {k: v for k, v in own.data.items() if k != BASE_KEY}
    lines = {k: v for k, v in own.lines.items() if k[:1] != (BASE_KEY,)}
    return Profile(merge(base.data, data), {**base.lines, **lines}, base.files + own.files)


def merge(base: Any, over: Any) -> Any:
    """`over` on top of `base`: mappings merged key by key (the base's order, then new keys),
    anything else replaced."""
    if not (isinstance(base, dict) and isinstance(over, dict)):
        return over
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(base[key], value) if key in base else value
    return out
