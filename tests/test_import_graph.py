"""The architecture as the imports draw it: no import circle in tasks/, flows/ or benchmarks/
(function-level imports count; imports under `if TYPE_CHECKING:` never run and do not), and
the rooms of tasks/ on floors: a room imports only rooms on lower floors, never one above or
beside it."""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from conftest import project_imports, runtime_nodes

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tasks", "flows", "benchmarks")

# tasks/<room>/: the floor it stands on. A room may import rooms on lower floors only.
FLOORS = {
    "core": 0, "functional": 0, "schemas": 0,
    "config": 1, "data": 1,
    "runtime": 2,
    "models": 3,
    "reward": 4,
    "policy": 5, "judging": 5,
    "evaluation": 6,
    "stages": 7,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
            if "__pycache__" not in p.parts}


@cache
def graph() -> dict[str, frozenset[str]]:
    mods = modules()
    return {m: frozenset(project_imports(p.read_text(), mods) - {m}) for m, p in mods.items()}


def cycles(edges: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_scanner_sees_every_import_form_and_skips_type_checking() -> None:
    known = {"tasks.core.atomic", "tasks.core.layout", "tasks.models.lm", "flows.dag",
             "benchmarks.common"}
    src = ("from tasks.core import atomic, layout\n"
           "def f():\n    from tasks.models.lm import load\n"
           "import flows.dag\n"
           "if TYPE_CHECKING:\n    from benchmarks import common\n")
    assert project_imports(src, known) == {"tasks.core.atomic", "tasks.core.layout",
                                      "tasks.models.lm", "flows.dag"}


def test_cycle_finder_finds_a_cycle() -> None:
    edges = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}),
             "d": frozenset({"a"})}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": frozenset({"b"}), "b": frozenset()}) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package: str) -> None:
    found = [c for c in cycles(graph()) if c[0].split(".")[0] == package]
    assert not found, f"import circles in {package}/: " + "; ".join(" <-> ".join(c)
                                                                     for c in found)


def test_tasks_has_at_most_15_entries_and_every_room_has_a_floor() -> None:
    entries = [p for p in (ROOT / "tasks").iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 15, sorted(p.name for p in entries)
    rooms = {p.name for p in entries if p.is_dir()}
    assert rooms == set(FLOORS), f"rooms without a floor: {rooms - set(FLOORS)}; " \
        f"floors without a room: {set(FLOORS) - rooms}"
    assert not [p.name for p in entries if p.is_file() and p.name != "__init__.py"], \
        "a module at tasks/'s top level belongs in a room"


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "tasks" and len(parts) > 2 else None


def test_rooms_import_only_lower_floors() -> None:
    wrong = []
    for m, deps in graph().items():
        room = _room(m)
        if room is None:
            continue
        for d in deps:
            other = _room(d)
            if other is not None and other != room and FLOORS[other] >= FLOORS[room]:
                wrong.append(f"{m} (floor {FLOORS[room]}) imports {d} (floor {FLOORS[other]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_libraries_never_import_flows_or_prefect() -> None:
    """tasks/ runs inside stage processes: it never imports the orchestration (flows/) or
    Prefect."""
    wrong = []
    for m, p in modules().items():
        if not m.startswith("tasks."):
            continue
        for node in runtime_nodes(ast.parse(p.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            wrong += [f"{m}: {n}" for n in names if n.split(".")[0] in ("flows", "prefect")]
    assert not wrong, wrong


def test_nothing_that_trains_or_judges_reads_the_violation_checker() -> None:
    """Like gold, the violation checker (and the red-team statistics built on it) is read only
    by the stages that measure and decide: never by a judge, the reward model, a policy update
    or a stage that labels or trains, so the loop cannot learn to slip past it."""
    checker = {"tasks.evaluation.violations", "tasks.evaluation.redteam"}
    readers = {m for m, deps in graph().items() if deps & checker} - checker
    allowed = {"tasks.stages.reference_samples", "tasks.stages.evaluate", "tasks.stages.gate"}
    wrong = sorted(m for m in readers if m not in allowed and not m.startswith("benchmarks."))
    assert not wrong, f"read the violation checker: {wrong}"
    assert allowed <= readers        # the rule is about modules that exist and do read it


def test_the_cli_starts_without_the_heavy_libraries() -> None:
    """`alignloop` starts (flows.cli imported) without torch, MLflow, DVC, Prefect or
    transformers: each command imports what it uses. torch alone added 1.3 s to every command
    (tasks.data.audit, read for the audit labels, imported it at the top)."""
    import subprocess
    import sys
    code = ("import sys, flows.cli; "
            "print(sorted({'torch', 'mlflow', 'dvc', 'prefect', 'transformers'} & "
            "{m.split('.')[0] for m in sys.modules}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
