"""The pipeline as DVC declares it: stage instances in order, their state, and running one.

Nothing here keeps a second answer to "is this up to date": DVC's status, lock file and
run-cache are asked every time.
"""
from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import networkx as nx
import yaml
from dvc.exceptions import ReproductionError
from dvc.repo import Repo

# canonical order among stages that DVC leaves unordered (topology always wins)
STAGE_ORDER = ("prompts", "prepare_model", "collect_offpolicy", "reference_samples", "rollout",
               "judge", "train_rm", "update", "evaluate", "gate")
State = Literal["up-to-date", "changed", "missing"]
Outcome = Literal["ran", "restored", "cached"]


@dataclass(frozen=True)
class StageRef:
    name: str                    # DVC address, e.g. "rollout@2"
    base: str                    # "rollout"
    iteration: int               # 0 for the set-up stages


def parse_name(name: str) -> StageRef:
    base, _, key = name.partition("@")
    return StageRef(name, base, int(key) if key else 0)


def _sort_key(name: str) -> tuple[int, int, str]:
    ref = parse_name(name)
    pos = STAGE_ORDER.index(ref.base) if ref.base in STAGE_ORDER else len(STAGE_ORDER)
    return ref.iteration, pos, name


def ordered_stages(root: Path) -> list[StageRef]:
    """Every stage instance in a topological order, iteration by iteration."""
    with contextlib.chdir(root), Repo(str(root)) as repo:
        graph = repo.index.graph                     # edges point to the stage depended upon
        names = {node: node.addressing for node in graph.nodes}
        order = nx.lexicographical_topological_sort(graph.reverse(copy=True),
                                                    key=lambda n: _sort_key(names[n]))
        return [parse_name(names[n]) for n in order]


@dataclass(frozen=True)
class StageState:
    name: str
    state: State
    reasons: list[str] = field(default_factory=list)


def _explain(changes: list[Any]) -> tuple[State, list[str]]:
    state: State = "up-to-date"
    reasons: list[str] = []
    for change in changes:
        if isinstance(change, str):               # e.g. "changed command", "always changed"
            reasons.append(change)
            state = "changed"
            continue
        for kind, items in change.items():
            if not isinstance(items, dict):
                reasons.append(f"{kind}: {items}")
                state = "changed"
                continue
            for path, how in items.items():
                reasons.append(f"{kind.replace('changed ', '')} {path}: {how}")
                if kind == "changed outs" and how in ("deleted", "not in cache"):
                    state = "missing" if state == "up-to-date" else state
                else:
                    state = "changed"
    return state, reasons


def stage_states(root: Path) -> list[StageState]:
    """up-to-date / changed (a dep, param or command changed) / missing (outputs absent)."""
    refs = ordered_stages(root)
    locked = set(read_lock(root))
    out = []
    with contextlib.chdir(root), Repo(str(root)) as repo:
        status = repo.status(targets=[r.name for r in refs])
    for ref in refs:
        if ref.name not in locked:
            out.append(StageState(ref.name, "missing", ["never run (not in dvc.lock)"]))
            continue
        state, reasons = _explain(status.get(ref.name, []))
        out.append(StageState(ref.name, state, reasons))
    return out


def downstream(root: Path, name: str) -> list[str]:
    """The stage instances that depend, directly or not, on `name` (in run order)."""
    with contextlib.chdir(root), Repo(str(root)) as repo:
        graph = repo.index.graph
        node = next((n for n in graph.nodes if n.addressing == name), None)
        if node is None:
            raise KeyError(name)
        after = {n.addressing for n in nx.ancestors(graph, node)}   # edges point upstream
    return [r.name for r in ordered_stages(root) if r.name in after]


def read_lock(root: Path) -> dict[str, Any]:
    """dvc.lock's stage entries: cmd, deps/outs with md5 and size, params values."""
    path = root / "dvc.lock"
    if not path.is_file():
        return {}
    return (yaml.safe_load(path.read_text()) or {}).get("stages", {})


@dataclass(frozen=True)
class StageRun:
    name: str
    outcome: Outcome
    seconds: float


def reproduce(root: Path, name: str, force: bool = False) -> StageRun:
    """Bring one stage instance up to date: run it, restore it from the run-cache, or skip.
    With force, run its command whatever DVC's caches say."""
    t0 = time.perf_counter()
    with contextlib.chdir(root), Repo(str(root)) as repo:
        stage = next(s for s in repo.index.stages if s.addressing == name)
        if not force and not repo.status(targets=[name]).get(name) and name in read_lock(root):
            return StageRun(name, "cached", time.perf_counter() - t0)
        in_run_cache = not force and _in_run_cache(repo, stage)
        try:
            with contextlib.redirect_stdout(io.StringIO()) if in_run_cache else \
                    contextlib.nullcontext():
                repo.reproduce(targets=[name], single_item=True, force=force)
        except ReproductionError:
            # DVC removed the outputs before running; put the last good (locked) ones back
            with contextlib.suppress(Exception):
                repo.checkout(targets=[name], force=True)
            raise StageFailed(name) from None
    return StageRun(name, "restored" if in_run_cache else "ran", time.perf_counter() - t0)


class StageFailed(RuntimeError):
    def __init__(self, name: str):
        super().__init__(f"stage {name} failed (its message is above); its outputs are as "
                         "they were before the run")
        self.name = name


def _in_run_cache(repo: Repo, stage: Any) -> bool:
    try:
        stage.save_deps(allow_missing=True)       # hash deps as they are now, not as locked
        return repo.stage_cache._load(stage) is not None   # noqa: SLF001 (no public API)
    except Exception:   # the run-cache is an optimisation; never fail a run over it
        return False
