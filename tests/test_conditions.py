"""Conditional inputs (tasks/config/conditions.py): a dep read under some params only is declared in
a workspace's dvc.yaml only where those params hold, so DVC neither reruns the stage for an input it
never reads nor records it in the lineage; on the user's path with real DVC."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, TINY, copy_workspace, ran_stages, run_cli, set_params
from tasks.config import conditions
from tasks.config.params import load_params
from tasks.core import layout

TEMPLATE = (ROOT / "dvc.yaml").read_text()


def _update_deps(text: str) -> list[str]:
    return yaml.safe_load(text)["stages"]["update"]["do"]["deps"]


def _with_update(**edits: object):
    p = load_params(TINY)
    dpo = replace(p.update.dpo, **{k: v for k, v in edits.items() if k != "algo"})
    return replace(p, update=replace(p.update, algo=edits.get("algo", p.update.algo), dpo=dpo))


def test_dpo_on_judge_pairs_declares_the_pairs_not_the_reward_model() -> None:
    p = load_params(TINY)
    assert (p.update.algo, p.update.dpo.pair_source, p.update.dpo.offpolicy_mix) == \
        ("dpo", "judge", 0.0)
    deps = _update_deps(conditions.render(TEMPLATE, p))
    assert "data/iter_${key}/pairs.jsonl" in deps and "models/iter_0/policy" in deps
    for unread in ("models/iter_${key}/rm", "data/iter_${key}/rollouts.jsonl",
                   "data/iter_${item.prev}/pairs_pool.jsonl"):
        assert unread not in deps, unread


def test_ppo_and_rm_picked_pairs_declare_the_reward_model_and_rollouts() -> None:
    for p in (_with_update(algo="ppo"), _with_update(pair_source="rm"),
              _with_update(offpolicy_mix=0.5)):
        deps = _update_deps(conditions.render(TEMPLATE, p))
        reads_rm = p.update.algo == "ppo" or p.update.dpo.pair_source == "rm"
        assert ("models/iter_${key}/rm" in deps) == reads_rm
        assert ("data/iter_${key}/rollouts.jsonl" in deps) == reads_rm
        assert ("data/iter_${key}/pairs.jsonl" in deps) == (not reads_rm)
        assert ("data/iter_${item.prev}/pairs_pool.jsonl" in deps) == \
            (p.update.algo == "dpo" and p.update.dpo.offpolicy_mix > 0)


def test_rendering_is_a_function_of_the_params_alone() -> None:
    dpo, ppo = load_params(TINY), _with_update(algo="ppo")
    once = conditions.render(TEMPLATE, dpo)
    assert conditions.render(once, ppo) == conditions.render(TEMPLATE, ppo)   # rendered again
    assert conditions.render(conditions.render(TEMPLATE, ppo), dpo) == once
    assert conditions.render(TEMPLATE, ppo) != once
    assert once.count("\n") == TEMPLATE.count("\n")          # lines kept: commented, not cut
    marked = conditions.declared(TEMPLATE)
    assert set(marked) == set(conditions.CONDITIONS) and all(marked.values())
    assert conditions.declared(once) == {
        "update_reads_judge_pairs": True, "update_reads_reward_model": False,
        "update_reads_pair_pool": False, "update_reads_initial_policy": True,
        "policy_is_adapter": False}


# --- the user's path: real DVC and the CLI in a copy of the shared tiny run ---------------

def _dvc(ws: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=ws, capture_output=True,
                          text=True, env=env, timeout=900)


def _lock_deps(ws: Path, stage: str) -> set[str]:
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    return {d["path"] for d in lock[stage]["deps"]}


def test_a_dpo_policy_neither_depends_on_nor_names_the_reward_model(tiny_run) -> None:
    """In the tiny run (DPO on the judge's pairs): dvc.lock, the registry's input tags and the
    DAG agree that update@k never read the RM; retraining it reruns evaluation, not the update."""
    from mlflow.tracking import MlflowClient

    from flows import dag
    ws = tiny_run["ws"]
    for it in (1, 2):
        deps = _lock_deps(ws, f"update@{it}")
        assert layout.pairs(it) in deps and layout.reward_model(it) not in deps
        assert layout.rollouts(it) not in deps
        assert layout.reward_model(it) in _lock_deps(ws, f"evaluate@{it}")
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    versions = client.search_model_versions("name = 'alignloop-policy'")
    tags = [v.tags for v in versions if v.tags.get("dvc_stage") == "update@2"]
    assert tags and all(f"input:{layout.reward_model(2)}" not in t for t in tags)
    assert f"input:{layout.pairs(2)}" in tags[0]
    after = dag.downstream(ws, "train_rm@1")
    assert "evaluate@1" in after and not any(s.startswith("update@") for s in after)


def test_switching_to_ppo_by_hand_is_refused_until_the_run_declares_it(tiny_run, tmp_path):
    """A person sets update.algo: ppo in the workspace's params.yaml. `dvc repro update@1` by
    hand stops in one line before it reads anything (dvc.yaml still declares DPO's inputs)."""
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    set_params(ws / "params.yaml", update__algo="ppo")
    proc = _dvc(ws, "repro", "--single-item", "update@1")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "update reads inputs declared there for other params (update_reads_reward_model" \
        in out and "`alignloop run` declares them anew" in out
    assert "Traceback" not in out


@pytest.mark.slow      # reruns the loop from update@1 through the CLI
def test_a_run_after_switching_to_ppo_declares_and_reads_the_reward_model(tiny_run, tmp_path):
    """`alignloop run` after the switch renders dvc.yaml for PPO and the update records the RM
    it read."""
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    set_params(ws / "params.yaml", update__algo="ppo")
    run = run_cli("run", "--workspace", str(ws))
    ran = ran_stages(run.stdout)
    assert {"update@1", "update@2"} <= set(ran)
    for it in (1, 2):
        deps = _lock_deps(ws, f"update@{it}")
        assert {layout.reward_model(it), layout.rollouts(it)} <= deps
        assert layout.pairs(it) not in deps
    metrics = json.loads((ws / layout.metrics(1, "update")).read_text())
    assert "update/value_loss_last" in metrics                      # it ran PPO
    assert conditions.declared((ws / "dvc.yaml").read_text())["update_reads_reward_model"]
