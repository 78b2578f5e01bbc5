"""A workspace's params.yaml: validated before a run touches anything, and written from a
profile (merged, its relative model path made absolute, the keys dvc.yaml names and the profile
leaves out written with their defaults, under a header naming what it was made from).
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from flows import shipped
from tasks.config.params import SAFE_LOADER, Params, load_params, to_dict
from tasks.config.profiles import Profile, read_profile
from tasks.core import layout
from tasks.core.errors import InputError


def validate(root: Path, params_file: Path | None) -> Params:
    """Load and check the params a run will use (the profile given, else the workspace's own
    params.yaml, which a person may have edited) before anything is touched or any stage
    runs: a typo fails here with file, line and key, not inside a stage."""
    path = params_file if params_file is not None else root / layout.PARAMS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such params file")
    params = load_params(path)
    _check_model_path(params, path.parent)
    if params_file is None:                        # run as it is: every stated key written
        profile = read_profile(path)
        missing = [k for k in stated_keys() if not _has(profile.data, k)]
        if missing:
            raise InputError(f"{path}: {missing[0]}: not written, and a stage reads it (DVC "
                             f"needs every key dvc.yaml names in params.yaml); write it (its "
                             f"default: {_get(to_dict(params), missing[0])!r}) or run with "
                             "--params PROFILE, which writes the defaults in")
    return params


def stated_keys() -> list[str]:
    """Every params key dvc.yaml names, as stage params or in `${...}`: DVC fails a stage whose
    key is missing from params.yaml (`Parameters ... are missing`), defaults or not."""
    text = shipped.dvc_yaml().read_text()
    keys = [k for stage in yaml.load(text, Loader=SAFE_LOADER)["stages"].values()
            for k in stage.get("do", stage).get("params", []) if isinstance(k, str)]
    keys += [k for k in re.findall(r"\$\{\s*([^}\s]+)\s*\}", text)
             if k.split(".")[0] not in ("key", "item")]
    return list(dict.fromkeys(keys))


def _has(data: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def _get(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def _with(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """`data` with `dotted` set to `value` (the mappings on the way copied)."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return {**data, head: value}
    inner = data.get(head) if isinstance(data.get(head), dict) else {}
    return {**data, head: _with(inner, rest, value)}


def _check_model_path(p: Params, base: Path) -> None:
    if p.model.source == "hf_dir":                 # only then: tasks.models.lm imports torch (~3 s)
        from tasks.models.lm import check_model_dir
        check_model_dir((base / Path(p.model.path).expanduser()).resolve())   # absolute wins


_MODEL_PATH = re.compile(r"^(?P<indent>\s+)path:(?P<value>[^#\n]*?)(?P<rest>\s*(#.*)?)$")


def header(profile: Profile, filled: Sequence[str] = ()) -> str:
    """The comment lines a workspace's params.yaml starts with: the alignloop that wrote it,
    the profile files merged (a shipped profile by name: nothing points into the
    installation) and the keys written with their defaults."""
    names = "".join(f"#   {_whence(Path(f))}\n" for f in reversed(profile.files))
    fill = (f"# written with their defaults (a stage reads them): {', '.join(filled)}\n"
            if filled else "")
    return (f"# written by alignloop {shipped.version()} from (each over the next):\n{names}"
            f"{fill}# edit this file for this workspace (`alignloop run --params FILE` "
            "replaces it)\n")


def _whence(path: Path) -> str:
    resolved = path.resolve()
    if resolved.parent == shipped.params_dir().resolve():
        return f"profile {resolved.stem} (shipped with alignloop)"
    return str(path)


def merged_text(profile: Profile, data: Any, filled: Sequence[str] = ()) -> str:
    """The workspace's params.yaml written from a profile: `data` (its merged data, paths
    resolved, the `filled` keys added with their defaults) as YAML, under the header (a
    workspace holds one complete params file: DVC reads it)."""
    return header(profile, filled) + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def profile_text(path: Path) -> str:
    """The profile as the workspace's params.yaml: a relative `model.path` is relative to the
    profile's own directory (the one rule for paths in params), so it is written there as the
    absolute path it names; the rest of the text, comments included, is kept. A profile with
    a `base:` is written merged (tasks/config/profiles.py), and keys dvc.yaml names that the profile
    leaves out are written with their defaults: DVC reads one complete params file."""
    profile = read_profile(path)
    missing = [k for k in stated_keys() if not _has(profile.data, k)]
    if len(profile.files) > 1 or missing:
        data = profile.data
        if missing:                                # left out: the schema's defaults, written
            full = to_dict(load_params(path))
            for key in missing:
                data = _with(data, key, _get(full, key))
        model = data.get("model") if isinstance(data, dict) else None
        where = profile.lines.get(("model", "path"))
        if isinstance(model, dict) and isinstance(model.get("path"), str) and model["path"] \
                and where and not Path(model["path"]).expanduser().is_absolute():
            absolute = (Path(where[0]).parent / model["path"]).resolve()   # its own file's dir
            data = {**data, "model": {**model, "path": str(absolute)}}
        return merged_text(profile, data, missing)
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    in_model = False
    for i, line in enumerate(lines):
        if re.match(r"^\S", line):
            in_model = line.startswith("model:")
            continue
        m = _MODEL_PATH.match(line.rstrip("\n")) if in_model else None
        if m and len(m["indent"]) == 2:
            value = yaml.safe_load(m["value"]) or ""
            if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
                absolute = (path.parent / value).resolve()
                end = "\n" if line.endswith("\n") else ""
                lines[i] = f"{m['indent']}path: {json.dumps(str(absolute))}{m['rest']}{end}"
            break
    return header(profile) + "".join(lines)
