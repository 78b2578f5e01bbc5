"""dvc.yaml agrees with the code: source deps cover the imports, paths follow tasks/core/layout.py,
declared params exist, and every artifact a stage depends on is produced before it."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import project_imports
from tasks.config.profiles import read_profile
from tasks.core import layout
from tasks.runtime.stage import Contract

ROOT = Path(__file__).resolve().parents[1]
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())
STAGES: dict[str, dict[str, Any]] = DVC["stages"]
TINY = yaml.safe_load((ROOT / "params" / "tiny.yaml").read_text())
PROFILES = sorted((ROOT / "params").glob("*.yaml"))
CMD = re.compile(r"^python -m tasks\.stages\.(\w+)( --it \$\{key\})?$")


def body(name: str) -> dict[str, Any]:
    """A stage's definition (the `do` block of a foreach stage)."""
    return STAGES[name].get("do", STAGES[name])


def is_loop(name: str) -> bool:
    return "foreach" in STAGES[name]


def module_of(name: str) -> str:
    """The stage's module as a path under tasks/ without .py: `stages/rollout`."""
    m = CMD.match(body(name)["cmd"])
    assert m, f"{name}: unexpected cmd {body(name)['cmd']!r}"
    return f"stages/{m.group(1)}"


def _module(dotted: str) -> str:
    """`tasks.x` -> `x`, `tasks.stages.y` -> `stages/y`."""
    return "/".join(dotted.split(".")[1:])


TASKS_MODULES = frozenset(".".join(p.relative_to(ROOT).with_suffix("").parts)
                          for p in (ROOT / "tasks").rglob("*.py") if p.stem != "__init__")


def imports_in(source: str) -> set[str]:
    """tasks modules a Python source imports anywhere (function-level imports included), as
    paths under tasks/ without .py. The packages' __init__ files hold no code
    (test_packages_hold_no_code) and are not deps; imports under `if TYPE_CHECKING:` never
    run and are not deps either."""
    return {_module(m) for m in project_imports(source, TASKS_MODULES)}


@cache
def direct_imports(module: str) -> frozenset[str]:
    """What tasks/<module>.py imports (`imports_in`)."""
    return frozenset(imports_in((ROOT / "tasks" / f"{module}.py").read_text()))


def closure(module: str) -> set[str]:
    """Every tasks module `module` imports, directly or not, except the section schemas that
    the loader (tasks/config/params.py) imports to build a whole Params: a stage reads only the keys
    its contract declares (`Declared`), so of those it depends on its declared sections' only
    (`stage_sources`). A schema class a module imports itself is followed as any import."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(d for d in direct_imports(m)
                        if not (m == "config/params" and d.startswith("schemas/")))
    return seen


def declared_sections(name: str) -> set[str]:
    """The top-level params sections a stage's contract declares (keys of Params itself, the
    run seed, device and iterations, are the loader's)."""
    return {k.split(".")[0] for k in contract(name).params} - {"seed", "device", "iterations"}


def stage_sources(name: str) -> set[str]:
    """The modules a stage's source deps must hold: its imports and its sections' schemas."""
    out = closure(module_of(name))
    for section in declared_sections(name):
        out |= closure(f"schemas/{section}")
    return out


def source_deps(name: str) -> list[str]:
    return [d for d in body(name).get("deps", []) if d.startswith("tasks/")]


def lookup(ctx: dict[str, Any], dotted: str) -> Any:
    value: Any = ctx
    for part in dotted.split("."):
        value = value[part]
    return value


def render(text: str, ctx: dict[str, Any]) -> str:
    return re.sub(r"\$\{([^}]+)\}", lambda m: str(lookup(ctx, m.group(1).strip())), text)


def paths(entries: list[Any]) -> list[str]:
    """Path strings of a deps/outs/metrics list (entries may be `{path: {options}}`)."""
    return [e if isinstance(e, str) else next(iter(e)) for e in entries]


def rendered(name: str, field: str, key: str | None) -> list[str]:
    ctx = dict(TINY)
    if key is not None:
        ctx.update(key=key, item=TINY["iterations"][key])
    return [render(p, ctx) for p in paths(body(name).get(field, []))]


def instances() -> list[tuple[str, str | None]]:
    """(stage, iteration key) for every stage DVC unrolls from the tiny profile, in run order:
    the set-up stages, each iteration's loop stages, then the final stages."""
    setup: list[tuple[str, str | None]] = [(n, None) for n in layout.SETUP_STAGES]
    final: list[tuple[str, str | None]] = [(n, None) for n in layout.FINAL_STAGES]
    return setup + [(n, key) for key in TINY["iterations"] for n in STAGES if is_loop(n)] + final


# --- commands and sources ---------------------------------------------------------------------

def test_expected_stages_declared() -> None:
    assert list(STAGES) == ["prompts", "prepare_model", "collect_offpolicy", "reference_samples",
                            "rollout", "judge", "train_rm", "update", "evaluate", "gate",
                            "report"]
    assert [n for n in STAGES if is_loop(n)] == ["rollout", "judge", "train_rm", "update",
                                                 "evaluate", "gate"]
    assert all(STAGES[n]["foreach"] == "${iterations}" for n in STAGES if is_loop(n))
    assert (list(STAGES), [n for n in STAGES if is_loop(n)]) == \
        (list(layout.STAGES), list(layout.LOOP_STAGES))          # the names the flow reads


@pytest.mark.parametrize("name", list(STAGES))
def test_cmd_runs_a_stage_module(name: str) -> None:
    module = module_of(name)
    assert (CMD.match(body(name)["cmd"]).group(2) is not None) == is_loop(name)  # type: ignore[union-attr]
    tree = ast.parse((ROOT / "tasks" / f"{module}.py").read_text())
    assert "main" in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("name", list(STAGES))
def test_source_deps_cover_transitive_imports(name: str) -> None:
    module = module_of(name)
    declared = {d.removeprefix("tasks/").removesuffix(".py") for d in source_deps(name)}
    assert module in declared, f"{name}: its own tasks/{module}.py is not a dep"
    missing = sorted(stage_sources(name) - declared)
    assert not missing, f"{name}: imported but not declared: " + \
        ", ".join(f"tasks/{m}.py" for m in missing)


@pytest.mark.parametrize("name", list(STAGES))
def test_source_deps_are_not_stale(name: str) -> None:
    declared = {d.removeprefix("tasks/").removesuffix(".py") for d in source_deps(name)}
    extra = sorted(declared - stage_sources(name))
    assert not extra, f"{name}: declared but never imported (reruns for nothing): {extra}"


@pytest.mark.parametrize("name", list(STAGES))
def test_source_deps_exist(name: str) -> None:
    deps = source_deps(name)
    assert len(deps) == len(set(deps)), f"{name}: duplicate source deps"
    for dep in deps:
        assert dep.endswith(".py") and (ROOT / dep).is_file(), f"{name}: {dep} does not exist"


STAGE_MODULES = sorted(f"stages/{f.stem}" for f in (ROOT / "tasks" / "stages").glob("*.py")
                       if f.stem != "__init__")
LIBRARIES = sorted(f.relative_to(ROOT / "tasks").with_suffix("").as_posix()
                   for f in (ROOT / "tasks").glob("*/*.py")
                   if f.stem != "__init__" and f.parent.name not in ("stages", "schemas"))


def test_every_stage_module_is_a_stage() -> None:
    """tasks/stages/ holds exactly the modules dvc.yaml runs; libraries are the rest."""
    assert STAGE_MODULES == sorted(module_of(n) for n in STAGES)


@pytest.mark.parametrize("module", STAGE_MODULES + LIBRARIES)
def test_no_stage_imports_another(module: str) -> None:
    """A stage module imports libraries only; a library imports no stage module."""
    stages = sorted(m for m in direct_imports(module) if m.startswith("stages/") and m != module)
    assert not stages, f"tasks/{module}.py imports the stage module(s) {stages}: move what " \
        "they share into a library in tasks/"


def test_packages_hold_no_code() -> None:
    """The packages' __init__ files (tasks/, each room, stages/, schemas/) run on a stage's
    import but are no dep of any: a docstring at most. The one exception, stages/, hands a
    stage program to the run's fork server: how the stage starts, not what it computes."""
    handover = ast.dump(ast.parse("from tasks.runtime.forkserver import delegate\ndelegate()"))
    for init in sorted((ROOT / "tasks").rglob("__init__.py")):
        tree = ast.parse(init.read_text())
        body = [n for n in tree.body
                if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        if init.parent.name == "stages" and init.parent.parent.name == "tasks":
            assert ast.dump(ast.Module(body=body, type_ignores=[])) == handover, \
                f"{init.relative_to(ROOT)} holds code beyond the fork server's handover"
        else:
            assert not body, f"{init.relative_to(ROOT)} holds code"


def test_isolation_check_sees_every_form_of_a_stage_import() -> None:
    for line in ("from tasks.stages import rollout", "from tasks.stages.rollout import main",
                 "import tasks.stages.rollout", "def f():\n    from tasks.stages import rollout"):
        assert imports_in(line) == {"stages/rollout"}, line
    assert imports_in("from tasks.models import generation, lm") == {"models/generation",
                                                                       "models/lm"}
    assert imports_in("from tasks.core.layout import POOL") == {"core/layout"}
    assert imports_in("import tasks.core.layout") == {"core/layout"}


def test_schema_classes_are_imported_from_their_schema_module() -> None:
    """tasks/config/params.py re-exports the schema for whole-profile readers (flows, tests); a
    module in tasks/ that imported a class through it would hide that schema from
    `stage_sources`."""
    tree = ast.parse((ROOT / "tasks" / "config" / "params.py").read_text())
    own = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | \
        {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
         for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
         if isinstance(t, ast.Name)}
    for path in sorted((ROOT / "tasks").rglob("*.py")):
        if path.name == "params.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "tasks.config.params":
                through = sorted({a.name for a in node.names} - own)
                assert not through, f"{path.relative_to(ROOT)}: import {through} from " \
                    "tasks.schemas.<section>, not through tasks.config.params"


def test_every_section_has_its_schema_module() -> None:
    from tasks.config.params import Params
    sections = {f.name for f in dataclasses.fields(Params)} - {"seed", "device", "iterations"}
    assert sections == {f.stem for f in (ROOT / "tasks" / "schemas").glob("*.py")} - \
        {"__init__", "generation"}
    for name in STAGES:
        assert declared_sections(name) <= sections, name


def test_import_scanner_sees_every_import_form() -> None:
    prepare = direct_imports("stages/prepare_model")
    assert {"core/atomic", "core/layout", "models/lm", "runtime/stage"} <= prepare  # a room's
    assert "schemas/model" in prepare                                     # from tasks.x.y import
    assert {"models/tiny_model", "models/gguf_convert"} <= prepare        # in a function
    evaluate = "stages/evaluate"
    assert "models/sampling" in closure(evaluate)
    assert "models/sampling" not in direct_imports(evaluate)
    assert "reward/probe" in direct_imports("stages/train_rm")
    assert imports_in("if TYPE_CHECKING:\n    import tasks.core.atomic\nelse:\n"
                      "    import tasks.core.layout\n") == {"core/layout"}


# --- artifact paths ---------------------------------------------------------------------------

def contract(name: str) -> Contract:
    """The stage module's own declaration (tasks/stages/<name>.py: CONTRACT)."""
    c: Contract = importlib.import_module(f"tasks.stages.{name}").CONTRACT
    assert c.name == name, f"tasks/stages/{name}.py: CONTRACT names stage {c.name!r}"
    return c


def declared(name: str, field: str) -> list[str]:
    """A contract's paths as dvc.yaml writes them (`${key}`, `${item.prev}`)."""
    paths_of = getattr(contract(name), field)
    return list(paths_of("${key}", "${item.prev}"))


@pytest.mark.parametrize("name", list(STAGES))
def test_dvc_yaml_agrees_with_the_stage_contract(name: str) -> None:
    """params (exact keys, in order), data deps, outs and metrics: as the module declares."""
    assert body(name).get("params", []) == list(contract(name).params)
    data_deps = [d for d in paths(body(name).get("deps", [])) if not d.startswith("tasks/")]
    assert data_deps == declared(name, "deps")
    assert paths(body(name).get("outs", [])) == declared(name, "outs")
    assert paths(body(name).get("metrics", [])) == declared(name, "metrics")


@pytest.mark.parametrize("name, key", instances())
def test_outs_and_metrics_match_layout(name: str, key: str | None) -> None:
    it = int(key) if key else 0
    prev = TINY["iterations"][key]["prev"] if key else 0
    c = contract(name)
    assert rendered(name, "outs", key) == list(c.outs(it, prev))
    assert rendered(name, "metrics", key) == list(c.metrics(it, prev))


def test_layout_renders_like_dvc() -> None:
    assert layout.rollouts(1) == render("data/iter_${key}/rollouts.jsonl", {"key": 1})
    assert layout.policy(0) == render("models/iter_${item.prev}/policy", {"item": {"prev": 0}})


def test_metrics_are_not_cached() -> None:
    for name in STAGES:
        for entry in body(name).get("metrics", []):
            assert isinstance(entry, dict) and next(iter(entry.values())) == {"cache": False}, \
                f"{name}: metrics should be `cache: false`"


def test_every_artifact_dep_is_produced_earlier_or_is_an_input() -> None:
    inputs = {layout.IMPORT_DIR, layout.AUDIT_LABELS, render(TINY["prompts"]["subjects_file"], TINY),
              render(TINY["prompts"]["templates_file"], TINY),
              TINY["evaluate"]["gold"]["register_examples_file"], "params/judges",
              TINY["evaluate"]["redteam"]["prompts_file"]}
    produced: set[str] = set()
    for name, key in instances():
        for dep in rendered(name, "deps", key):
            if not dep.startswith("tasks/"):        # a file, or a directory of outputs
                assert dep in inputs or dep in produced or \
                    any(o.startswith(dep + "/") for o in produced), \
                    f"{name}@{key}: depends on {dep}, which no earlier stage outputs"
        outs = rendered(name, "outs", key) + rendered(name, "metrics", key)
        assert not produced & set(outs), f"{name}@{key}: an output is declared twice"
        produced |= set(outs)


def test_iteration_deps_follow_layout() -> None:
    it, prev = 2, TINY["iterations"]["2"]["prev"]
    assert layout.policy(prev) in rendered("rollout", "deps", "2")
    assert layout.pairs_pool(prev) in rendered("judge", "deps", "2")
    assert layout.rollouts(it) in rendered("judge", "deps", "2")
    assert layout.pairs_pool(it) in rendered("train_rm", "deps", "2")
    assert {layout.pairs(it), layout.rollouts(it), layout.reward_model(it), layout.policy(prev),
            layout.policy(0)} <= set(rendered("update", "deps", "2"))
    assert {layout.policy(it), layout.reward_model(it), layout.PROMPTS_HELDOUT,
            layout.policy(0)} <= set(rendered("evaluate", "deps", "2"))


# --- params -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(STAGES))
def test_stage_declares_params(name: str) -> None:
    declared = body(name).get("params", [])
    assert declared or name == "report", f"{name}: declares no params"   # report: renders only
    assert all(isinstance(k, str) for k in declared), f"{name}: params must be key names"


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_declared_params_exist_in_profile(profile: Path) -> None:
    data = read_profile(profile).data          # with its base merged, as the workspace gets it
    for name in STAGES:
        for key in body(name).get("params", []):
            assert key.split(".")[0] in data, f"{name}: {key} not in {profile.name}"
            try:
                lookup(data, key)
            except (KeyError, TypeError):
                pytest.fail(f"{name}: params key {key} not in {profile.name}")


def test_templated_values_exist_in_tiny() -> None:
    for name in STAGES:
        for field in ("cmd", "deps", "outs", "metrics"):
            raw = body(name).get(field, [])
            text = raw if isinstance(raw, str) else " ".join(paths(raw))
            for ref in re.findall(r"\$\{([^}]+)\}", text):
                if ref.split(".")[0] not in ("key", "item"):
                    lookup(TINY, ref)        # raises KeyError when the profile lacks it


# --- conditional deps (tasks/config/conditions.py)
# ----------------------------------------------------

def test_conditional_deps_are_the_contracts_when() -> None:
    """Each dep dvc.yaml marks `# if: NAME` is one the stage's contract reads under NAME, and
    the other way round; a stage with conditional deps checks them before it reads."""
    from tasks.config import conditions
    text = (ROOT / "dvc.yaml").read_text()
    marked: dict[tuple[str, str], set[str]] = {}
    stage = None
    for line in text.splitlines():
        if re.match(r"^  (\w+):\s*$", line):
            stage = line.strip().rstrip(":")
        m = conditions.MARK.match(line)
        if m:
            marked.setdefault((stage or "", m.group(4)), set()).add(m.group(3)[2:])
    want = {}
    for name in STAGES:
        c = contract(name)
        for cond, paths in c.when.items():
            assert cond in conditions.CONDITIONS, f"{name}: {cond} is no condition"
            want[(name, cond)] = set(paths("${key}", "${item.prev}"))
        if c.when:
            tree = ast.parse((ROOT / "tasks" / f"{module_of(name)}.py").read_text())
            main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
            assert "conditions.check(CONTRACT" in ast.unparse(main), \
                f"{name}: main does not check its conditional deps"
    assert marked == want
    assert set(conditions.CONDITIONS) == {c for _, c in marked}
