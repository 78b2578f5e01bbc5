"""The pipeline this installation carries, found through the installed packages.

What a workspace is made from: `dvc.yaml`, the stage sources (the `tasks` package, stages and
libraries), the shipped profiles (`params/*.yaml`) and their versioned data (prompts, judge
templates, gold examples under `params/<dir>/`). In a built wheel, dvc.yaml and params/ are
package data of `flows` under `flows/pipeline_data/` (setup.py's build step puts them there);
in a checkout (an editable install) they lie at its root, beside `flows/`. Nothing here looks
at the current directory.
"""
from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import tasks
from tasks.core.errors import InputError

DATA_DIR = "pipeline_data"                  # flows/<DATA_DIR>/ in a built wheel
PARAMS_DATA = ("prompts", "gold", "judges", "redteam")  # params/<dir>/*: versioned data the
                                                        #   stages read


@functools.cache
def pipeline_root() -> Path:
    """The directory holding dvc.yaml and params/: the wheel's package data, else the checkout."""
    flows_dir = Path(__file__).resolve().parent
    for root in (flows_dir / DATA_DIR, flows_dir.parent):
        if (root / "dvc.yaml").is_file() and (root / "params").is_dir():
            return root
    raise RuntimeError(f"{flows_dir}: this installation carries no pipeline (dvc.yaml and "
                       "params/ are missing from the package: a broken build?)")


def code_root() -> Path:
    """The directory that holds the `flows` and `tasks` packages (site-packages, or a
    checkout): a Prefect worker loads `flows/schedule.py` from it."""
    return Path(__file__).resolve().parent.parent


def tasks_dir() -> Path:
    """The `tasks` package's directory: the stage sources a workspace gets a copy of."""
    return Path(tasks.__file__).resolve().parent


def dvc_yaml() -> Path:
    return pipeline_root() / "dvc.yaml"


def params_dir() -> Path:
    return pipeline_root() / "params"


def is_source_tree(root: Path) -> bool:
    """True for the checkout this installation runs from (a developer's `--workspace .`):
    it is never synced into, nor reset after a failure."""
    return root.resolve() == pipeline_root() and root.resolve() == code_root()


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        return dist_version("alignloop")
    except PackageNotFoundError:
        return "unknown (not installed)"


@dataclass(frozen=True)
class ShippedProfile:
    name: str                 # default, tiny, default-ppo, ...
    path: Path
    description: str          # its first comment line, without the "# Profile `x`:" lead
    base: str | None          # the profile it is a diff of


def profiles() -> list[ShippedProfile]:
    """The profiles this installation ships, by name."""
    from tasks.config.profiles import BASE_KEY, read_text
    out = []
    for path in sorted(params_dir().glob("*.yaml"), key=lambda p: p.stem):
        lines = read_text(path).splitlines()
        base = next((ln.split(":", 1)[1].split("#")[0].strip() for ln in lines
                     if ln.startswith(f"{BASE_KEY}:")), None)
        out.append(ShippedProfile(path.stem, path, _first_sentence(lines),
                                  Path(base).stem if base else None))
    return out


def _first_sentence(lines: list[str], width: int = 100) -> str:
    """The first sentence of a profile's leading comment, its "Profile `name`:" lead dropped,
    cut to `width` characters."""
    text = " ".join(ln.lstrip("#").strip() for ln in itertools.takewhile(
        lambda ln: ln.startswith("#"), lines))
    text = re.sub(r"^Profile `[^`]*`:\s*", "", text)
    text = re.split(r"(?<=[.;])\s", text, maxsplit=1)[0].rstrip(".;")
    return text if len(text) <= width else text[:width - 3].rsplit(" ", 1)[0] + "..."


def profile(name: str) -> Path:
    """A shipped profile's file by name (`tiny`, `default.yaml`); one line naming those there
    are when none has that name."""
    stem = Path(name).stem if name.endswith(".yaml") else name
    path = params_dir() / f"{stem}.yaml"
    if "/" in stem or not path.is_file():
        names = ", ".join(p.name for p in profiles())
        raise InputError(f"{name}: no such profile (shipped: {names}; a file of your own: "
                         "--params FILE)")
    return path


def default_profile() -> Path:
    return params_dir() / "default.yaml"


def sources() -> set[str]:
    """The stage sources as paths relative to a workspace (tasks/x.py, tasks/stages/y.py)."""
    return sources_in(tasks_dir().parent)


def sources_in(root: Path) -> set[str]:
    """The Python sources under root/tasks, relative to root."""
    return {f.relative_to(root).as_posix() for f in (root / "tasks").rglob("*.py")
            if "__pycache__" not in f.parts}


def data_files() -> list[tuple[Path, str]]:
    """(shipped file, its path in a workspace) for the versioned data under params/."""
    return [(f, f"params/{name}/{f.name}") for name in PARAMS_DATA
            for f in sorted((params_dir() / name).iterdir()) if f.is_file()]

