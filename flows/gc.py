"""`alignloop gc --keep-last N`: free the weights of old iterations, keep their record.

Kept: data (prompts, rollouts, pairs: every out outside `models/`), the initial model
(`models/iter_0`, the base every adapter names), the last N iterations' models, every model
version an alias points to, every model a kept iteration's stages read (the policy each
started from), and the base a kept adapter names in its `alignloop_base.json`. Archived: the
other iterations' `models/iter_k/policy` and `models/iter_k/rm`, from the workspace, the DVC
cache and the default remote: exactly the objects of those outputs (the `.dir` manifest and the
files it lists), less every object a kept output shares (a tokenizer file, say).

`dvc gc` cannot say this: it keeps what `dvc.lock` names and removes everything else, and
`dvc.lock` is left as it is (lineage still prints every md5). So the objects are removed
through DVC's own object stores (`repo.cache.local`, the remote's ODB), by md5.

Order, so that a failure or a signal leaves the workspace as it was: the workspace directories
and cache objects are moved aside under `.alignloop/gc-trash/`, the versions tagged `archived`,
the ledger line appended and committed with the registry record; only then are the remote's
objects deleted and the moved files dropped. A failure before the commit moves everything back;
a gc killed after it is finished by the next one (the trash of a ledgered gc is dropped, of an
unledgered one put back).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows import archived, crashpoints
from flows.dag import parse_name, read_lock
from flows.registry import POLICY_MODEL, REWARD_MODEL
from tasks.core import layout

MODEL_OUT = re.compile(r"^models/iter_(\d+)/(policy|rm)$")
TRASH = "gc-trash"                      # under .alignloop/: what a running gc moved aside
BASE_FILE = layout.ADAPTER_BASE      # the base an adapter or head-only RM names (lm.BaseRecord)


@dataclass(frozen=True)
class Store:
    label: str                          # "cache" or "remote 'NAME'"
    odb: Any                            # DVC's HashFileDB


@dataclass
class Out:
    path: str
    md5: str
    iteration: int
    versions: list[str] = field(default_factory=list)   # "alignloop-policy v3"
    oids: list[str] = field(default_factory=list)       # objects it alone holds
    bytes: dict[str, int] = field(default_factory=dict)  # per place: workspace, cache, remote


@dataclass
class Plan:
    keep_last: int
    kept: dict[str, list[str]]          # path -> why it stays
    outs: list[Out]
    stores: list[Store]
    problems: list[str] = field(default_factory=list)
    freed: int = 0                      # bytes this machine's disk gets back (links counted once)

    def total(self, place: str) -> int:
        return sum(o.bytes.get(place, 0) for o in self.outs)


def stores(repo: Any) -> tuple[list[Store], list[str]]:
    """The cache and the default remote (when one is set and reachable), as DVC opens them."""
    found = [Store("cache", repo.cache.local)]
    name = repo.config["core"].get("remote")
    if not name:
        return found, []
    try:
        odb = repo.cloud.get_remote_odb(name, "gc")
    except Exception as e:   # noqa: BLE001 (an unusable remote is reported, not fatal)
        return found, [f"remote '{name}': {e}"]
    if not odb.fs.exists(odb.path):
        return found, [f"remote '{name}' at {odb.path}: unreachable (no such directory)"]
    return found + [Store(f"remote '{name}'", odb)], []


def _manifest(places: list[Store], md5: str) -> list[dict[str, Any]] | None:
    for s in places:
        path = s.odb.oid_to_path(md5)
        if s.odb.fs.exists(path):
            return json.loads(s.odb.fs.cat_file(path))
    return None


def objects(places: list[Store], md5: str) -> set[str] | None:
    """The objects of one output: its md5, and for a directory the files its manifest lists
    (None when no store holds the manifest)."""
    if not md5.endswith(".dir"):
        return {md5}
    entries = _manifest(places, md5)
    return None if entries is None else {md5} | {e["md5"] for e in entries}


def _base_named(root: Path, places: list[Store], path: str, md5: str) -> str | None:
    """The base an adapter directory names (workspace path), read from the workspace or a
    store; None for a full model."""
    file = root / path / BASE_FILE
    if file.is_file():
        return str(json.loads(file.read_text()).get("base_path") or "") or None
    for e in _manifest(places, md5) or []:
        if e["relpath"] == BASE_FILE:
            for s in places:
                obj = s.odb.oid_to_path(e["md5"])
                if s.odb.fs.exists(obj):
                    return str(json.loads(s.odb.fs.cat_file(obj)).get("base_path") or "") or None
    return None


def _aliased(client: Any) -> dict[tuple[str, str], list[str]]:
    """(model_path, model_md5) -> "alias NAME -> MODEL vN" of every alias."""
    from mlflow.exceptions import MlflowException
    out: dict[tuple[str, str], list[str]] = {}
    for model in (POLICY_MODEL, REWARD_MODEL):
        try:
            aliases = client.get_registered_model(model).aliases or {}
        except MlflowException:
            continue
        for alias, version in aliases.items():
            tags = client.get_model_version(model, str(version)).tags
            key = (tags.get("model_path", ""), tags.get("model_md5", ""))
            out.setdefault(key, []).append(f"alias {alias} -> {model} v{version}")
    return out


def _versions(client: Any) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(model_path, model_md5) -> [(model, version)] of every registered version."""
    out: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for model in (POLICY_MODEL, REWARD_MODEL):
        for mv in client.search_model_versions(f"name = '{model}'"):
            key = (mv.tags.get("model_path", ""), mv.tags.get("model_md5", ""))
            out.setdefault(key, []).append((model, str(mv.version)))
    return out


def _keep(lock: dict[str, Any], keep_last: int, aliased: dict[tuple[str, str], list[str]]
          ) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Every out in dvc.lock (path -> md5) and why each model out stays."""
    outs = {o["path"]: o.get("md5", "") for e in lock.values() for o in e.get("outs", [])}
    iterations = sorted({parse_name(n).iteration for n in lock} - {0})
    last = set(iterations[-keep_last:]) if keep_last > 0 else set()
    kept: dict[str, list[str]] = {}
    for path, md5 in outs.items():
        m = MODEL_OUT.match(path)
        if m is None or int(m.group(1)) == 0:
            kept.setdefault(path, []).append("data or the initial model" if m is None
                                             else "the initial model (every adapter's base)")
        elif int(m.group(1)) in last:
            kept.setdefault(path, []).append(f"iteration {m.group(1)} is among the last "
                                             f"{keep_last}")
        if (path, md5) in aliased:
            kept.setdefault(path, []).extend(aliased[(path, md5)])
    for name, entry in lock.items():
        ref = parse_name(name)
        if ref.iteration in last or ref.iteration == 0:
            for d in entry.get("deps", []):
                if MODEL_OUT.match(d["path"]) and d["path"] not in kept:
                    kept.setdefault(d["path"], []).append(f"read by {name}")
    return outs, kept


def plan(root: Path, client: Any, keep_last: int) -> Plan:
    """What `gc --keep-last keep_last` archives and what each part of it weighs, per place."""
    from dvc.repo import Repo
    lock = read_lock(root)
    outs, kept = _keep(lock, keep_last, _aliased(client))
    with contextlib.chdir(root), Repo(str(root)) as repo:
        places, problems = stores(repo)
    for path in [p for p in kept if MODEL_OUT.match(p)]:      # the bases kept adapters name
        base = _base_named(root, places, path, outs.get(path, ""))
        if base and base in outs:
            kept.setdefault(base, []).append(f"the base of adapter {path}")
    versions = _versions(client)
    candidates = [Out(p, m, int(MODEL_OUT.match(p).group(1)),   # type: ignore[union-attr]
                      [f"{n} v{v}" for n, v in versions.get((p, m), [])])
                  for p, m in sorted(outs.items()) if MODEL_OUT.match(p) and p not in kept]
    shared: set[str] = set()
    for path in kept:
        held = objects(places, outs[path])
        if held is None and outs[path]:
            problems.append(f"{path} ({outs[path]}): its manifest is in no store, so the "
                            "objects it shares are unknown; nothing is archived")
        shared |= held or set()
    taken: set[str] = set()
    for out in candidates:
        oids = (objects(places, out.md5) or {out.md5}) - shared - taken
        taken |= oids
        out.oids = sorted(oids)
        out.bytes = _weigh(root / out.path, places, out.oids)
    gone = [o for o in candidates if any(o.bytes.values())]
    return Plan(keep_last, kept, [] if problems else gone, places, problems,
                freed=_freed(root, places, [] if problems else gone))


def _weigh(directory: Path, places: list[Store], oids: list[str]) -> dict[str, int]:
    """Bytes present per place: the workspace directory's files, each store's objects."""
    sizes = {"workspace": sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
             if directory.is_dir() else 0}
    for s in places:
        total = 0
        for oid in oids:
            with contextlib.suppress(FileNotFoundError, OSError):
                total += int(s.odb.fs.size(s.odb.oid_to_path(oid)))
        sizes[s.label] = total
    return sizes


def _freed(root: Path, places: list[Store], outs: list[Out]) -> int:
    """Bytes of the files whose every link goes: the workspace's files are hard links to the
    cache's objects (where the filesystem links), and a linked object that a kept output
    shares stays."""
    paths = [f for o in outs if (root / o.path).is_dir()
             for f in (root / o.path).rglob("*") if f.is_file()]
    for s in places:
        if s.odb.fs.protocol in ("local", "file"):
            paths += [Path(s.odb.oid_to_path(oid)) for o in outs for oid in o.oids]
    links: dict[tuple[int, int], list[int]] = {}
    for f in paths:
        with contextlib.suppress(FileNotFoundError):
            st = f.stat()
            entry = links.setdefault((st.st_dev, st.st_ino), [st.st_size, st.st_nlink, 0])
            entry[2] += 1
    return sum(size for size, nlink, seen in links.values() if seen >= nlink)


def human(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000          # type: ignore[assignment]
    return str(n)


# -- applying a plan --------------------------------------------------------------------------


def _move(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.rename(src, dst)


@contextlib.contextmanager
def _aside(root: Path, trash: Path, p: Plan) -> Iterator[list[tuple[Path, Path]]]:
    """Move the workspace directories and cache objects into `trash`; put them back if the
    block fails (an exception or a signal)."""
    moved: list[tuple[Path, Path]] = []
    cache = next(s for s in p.stores if s.label == "cache").odb
    try:
        for out in p.outs:
            if (root / out.path).exists():
                moved.append((root / out.path, trash / "workspace" / out.path))
                _move(*moved[-1])
            for oid in out.oids:
                obj = Path(cache.oid_to_path(oid))
                if obj.exists():
                    moved.append((obj, trash / "cache" / oid))
                    _move(*moved[-1])
        yield moved
    except BaseException:
        for src, dst in reversed(moved):
            with contextlib.suppress(OSError):
                _move(dst, src)
        shutil.rmtree(trash, ignore_errors=True)
        raise


def _drop(path: Path) -> None:
    """Remove a tree DVC made read-only."""
    for f in [path, *path.rglob("*")] if path.is_dir() else []:
        with contextlib.suppress(OSError):
            f.chmod(0o700 if f.is_dir() else 0o600)
    shutil.rmtree(path, ignore_errors=True)


def finish_interrupted(root: Path, state: Path) -> list[str]:
    """The trash a killed gc left: dropped when its ledger line was committed, else put back
    (`workspace/<path>` to the workspace, `cache/<oid>` to the cache)."""
    from flows.verify import CACHE, object_path
    done = {e.get("gc_id") for e in archived.read_ledger(root)}
    fixed = []
    for trash in sorted((state / TRASH).glob("*")):
        if trash.name not in done:
            for d in sorted((trash / "workspace" / "models").glob("iter_*/*")):
                if not (root / d.relative_to(trash / "workspace")).exists():
                    _move(d, root / d.relative_to(trash / "workspace"))
            for f in sorted((trash / "cache").glob("*")):
                if not object_path(root / CACHE, f.name).exists():
                    _move(f, object_path(root / CACHE, f.name))
        _drop(trash)
        fixed.append(f"gc {trash.name}: " + ("finished" if trash.name in done else
                                             "interrupted before its record; put back"))
    return fixed


def apply(root: Path, state: Path, p: Plan, client: Any, who: str) -> str:
    """Archive the plan's outputs; returns the gc's id (its ledger lines carry it)."""
    from flows import registry_record
    from flows.workspace import git
    from tasks.core import atomic
    gc_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ledger = root / archived.LEDGER
    before = ledger.read_text() if ledger.is_file() else None
    tagged: list[tuple[str, str]] = []
    with _aside(root, state / TRASH / gc_id, p):
        try:
            crashpoints.reach("gc_aside", 0)
            lines = []
            for out in p.outs:
                moved = ", ".join(f"{k} {human(v)}" for k, v in out.bytes.items())
                for label in out.versions:
                    model, _, version = label.rpartition(" v")
                    client.set_model_version_tag(model, version, archived.TAG,
                                                 f"{stamp} by {who}: alignloop gc --keep-last "
                                                 f"{p.keep_last} ({moved})")
                    tagged.append((model, version))
                lines.append({"gc_id": gc_id, "time": stamp, "who": who,
                              "keep_last": p.keep_last, "iteration": out.iteration,
                              "path": out.path, "md5": out.md5, "versions": out.versions,
                              "objects": len(out.oids), "bytes": out.bytes})
            atomic.write_text(ledger, (before or "") + "".join(
                json.dumps(x, sort_keys=True) + "\n" for x in lines))
            registry_record.write(root, client)
            iterations = ", ".join(sorted({str(o.iteration) for o in p.outs}, key=int))
            registry_record.commit(root, f"alignloop: gc archived the weights of iteration(s) "
                                         f"{iterations}", also=(archived.LEDGER,))
        except BaseException:
            for model, version in tagged:
                with contextlib.suppress(Exception):
                    client.delete_model_version_tag(model, version, archived.TAG)
            if before is None:
                ledger.unlink(missing_ok=True)
            else:
                atomic.write_text(ledger, before)
            with contextlib.suppress(Exception):
                git(root, "checkout", "--", registry_record.RECORD)
            raise
    crashpoints.reach("gc_record", 0)
    for s in p.stores:                                       # committed: now the remote
        if s.label != "cache":
            for out in p.outs:
                for oid in out.oids:
                    with contextlib.suppress(FileNotFoundError):
                        s.odb.delete(oid)
    _drop(state / TRASH / gc_id)
    with contextlib.suppress(OSError):
        (state / TRASH).rmdir()
    return gc_id
