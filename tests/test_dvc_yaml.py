"""dvc.yaml agrees with the code: source deps cover the imports, paths follow tasks/layout.py,
declared params exist, and every artifact a stage depends on is produced before it."""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks import layout

ROOT = Path(__file__).resolve().parents[1]
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())
STAGES: dict[str, dict[str, Any]] = DVC["stages"]
TINY = yaml.safe_load((ROOT / "params" / "tiny.yaml").read_text())
PROFILES = sorted((ROOT / "params").glob("*.yaml"))
CMD = re.compile(r"^python -m tasks\.(\w+)( --it \$\{key\})?$")


def body(name: str) -> dict[str, Any]:
    """A stage's definition (the `do` block of a foreach stage)."""
    return STAGES[name].get("do", STAGES[name])


def is_loop(name: str) -> bool:
    return "foreach" in STAGES[name]


def module_of(name: str) -> str:
    m = CMD.match(body(name)["cmd"])
    assert m, f"{name}: unexpected cmd {body(name)['cmd']!r}"
    return m.group(1)


@cache
def direct_imports(module: str) -> frozenset[str]:
    """tasks modules imported anywhere in tasks/<module>.py (function-level imports included)."""
    tree = ast.parse((ROOT / "tasks" / f"{module}.py").read_text(), filename=f"{module}.py")
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "tasks":                       # from tasks import a, b
                out |= {a.name for a in node.names}
            elif node.module.startswith("tasks."):           # from tasks.x import y
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):                   # import tasks.x
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("tasks.")}
    return frozenset(out)


def closure(module: str) -> set[str]:
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(direct_imports(m))
    return seen


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
    the set-up stages, then each iteration's loop stages."""
    setup: list[tuple[str, str | None]] = [(n, None) for n in STAGES if not is_loop(n)]
    return setup + [(n, key) for key in TINY["iterations"] for n in STAGES if is_loop(n)]


# --- commands and sources ---------------------------------------------------------------------

def test_expected_stages_declared() -> None:
    assert list(STAGES) == ["prompts", "prepare_model", "collect_offpolicy", "reference_samples",
                            "rollout", "judge", "train_rm", "update", "evaluate", "gate"]
    assert [n for n in STAGES if is_loop(n)] == ["rollout", "judge", "train_rm", "update",
                                                 "evaluate", "gate"]
    assert all(STAGES[n]["foreach"] == "${iterations}" for n in STAGES if is_loop(n))


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
    missing = sorted(closure(module) - declared)
    assert not missing, f"{name}: imported but not declared: " + \
        ", ".join(f"tasks/{m}.py" for m in missing)


@pytest.mark.parametrize("name", list(STAGES))
def test_source_deps_are_not_stale(name: str) -> None:
    declared = {d.removeprefix("tasks/").removesuffix(".py") for d in source_deps(name)}
    extra = sorted(declared - closure(module_of(name)))
    assert not extra, f"{name}: declared but never imported (reruns for nothing): {extra}"


@pytest.mark.parametrize("name", list(STAGES))
def test_source_deps_exist(name: str) -> None:
    deps = source_deps(name)
    assert len(deps) == len(set(deps)), f"{name}: duplicate source deps"
    for dep in deps:
        assert dep.endswith(".py") and (ROOT / dep).is_file(), f"{name}: {dep} does not exist"


def test_import_scanner_sees_every_import_form() -> None:
    assert {"atomic", "layout", "lm", "stage"} <= direct_imports("prepare_model")   # from tasks import
    assert "params" in direct_imports("prepare_model")                               # from tasks.x import
    assert {"tiny_model", "gguf_convert"} <= direct_imports("prepare_model")        # in a function
    assert "sampling" in closure("evaluate") and "sampling" not in direct_imports("evaluate")


# --- artifact paths ---------------------------------------------------------------------------

def expected_outputs(name: str, it: int) -> tuple[list[str], list[str]]:
    """(outs, metrics) of a stage instance, from tasks/layout.py."""
    return {
        "prompts": ([layout.PROMPTS_TRAIN, layout.PROMPTS_HELDOUT], []),
        "prepare_model": ([layout.policy(0)], []),
        "collect_offpolicy": ([layout.pairs_pool(0)], [layout.OFFPOLICY_METRICS]),
        "reference_samples": ([layout.REFERENCE_SAMPLES, layout.BEST_OF_N_SAMPLES], []),
        "rollout": ([layout.rollouts(it)], [layout.metrics(it, "rollout")]),
        "judge": ([layout.pairs(it), layout.pairs_pool(it)], [layout.metrics(it, "judge")]),
        "train_rm": ([layout.reward_model(it), layout.audit_queue(it)],
                     [layout.metrics(it, "train_rm")]),
        "update": ([layout.policy(it)], [layout.metrics(it, "update")]),
        "evaluate": ([layout.eval_samples(it)], [layout.metrics(it, "evaluate")]),
        "gate": ([layout.gate(it)], []),
    }[name]


@pytest.mark.parametrize("name, key", instances())
def test_outs_and_metrics_match_layout(name: str, key: str | None) -> None:
    outs, metrics = expected_outputs(name, int(key) if key else 0)
    assert rendered(name, "outs", key) == outs
    assert rendered(name, "metrics", key) == metrics


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
              TINY["evaluate"]["gold"]["register_examples_file"], "params/judges"}
    produced: set[str] = set()
    for name, key in instances():
        for dep in rendered(name, "deps", key):
            if not dep.startswith("tasks/"):
                assert dep in inputs or dep in produced, \
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
    assert declared, f"{name}: declares no params"
    assert all(isinstance(k, str) for k in declared), f"{name}: params must be key names"


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_declared_params_exist_in_profile(profile: Path) -> None:
    data = yaml.safe_load(profile.read_text())
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
