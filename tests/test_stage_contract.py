"""The stage contract on the user's and the developer's path: a stage reads only the params keys
it declares, and an edit reruns the stages that declare what was edited (real DVC, in a copy of
the shared tiny run's workspace)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, copy_workspace
from tasks.config.params import load_params
from tasks.core import layout
from tasks.runtime.stage import Contract, Declared, UndeclaredParam


def test_the_view_answers_declared_keys_only() -> None:
    p = load_params(TINY)
    view = Declared(p, Contract("x", params=("seed", "model.max_prompt_tokens", "rollout")))
    assert view.seed == p.seed
    assert view.rollout is p.rollout                   # a declared section: the params' own
    assert view.rollout.generation.max_new_tokens == p.rollout.generation.max_new_tokens
    assert view.model.max_prompt_tokens == p.model.max_prompt_tokens
    with pytest.raises(UndeclaredParam, match=r"^stage x reads params key model\.source, which "
                       r"its contract does not declare: add it to CONTRACT\.params in "
                       r"tasks/stages/x\.py"):
        view.model.source                                # a sibling of a declared key
    with pytest.raises(UndeclaredParam, match="params key judge,"):
        view.judge                                       # a section not declared at all
    with pytest.raises(AttributeError):
        view.no_such_key                                 # not a key: Python's own error


def test_declares_reads_sections_and_keys() -> None:
    c = Contract("x", params=("device", "update", "offpolicy.source"))
    assert c.declares("device") and c.declares("update.dpo.beta") and c.declares("offpolicy.source")
    assert not c.declares("offpolicy") and not c.declares("offpolicy.n_prompts")
    assert not c.declares("seed") and not c.declares("updates")


# --- on a real workspace: what DVC reruns after an edit ---------------------------------------

def dvc(ws: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """DVC in the workspace as a person runs it there; stage commands find this interpreter."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=ws, capture_output=True,
                          text=True, env=env, timeout=900)


def changed(ws: Path) -> set[str]:
    """The stage instances `dvc status` finds out of date."""
    proc = dvc(ws, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout or "{}"))


def add_field(path: Path, line: str) -> None:
    """A developer's edit of a schema module: one more field, with a default, at the end of
    the module's last class."""
    path.write_text(path.read_text().rstrip("\n") + f"\n{line}\n")


def all_stages(ws: Path) -> list[str]:
    """Every stage instance of the workspace's pipeline, as `dvc status` names them."""
    proc = dvc(ws, "stage", "list", "--name-only")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def instances(*stages: str) -> set[str]:
    """The stages' instances in the two-iteration tiny run: `judge@1`, `judge@2`, `prompts`."""
    return {f"{s}@{k}" if s in layout.LOOP_STAGES else s for s in stages for k in ("1", "2")}


def test_editing_one_sections_schema_reruns_only_the_stages_that_read_it(
        tiny_run: dict[str, object], tmp_path: Path) -> None:
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")            # type: ignore[arg-type]
    assert changed(ws) == set()                                      # the run left it current

    add_field(ws / "tasks" / "schemas" / "targets.py", "    min_note: float = 0.0")
    assert changed(ws) == {"report"}            # targets: the report's header shows them
    dvc(ws, "commit", "--force", "--quiet")

    add_field(ws / "tasks" / "schemas" / "judge.py", "    note: str = \"\"")
    assert changed(ws) == instances("collect_offpolicy", "judge", "evaluate") | {"report"}
    dvc(ws, "commit", "--force", "--quiet")            # (that edit set aside: back to current)
    assert changed(ws) == set()

    add_field(ws / "tasks" / "schemas" / "gate.py", "    note: str = \"\"")
    assert changed(ws) == instances("gate")
    proc = dvc(ws, "repro")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = set(re.findall(r"Running stage '([^']+)'", proc.stdout))
    assert ran == instances("gate")             # nothing before it reran; nothing follows it
    assert changed(ws) == set()

    loader = ws / "tasks" / "config" / "params.py"
    loader.write_text(loader.read_text() + "\n")
    assert changed(ws) == set(all_stages(ws))  # the loader itself: every stage's dep


def test_a_stage_that_reads_an_undeclared_key_stops_at_the_read(
        tiny_run: dict[str, object], tmp_path: Path) -> None:
    """A developer drops `gate` from the gate stage's contract and reruns it by hand: the stage
    stops where it reads the key, naming it, before it decides anything."""
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")            # type: ignore[arg-type]
    module = ws / "tasks" / "stages" / "gate.py"
    text = module.read_text()
    edited = text.replace(', "gate")', ')', 1)         # the last of its params: the section
    assert edited != text and 'params=("seed"' in edited
    module.write_text(edited)
    proc = dvc(ws, "repro", "gate@1")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "UndeclaredParam: stage gate reads params key gate, which its contract does not " \
        "declare" in out
    assert "gate@1: passed" not in out and "gate@1: failed" not in out


def test_a_judge_key_that_only_pairs_verdicts_does_not_rerun_evaluate(
        tiny_run: dict[str, object], tmp_path: Path) -> None:
    """evaluate reads the judge's verdicts (the keys that build it: judges.BUILD_KEYS), not how
    the judge stage turns them into pairs: a person raising judge.pairs_per_prompt reruns the
    stages that pair (collect_offpolicy, judge@k), and evaluate@k only if their outputs move."""
    from conftest import set_params
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")            # type: ignore[arg-type]
    set_params(ws / "params.yaml", judge__pairs_per_prompt=2)
    assert changed(ws) == instances("collect_offpolicy", "judge")
    set_params(ws / "params.yaml", judge__pairs_per_prompt=1, judge__tie_margin=0.1)
    assert changed(ws) == instances("collect_offpolicy", "judge", "evaluate")   # a verdict key
