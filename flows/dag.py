"""The pipeline as DVC declares it: stage instances in order, their state, and running one.

Nothing here keeps a second answer to "is this up to date": DVC's status, lock file and
run-cache are asked every time.
"""
from __future__ import annotations

import contextlib
import copy
import io
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import networkx as nx
import yaml
from dvc.exceptions import ReproductionError
from dvc.repo import Repo

from flows.dvc_quiet import quiet_dvc
from tasks.config.params import SAFE_LOADER
from tasks.core import heap, layout
from tasks.runtime import forkserver

# canonical order among stages that DVC leaves unordered (topology always wins)
STAGE_ORDER = layout.STAGES
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


# the last answer of ordered_stages per workspace, with the declaration key it was parsed at
_ORDERS: dict[Path, tuple[tuple[Any, ...], list[StageRef]]] = {}


def ordered_stages(root: Path) -> list[StageRef]:
    """Every stage instance in a topological order, iteration by iteration (parsed again only
    when dvc.yaml, dvc.lock, params.yaml or .dvcignore changed since the last call)."""
    key = _declaration_key(root)
    known = _ORDERS.get(Path(root).resolve())
    if known is not None and known[0] == key:
        return list(known[1])
    with contextlib.chdir(root):
        repo = Repo(str(root))
        try:
            graph = repo.index.graph                 # edges point to the stage depended upon
            names = {node: node.addressing for node in graph.nodes}
            order = nx.lexicographical_topological_sort(graph.reverse(copy=True),
                                                        key=lambda n: _sort_key(names[n]))
            refs = [parse_name(names[n]) for n in order]
        except BaseException:
            repo.close()
            raise
    _park(root, key, repo)           # its parsed index may serve the session that follows
    _ORDERS[Path(root).resolve()] = (key, refs)
    return list(refs)


@dataclass(frozen=True)
class StageState:
    name: str
    state: State
    reasons: list[str] = field(default_factory=list)


def _explain(changes: list[Any], locked_params: dict[str, Any],
             params: dict[str, Any]) -> tuple[State, list[str]]:
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
                if isinstance(how, dict):         # a params file: {key: "modified", ...}
                    reasons += [_param_change(key, locked_params, params) for key in how]
                else:
                    reasons.append(f"{kind.replace('changed ', '')} {path}: {how}")
                if kind == "changed outs" and how in ("deleted", "not in cache"):
                    state = "missing" if state == "up-to-date" else state
                else:
                    state = "changed"
    return state, reasons


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Nested params as dotted keys: {"a": {"b": 1}} -> {"a.b": 1} (into `out`)."""
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value
    return out


def _param_change(key: str, locked: dict[str, Any], params: dict[str, Any]) -> str:
    """`param train_rm.lr: 0.001 -> 0.002` for each leaf under `key` that differs."""
    def value(tree: dict[str, Any]) -> Any:
        node: Any = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node
    old = flatten(key, value(locked), {})
    new = flatten(key, value(params), {})
    diffs = [f"{k}: {old.get(k, '(none)')} -> {new.get(k, '(none)')}"
             for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return "param " + ("; ".join(diffs) if diffs else f"{key}: modified")


def stage_states(root: Path) -> list[StageState]:
    """up-to-date / changed (a dep, param or command changed) / missing (outputs absent)."""
    refs = ordered_stages(root)
    lock = read_lock(root)
    params = yaml.load((root / layout.PARAMS_FILE).read_text(), Loader=SAFE_LOADER) or {}
    out = []
    status: dict[str, Any] = {}
    # the repo ordered_stages just parsed (parked), else a fresh one: one parse of dvc.yaml
    # and dvc.lock answers every stage (status with targets parsed them once per target)
    repo = _unpark(root, _declaration_key(root)) or Repo(str(root))
    with contextlib.chdir(root), repo, repo.lock:
        for stage in repo.index.stages:
            status.update(stage.status(check_updates=True))
    for ref in refs:
        if ref.name not in lock:
            out.append(StageState(ref.name, "missing", ["never run (not in dvc.lock)"]))
            continue
        locked = _unflatten(lock[ref.name].get("params", {}).get(layout.PARAMS_FILE, {}))
        state, reasons = _explain(status.get(ref.name, []), locked, params)
        out.append(StageState(ref.name, state, reasons))
    return out


def _unflatten(values: dict[str, Any]) -> dict[str, Any]:
    """dvc.lock's params ({"train_rm": {...}, "model.max_prompt_tokens": 48}) as one tree."""
    tree: dict[str, Any] = {}
    for key, value in values.items():
        node = tree
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def downstream(root: Path, name: str) -> list[str]:
    """The stage instances that depend, directly or not, on `name` (in run order)."""
    with contextlib.chdir(root), Repo(str(root)) as repo:
        graph = repo.index.graph
        node = next((n for n in graph.nodes if n.addressing == name), None)
        if node is None:
            raise KeyError(name)
        after = {n.addressing for n in nx.ancestors(graph, node)}   # edges point upstream
    return [r.name for r in ordered_stages(root) if r.name in after]


# the last few dvc.lock texts parsed, and their stage entries (a run reads the lock a dozen
# times between writes; parsing it is ~30x a copy of the result)
_LOCKS: dict[str | bytes, dict[str, Any]] = {}
_LOCKS_GUARD = threading.Lock()             # the flow's tasks may read it from threads


def read_lock(root: Path, text: str | bytes | None = None) -> dict[str, Any]:
    """dvc.lock's stage entries: cmd, deps/outs with md5 and size, params values (of the
    workspace's file, or of `text`, e.g. dvc.lock at a commit). The caller's own copy."""
    if text is None:
        path = root / "dvc.lock"
        if not path.is_file():
            return {}
        text = path.read_text()
    with _LOCKS_GUARD:
        if text not in _LOCKS:
            if len(_LOCKS) >= 4:
                _LOCKS.pop(next(iter(_LOCKS)))
            _LOCKS[text] = (yaml.load(text, Loader=SAFE_LOADER) or {}).get("stages", {})
        return copy.deepcopy(_LOCKS[text])


def fingerprint(lock: dict[str, Any], names: list[str] | tuple[str, ...]) -> str:
    """md5 of the lock entries of these stages: equal iff the same bytes were produced."""
    import hashlib
    import json
    blob = json.dumps({n: lock.get(n) for n in sorted(names)}, sort_keys=True, default=str)
    return hashlib.md5(blob.encode()).hexdigest()


@dataclass(frozen=True)
class StageRun:
    name: str
    outcome: Outcome
    seconds: float
    started: float = 0.0         # wall-clock start (epoch seconds), for the MLflow run's times


# What a repo's index is parsed from: when none of these changed, a parsed index still holds.
_DECLARATION_FILES = ("dvc.yaml", "dvc.lock", layout.PARAMS_FILE, ".dvcignore")
_PARK_SECONDS = 60.0


def _declaration_key(root: Path) -> tuple[Any, ...]:
    out: list[Any] = []
    for name in _DECLARATION_FILES:
        try:
            st = (Path(root) / name).stat()
            out.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        except FileNotFoundError:
            out.append(None)
    return tuple(out)


# one parsed repo, left by the last ordered_stages for the session that follows it
_PARKED: list[tuple[Path, tuple[Any, ...], Repo, float]] = []
_PARKED_MUTEX = threading.Lock()


def _park(root: Path, key: tuple[Any, ...], repo: Repo) -> None:
    """Keep a repo whose index is parsed, for a session starting right after (the flow asks
    for the stage order, then checks each stage); it replaces (closes) the one parked before."""
    with _PARKED_MUTEX:
        old = _PARKED[:]
        _PARKED[:] = [(Path(root).resolve(), key, repo, time.monotonic())]
    for entry in old:
        entry[2].close()


def _unpark(root: Path, key: tuple[Any, ...] | None) -> Repo | None:
    """The parked repo if it is of `root`, parsed from these very files and recently; else
    None. Either way the slot is emptied (a repo not handed out is closed)."""
    with _PARKED_MUTEX:
        old = _PARKED[:]
        _PARKED.clear()
    for r, k, repo, at in old:
        if r == Path(root).resolve() and k == key and time.monotonic() - at < _PARK_SECONDS:
            return repo
        repo.close()
    return None


class DvcSession:
    """One DVC repo kept open across the stage checks of a run (one flow run).

    Opening a repo and parsing dvc.yaml and dvc.lock into its index costs ~0.3 s and DVC's
    `status` parses both again, while one stage's own status check costs ~0.03 s. A session
    parses once and again only when dvc.yaml, dvc.lock, params.yaml or .dvcignore changed (a
    stage ran) or after `invalidate()`. It only answers "up to date?"; running a stage is left
    to a fresh repo (`reproduce`). Close it when the run ends.
    """

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self._repo: Repo | None = None
        self._key: tuple[Any, ...] = ()
        self._locked: set[str] = set()           # stage instances in dvc.lock
        self._mutex = threading.Lock()

    def up_to_date(self, name: str) -> bool | None:
        """True iff DVC finds the stage instance unchanged and it is in dvc.lock: the answer
        of `repo.status(targets=[name])` on a freshly opened repo. None when the declaration
        files changed while it asked: no answer, ask a fresh repo."""
        with self._mutex, contextlib.chdir(self.root):
            key = _declaration_key(self.root)
            if self._repo is None or key != self._key:
                self._close()
                self._repo = _unpark(self.root, key) or Repo(str(self.root))
                self._key, self._locked = key, set(read_lock(self.root))
            with self._repo.lock:
                if _declaration_key(self.root) != key:    # changed meanwhile: ask afresh
                    return None
                stage = next((s for s in self._repo.index.stages if s.addressing == name),
                             None)
                return stage is not None and name in self._locked and \
                    not stage.status(check_updates=True)

    def invalidate(self) -> None:
        """Drop the open repo; the next check opens and parses afresh."""
        with self._mutex:
            self._close()

    close = invalidate                        # the end of a run: the same, said plainly

    def _close(self) -> None:
        if self._repo is not None:
            self._repo.close()
        self._repo, self._key, self._locked = None, (), set()


_SESSIONS: dict[tuple[str, Path], DvcSession] = {}
_SESSIONS_MUTEX = threading.Lock()


def session_for(root: Path, run_id: str) -> DvcSession:
    """Run `run_id`'s session on this workspace, opened on first use. Sessions of other runs
    on the same workspace are closed (a workspace runs one iteration at a time), so a run that
    died before `end_session` leaks nothing past the next one."""
    key = (run_id, Path(root).resolve())
    with _SESSIONS_MUTEX:
        if key not in _SESSIONS:
            for old in [k for k in _SESSIONS if k[1] == key[1]]:
                _SESSIONS.pop(old).close()
            _SESSIONS[key] = DvcSession(key[1])
        return _SESSIONS[key]


def end_session(root: Path, run_id: str) -> None:
    """Close run `run_id`'s session on this workspace (and a repo still parked)."""
    with _SESSIONS_MUTEX:
        session = _SESSIONS.pop((run_id, Path(root).resolve()), None)
    if session is not None:
        session.close()
    _unpark(root, None)                       # closes a repo still parked


def reproduce(root: Path, name: str, force: bool = False,
              session: DvcSession | None = None) -> StageRun:
    """Bring one stage instance up to date: run it, restore it from the run-cache, or skip.
    With force, run its command whatever DVC's caches say. A session answers the common
    "nothing to do" case from its open repo; anything else goes through a fresh one."""
    t0, started = time.perf_counter(), time.time()
    known = None                              # the session's answer, when it has one
    if session is not None and not force:
        known = session.up_to_date(name)
        if known:
            return StageRun(name, "cached", time.perf_counter() - t0, started)
    if session is not None:
        session.invalidate()                  # what follows may change dvc.lock and outputs
    with contextlib.chdir(root), Repo(str(root)) as repo:
        stage = next(s for s in repo.index.stages if s.addressing == name)
        # asked again only without the session's answer (~0.6 s a stage on tiny)
        if not force and known is None and not repo.status(targets=[name]).get(name) \
                and name in read_lock(root):
            return StageRun(name, "cached", time.perf_counter() - t0, started)
        in_run_cache = not force and _in_run_cache(repo, stage)
        try:
            with contextlib.redirect_stdout(io.StringIO()) if in_run_cache else \
                    contextlib.nullcontext():
                if not in_run_cache:
                    forkserver.ensure()       # the CLI's: stage programs fork from its imports
                with heap.for_stage_processes():   # glibc's settings for the stage process
                    repo.reproduce(targets=[name], single_item=True, force=force)
        except ReproductionError as e:
            # DVC removed the outputs before running; put the last good (locked) ones back
            with contextlib.suppress(Exception), quiet_dvc():
                repo.checkout(targets=[name], force=True)
            remove_unlocked_outputs(root, name, [str(o.def_path) for o in stage.outs])
            raise StageFailed(name, _cause(e)) from None
    return StageRun(name, "restored" if in_run_cache else "ran", time.perf_counter() - t0,
                    started)


def remove_unlocked_outputs(root: Path, name: str, outs: list[str]) -> list[str]:
    """After a failed run: remove the outputs that no dvc.lock entry of the stage vouches for.
    They are the failed run's partial products (the stage never succeeded, or the output is
    new), and left in place nothing would ignore them: the next commit's `git add` would stage a
    model directory into git. Returns the removed paths."""
    locked = {str(o.get("path")) for o in read_lock(root).get(name, {}).get("outs", [])}
    removed = []
    for out in outs:
        path = root / out
        if out in locked or not (path.exists() or path.is_symlink()):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(out)
    return removed


class StageFailed(RuntimeError):
    """A stage instance that did not complete; `detail` is DVC's account of why (the stage's
    own one-line message, when it wrote one, is what the CLI shows instead)."""

    def __init__(self, name: str, detail: str):
        super().__init__(f"stage {name} failed: {detail}")
        self.name, self.detail = name, detail


def _cause(e: BaseException) -> str:
    """The innermost message of DVC's exception chain, e.g. "failed to run: python -m
    tasks.stages.update --it 1, exited with 2" or "output 'x' is already tracked by SCM"."""
    while e.__cause__ is not None:
        e = e.__cause__
    return str(e) or type(e).__name__


def _in_run_cache(repo: Repo, stage: Any) -> bool:
    try:
        stage.save_deps(allow_missing=True)       # hash deps as they are now, not as locked
        return repo.stage_cache._load(stage) is not None   # noqa: SLF001 (no public API)
    except Exception:   # noqa: BLE001 (the run-cache is an optimisation; never fail a run over it)
        return False


def outline(root: Path) -> list[str]:
    """The DAG in a few lines a terminal can show: the set-up stages, then each iteration's
    chain with what it takes from the one before (`dvc dag` draws 16 stages ~500 columns wide)."""
    with contextlib.chdir(root), Repo(str(root)) as repo:
        graph = repo.index.graph
        deps = {n.addressing: sorted(d.addressing for d in graph.successors(n))
                for n in graph.nodes}
    by_iteration: dict[int, list[str]] = {}
    for name in sorted(deps, key=_sort_key):
        by_iteration.setdefault(parse_name(name).iteration, []).append(name)
    lines = []
    for it, names in sorted(by_iteration.items()):
        outside = sorted({d for n in names for d in deps[n] if parse_name(d).iteration != it},
                         key=_sort_key)
        head = "set-up" if it == 0 else f"iteration {it}"
        lines.append(f"{head}: {' -> '.join(names)}" +
                     (f"   (uses {', '.join(outside)})" if outside else ""))
    return lines
