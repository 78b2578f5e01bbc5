"""Recurring ticks build on the best: a candidate no better than the champion head-to-head is
not promoted, and the next tick starts from the champion, not from the refused iteration."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import copy_workspace, run_cli
from flows.dag import read_lock
from flows.registry_record import RECORD
from flows.tracking import entry_io
from tasks.config.params import load_params
from tasks.core import layout


def _versions(ws: Path) -> dict[str, dict]:
    record = json.loads((ws / RECORD).read_text())["models"]["alignloop-policy"]
    return {v["tags"]["iteration"]: v for v in record}


@pytest.mark.slow          # two tiny ticks through the CLI: ~2 minutes
def test_a_refused_iteration_is_a_branch_the_next_tick_does_not_build_on(tiny_run, tmp_path):
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    assert _versions(ws)["2"]["aliases"] == ["champion"]
    params = ws / layout.PARAMS_FILE          # promotion now needs gold to prefer it to the
    text = params.read_text()                 # champion (tiny's gold: all ties, CI [0.5, 0.5])
    assert "min_champion_gold_ci_low: -1.0" in text
    params.write_text(text.replace("min_champion_gold_ci_low: -1.0",
                                   "min_champion_gold_ci_low: 0.5"))

    third = run_cli("tick", "--workspace", str(ws)).stdout
    assert "rollout@3: 48 samples from models/iter_2/policy" in third
    assert ("gate: iteration 3 (v3) not promoted: eval/champion_gold_win_rate_ci_low = 0.5 "
            "fails > min_champion_gold_ci_low (0.5)") in third
    decision = json.loads((ws / layout.gate(3)).read_text())
    assert decision["passed"] is False
    evaluated = json.loads((ws / layout.metrics(3, "evaluate")).read_text())
    assert evaluated["eval/champion_iteration"] == 2.0     # met the champion it started from
    assert _versions(ws)["2"]["aliases"] == ["champion"]    # still the champion

    fourth = run_cli("tick", "--workspace", str(ws)).stdout
    assert load_params(params).iterations["4"].prev == 2    # not 3: the refused branch
    assert '"4": {prev: 2}   # the champion\'s' in params.read_text()
    assert "rollout@4: 48 samples from models/iter_2/policy" in fourth
    lock = read_lock(ws)
    update_deps = entry_io(lock["update@4"], "deps")
    assert layout.policy(2) in update_deps and layout.policy(3) not in update_deps
    assert layout.pairs_pool(2) in entry_io(lock["judge@4"], "deps")
    assert layout.select_samples(2) in entry_io(lock["evaluate@4"], "deps")
    v = _versions(ws)
    assert v["4"]["tags"]["parent_policy_version"] == v["2"]["version"]
    lineage = json.loads(run_cli("lineage", f"models:/alignloop-policy/{v['4']['version']}",
                                 "--workspace", str(ws), "--json").stdout)
    assert lineage["parent_policy"]["version"] == v["2"]["version"]
    meta = json.loads((ws / layout.policy(4) / layout.MODEL_META).read_text())
    assert meta["parent"] == layout.policy(2)
    assert yaml.safe_load(params.read_text())["iterations"]["3"] == {"prev": 2}
