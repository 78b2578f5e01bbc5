"""The user's path for `judge.kind: reward_model`: a reward model from an earlier run judges a
new loop, through the CLI."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import TINY, run_cli
from tasks.core import jsonl, layout


@pytest.mark.slow      # a whole extra tiny loop through the CLI
def test_tiny_loop_judged_by_a_reward_model_from_an_earlier_run(tiny_run, tmp_path: Path):
    """The shared tiny run's final reward model labels a fresh workspace's loop: the run commits
    and registers both iterations, every judged pair names the RM and the md5 of its weights,
    and each registered version says which judge labelled its data."""
    from mlflow.tracking import MlflowClient

    from tasks.judging.judge_rm import rm_md5
    rm = Path(tiny_run["ws"]) / layout.reward_model(2)
    data = yaml.safe_load(TINY.read_text())
    data["judge"].update(kind="reward_model", model=str(rm))
    params = tmp_path / "rm-judge.yaml"
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    ws = tmp_path / "ws"
    run_cli("run", "--params", str(params), "--workspace", str(ws))
    md5 = rm_md5(rm)
    for it in (1, 2):
        pool = [r for _, r in jsonl.read(ws / layout.pairs_pool(it)) if r["source"] == f"iter_{it}"]
        assert pool and {r["meta"]["judge"] for r in pool} == {f"reward_model:rm@{md5}"}
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    versions = client.search_model_versions("name = 'alignloop-policy'")
    assert sorted(v.tags["iteration"] for v in versions) == ["1", "2"]
    assert {(v.tags["judge"], v.tags["judge_model_md5"]) for v in versions} == \
        {(f"reward_model:{rm}", md5)}
