"""Lineage of a registered model version, back to the data bytes, and proof it is recoverable.

The tree comes from the registry (version tags: git commit, DVC stage, parent policy, reward
model, judge, Prefect flow run, MLflow run) joined with `dvc.lock` *at that git commit* (every
stage's deps and outs with md5, size, file count, and the params values it read), recursing
through the stages that produced each input until the initial model and the first data.
`verify` re-hashes every artifact in the tree from the DVC cache and the remote.

Pairs imported from another workspace (`alignloop import --from-workspace`) cross the boundary:
an input under data/import whose commit holds data/import/book.json gains a `book` node, the
manifest with each source pool's artifact and the tree of the stage that produced it, read from
the other workspace's dvc.lock at the book's commit (or `source_workspace: "not found"`).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from mlflow.tracking import MlflowClient

from flows import archived
from flows.registry import params_md5
from flows.verify import CACHE, object_path
from flows.workspace import git
from tasks.core import layout
from tasks.core.errors import InputError

BASE_FILE = layout.ADAPTER_BASE     # the base an adapter or head-only RM names (lm.BaseRecord)
URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")


class LineageError(InputError):
    """A model URI that does not resolve, or a workspace that lacks the recorded commit."""


def resolve(client: MlflowClient, uri: str) -> Any:
    m = URI.match(uri)
    if not m:
        raise LineageError(f"{uri}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    from mlflow.exceptions import MlflowException
    try:
        if m["alias"]:
            return client.get_model_version_by_alias(m["name"], m["alias"])
        return client.get_model_version(m["name"], m["version"])
    except MlflowException:
        raise LineageError(f"{uri}: {_missing(client, m['name'], m['alias'])}") from None


def _missing(client: MlflowClient, name: str, alias: str | None) -> str:
    """What the registry has instead of the model, alias or version asked for."""
    names = sorted(rm.name for rm in client.search_registered_models())
    if name not in names:
        return f"no registered model {name} (registered: {', '.join(names) or 'none'})"
    if alias:
        aliases = client.get_registered_model(name).aliases or {}
        have = ", ".join(f"{a} -> v{v}" for a, v in sorted(aliases.items())) or "none"
        return f"{name} has no alias {alias} (aliases: {have})"
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    return f"{name} has no such version (versions: {', '.join(map(str, versions)) or 'none'})"


def _at_commit(root: Path, commit: str, path: str) -> str:
    try:
        return git(root, "show", f"{commit}:{path}")
    except RuntimeError as e:
        raise LineageError(f"{root}: cannot read {path} at commit {commit[:10]}: {e}") from None


def _rows(root: Path, path: str, md5: str) -> int | None:
    obj = object_path(root / CACHE, md5)
    if not path.endswith(".jsonl") or not obj.is_file():
        return None
    with obj.open("rb") as f:
        return sum(1 for line in f if line.strip())


def _artifact(root: Path, item: dict[str, Any]) -> dict[str, Any]:
    out = {"path": item["path"], "md5": item.get("md5"), "size": item.get("size")}
    if "nfiles" in item:
        out["nfiles"] = item["nfiles"]
    rows = _rows(root, item["path"], item.get("md5", "")) if item.get("md5") else None
    if rows is not None:
        out["rows"] = rows
    return out


def stage_tree(root: Path, lock: dict[str, Any], name: str, seen: set[str],
               commit: str | None = None, sources: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A stage with its params, outs and inputs; each input names the stage that produced it.
    With the lock's `commit`, an input under data/import carries the book it came from (its
    source workspace where the book recorded it, or the first of `sources` whose git holds the
    book's commit: a clone or copy of it)."""
    entry = lock[name]
    producers = {o["path"]: s for s, e in lock.items() for o in e.get("outs", [])}
    node: dict[str, Any] = {
        "stage": name, "cmd": entry.get("cmd"),
        "params": entry.get("params", {}).get(layout.PARAMS_FILE, {}),
        "params_md5": params_md5(entry),
        "outs": [_artifact(root, o) for o in entry.get("outs", [])],
        "code": [{"path": d["path"], "md5": d.get("md5")} for d in entry.get("deps", [])
                 if d["path"].startswith("tasks/")],
        "inputs": [],
    }
    seen.add(name)
    listed: set[str] = set()
    for dep in entry.get("deps", []):
        # a path dvc.yaml names twice for one instance (iteration 1's `prev` is iteration 0's
        # model, also named as a LoRA policy's base or the reference) is one input
        if dep["path"].startswith("tasks/") or dep["path"] in listed:
            continue
        listed.add(dep["path"])
        item = _artifact(root, dep)
        producer = producers.get(dep["path"])
        if producer is None:
            item["produced_by"] = "source (tracked in git)"
        elif producer in seen:
            item["produced_by"] = {"stage": producer, "see": "above"}
        else:
            item["produced_by"] = stage_tree(root, lock, producer, seen, commit, sources)
        if commit and _imported(dep["path"]) and (book := book_node(root, commit, sources)):
            item["book"] = book
        node["inputs"].append(item)
    return node


def _imported(path: str) -> bool:
    return path == layout.IMPORT_DIR or path.startswith(layout.IMPORT_DIR + "/")


def book_source(book: dict[str, Any],
                sources: tuple[Path, ...] = ()) -> tuple[Path, bytes] | None:
    """Where the book's source workspace is read, with its dvc.lock at the book's commit: the
    first of `sources` (clones or copies of it, `--book-source`) whose git holds that commit,
    else the path the book recorded; None: neither is here."""
    from flows.workspace import git_bytes
    for cand in (*sources, Path(book["workspace"])):
        if (cand / ".git").exists():
            lock = git_bytes(cand, "show", f"{book['commit']}:dvc.lock")
            if lock is not None:
                return cand.resolve(), lock
    return None


def book_node(root: Path, commit: str, sources: tuple[Path, ...] = ()) -> dict[str, Any] | None:
    """The manifest of the book imported at `commit` (None: none), each pool with the other
    workspace's artifact record and producing stage at the book's commit; `read_from` names
    the clone it was read from when that is not the recorded path."""
    from flows.workspace import git_bytes
    text = git_bytes(root, "show", f"{commit}:{layout.BOOK_MANIFEST}")
    if text is None:
        return None
    book = json.loads(text)
    at = book["commit"]
    found = book_source(book, sources)
    if found is None:
        why = ("not found" if not Path(book["workspace"]).exists()
               else f"has no dvc.lock at commit {at[:10]}")
        if sources:
            why += (f", nor has --book-source {', '.join(str(s) for s in sources)} "
                    f"(no git history holding commit {at[:10]})")
        return {**book, "source_workspace": why}
    other, lock_text = found
    if other != Path(book["workspace"]).resolve():
        book = {**book, "read_from": str(other)}
    lock = yaml.safe_load(lock_text)["stages"]
    producers = {o["path"]: (s, o) for s, e in lock.items() for o in e.get("outs", [])}
    seen: set[str] = set()
    pools = []
    for pool in book["pools"]:
        stage, out = producers.get(pool["path"], (None, None))
        if stage is None:
            pools.append({**pool, "produced_by": f"no stage of {other} at {at[:10]} outputs it"})
            continue
        tree: Any = ({"stage": stage, "see": "above"} if stage in seen
                     else stage_tree(other, lock, stage, seen, at, sources))
        pools.append({**pool, **_artifact(other, out), "produced_by": tree})
    return {**book, "pools": pools}


def model_lineage(root: Path, client: MlflowClient, mv: Any, depth: int = 0,
                  sources: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A version's tree; `sources`: clones or copies of imported books' source workspaces
    (`book_source`)."""
    tags = dict(mv.tags)
    commit = tags.get("git_commit")
    if not commit:
        raise LineageError(f"{mv.name} v{mv.version}: no git_commit tag (not an alignloop model)")
    lock = yaml.safe_load(_at_commit(root, commit, "dvc.lock"))["stages"]
    node: dict[str, Any] = {
        "model": mv.name, "version": str(mv.version), "aliases": list(mv.aliases or []),
        "source": mv.source, "model_md5": tags.get("model_md5"), "git_commit": commit,
        "dvc_stage": tags.get("dvc_stage"), "iteration": tags.get("iteration"),
        "judge": tags.get("judge"), "algo": tags.get("algo"),
        "prefect_flow_run_id": tags.get("prefect_flow_run_id"), "mlflow_run_id": mv.run_id,
        "alias_history": {k: v for k, v in tags.items() if k.startswith("alias.")},
        "archived": tags.get(archived.TAG),
        "base": adapter_base(root, lock, tags.get("model_md5", "")),
        "produced_by": stage_tree(root, lock, tags["dvc_stage"], set(), commit, sources),
    }
    rm_version = tags.get("reward_model_version")
    if rm_version:
        rm = client.get_model_version("alignloop-reward-model", rm_version)
        node["reward_model"] = {"model": rm.name, "version": str(rm.version),
                                "model_md5": rm.tags.get("model_md5"),
                                "dvc_stage": rm.tags.get("dvc_stage"), "mlflow_run_id": rm.run_id,
                                "archived": rm.tags.get(archived.TAG)}
    parent = tags.get("parent_policy_version")
    if parent and parent not in ("initial", "unknown"):
        node["parent_policy"] = model_lineage(root, client, client.get_model_version(
            mv.name, parent), depth + 1, sources)
    else:
        node["parent_policy"] = parent
    return node


def adapter_base(root: Path, lock: dict[str, Any], model_md5: str) -> dict[str, Any] | None:
    """The base a LoRA adapter version names (its alignloop_base.json, read from the DVC
    stores): workspace path, the weights md5 it recorded, and that path's out in dvc.lock at
    the version's commit. None for a full model or weights no store holds."""
    from flows.verify import read_member, stores
    text = read_member([s.base for s in stores(root, skip_remote=False) if s.base],
                       model_md5, BASE_FILE)
    if text is None:
        return None
    data = json.loads(text)
    path = str(data.get("base_path", ""))
    producers = [o for e in lock.values() for o in e.get("outs", []) if o["path"] == path]
    return {"path": path, "weights_md5": data.get("base_md5"),
            "dvc_md5": producers[0].get("md5") if producers else None}


def _dicts(n: Any, into_books: bool = True) -> Iterator[dict[str, Any]]:
    """Every mapping of a lineage tree, depth first; not inside `book` nodes unless into_books."""
    if isinstance(n, dict):
        yield n
        for k, v in n.items():
            if into_books or k != "book":
                yield from _dicts(v, into_books)
    elif isinstance(n, list):
        for v in n:
            yield from _dicts(v, into_books)


def iter_artifacts(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Every out in the tree (each stage's outputs, recursively), once per (path, md5); not
    those of a book's workspace (`iter_books`: each book is verified against its own)."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for n in _dicts(node, into_books=False):
        if "stage" in n and "outs" in n:
            for o in n["outs"]:
                found[(o["path"], o["md5"])] = o
    return list(found.values())


def iter_books(node: Any) -> list[dict[str, Any]]:
    """Every book node in the tree, books inside books included, once per (workspace, commit)."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for n in _dicts(node):
        if isinstance(n.get("book"), dict):
            b = n["book"]
            found.setdefault((b["workspace"], b["commit"]), b)
    return list(found.values())


def book_artifacts(book: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """The artifacts of a book's source workspace to re-hash there, with the book's commit:
    each pool, and every out upstream of it."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for pool in book["pools"]:
        found[(pool["path"], pool["md5"])] = {"path": pool["path"], "md5": pool["md5"]}
        if isinstance(pool.get("produced_by"), dict):
            for a in iter_artifacts(pool["produced_by"]):
                found.setdefault((a["path"], a["md5"]), a)
    return [(a, book["commit"]) for a in found.values()]
