"""The KL budget on the user's path: a workspace's params.yaml given a budget its first update
overshoots, `alignloop run` again, and the iteration committed with a state part of the way
back (tasks/policy/kl_budget.py's backtracking), not the update's last weights.

The target is set from the workspace's own measurement (a first run with a budget that never
binds records the guard's estimate after the last step), so the test holds whatever the
kernels of the CPU make of the tiny model's KL: half of it is overshot by the last step, and
the states 1/2, 1/4, 1/8 of the way back lie nearer the reference.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from conftest import copy_workspace, run_cli
from tasks.models import lm


def _budget(ws: Path, **budget: float) -> None:
    path = ws / "params.yaml"
    data = yaml.safe_load(path.read_text())
    data["update"]["kl_budget"] = budget
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _update(ws: Path, it: int) -> dict[str, float]:
    return json.loads((ws / "metrics" / f"iter_{it}" / "update.json").read_text())


def test_an_update_past_its_budget_commits_a_state_part_of_the_way_back(tiny_run, tmp_path):
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    free = lm.weights_md5(ws / "models" / "iter_1" / "policy")
    _budget(ws, total=1.0e6, check_every=100, backtrack=0)     # measured once, never binding
    run_cli("run", "--workspace", str(ws))
    measured = _update(ws, 1)
    steps = measured["update/steps"]
    assert measured["update/kl_stopped"] == 0.0 and measured["update/kl_checks"] == 1.0
    # measuring draws from its own generator and changes no weight: the same update on the same
    # machine (kernels, threads, shapes) trains the same bits
    assert lm.weights_md5(ws / "models" / "iter_1" / "policy") == free
    overshoot = measured["update/kl_last"]
    assert overshoot > 0.0

    _budget(ws, total=overshoot / 2, check_every=100, backtrack=3)
    out = run_cli("run", "--workspace", str(ws)).stdout
    m = _update(ws, 1)
    assert m["update/kl_target"] == overshoot / 2
    assert m["update/kl_stopped"] == 1.0
    assert m["update/kl_backtracks"] >= 1.0
    assert 0.0 < m["update/steps_kept"] < steps             # a state between start and end
    assert m["update/kl_last"] == m["update/kl_kept"] <= m["update/kl_target"]  # the last
    #                                           measured is the kept state, within the target
    kept = lm.weights_md5(ws / "models" / "iter_1" / "policy")
    assert kept not in (free, lm.weights_md5(ws / "models" / "iter_0" / "policy"))
    assert "iteration 1: policy v" in out                  # committed and registered
    assert json.loads((ws / "metrics" / "iter_1" / "evaluate.json").read_text())["eval/n"] > 0
