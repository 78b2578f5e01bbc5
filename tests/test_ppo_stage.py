"""The update stage with algo ppo end to end over three iterations of the tiny profile: the
policy and value head change, iteration k reuses the value head and rollouts of earlier
versions, the update reads only what dvc.yaml declares, and bad reuse params or a
temperature change are refused."""
from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import run_stage, set_params, tiny_stage_workspace
from tasks.core import jsonl, layout
from tasks.policy import value_head
from tasks.policy.ppo import REPLAY_FILE
from tasks.runtime import stage
from tasks.stages import (
    collect_offpolicy,
    judge,
    prepare_model,
    prompts,
    reference_samples,
    rollout,
    train_rm,
    update,
)

REPO = Path(__file__).resolve().parents[1]


def _weights(root: Path, rel: str) -> dict[str, torch.Tensor]:
    return load_file(str(root / rel / "model.safetensors"))


@pytest.fixture(scope="module")
def ppo_ws(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Tiny profile with algo ppo and rollout reuse two versions back: set-up, then three full
    iterations of rollout, judge, train_rm, update."""
    root = tiny_stage_workspace(tmp_path_factory.mktemp("ppo") / "ws")
    data = yaml.safe_load((root / layout.PARAMS_FILE).read_text())
    data["iterations"]["3"] = {"prev": 2}
    (root / layout.PARAMS_FILE).write_text(yaml.safe_dump(data, sort_keys=False))
    set_params(root / layout.PARAMS_FILE, update__algo="ppo",
               update__ppo__reuse__iterations_back=2, update__ppo__reuse__max_staleness=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(stage.THREADS_ENV, "2")
        for main in (prompts.main, prepare_model.main, collect_offpolicy.main,
                     reference_samples.main):
            run_stage(main, root)
        for it in (1, 2, 3):
            for main in (rollout.main, judge.main, train_rm.main, update.main):
                run_stage(main, root, it)
    yield root


def _metrics(root: Path, it: int) -> dict[str, float]:
    return json.loads((root / layout.metrics(it, "update")).read_text())


def test_ppo_stage_changes_policy_and_value_head(ppo_ws: Path) -> None:
    before, after = _weights(ppo_ws, layout.policy(0)), _weights(ppo_ws, layout.policy(1))
    layers = {k for k in before if ".layers." in k}
    assert layers and layers <= {k for k in before if not torch.equal(before[k], after[k])}
    head1 = load_file(str(ppo_ws / layout.policy(1) / value_head.VALUE_HEAD_FILE))
    assert float(head1["linear.weight"].abs().sum()) > 0            # moved from its zero init
    assert not (ppo_ws / layout.policy(0) / value_head.VALUE_HEAD_FILE).exists()
    m = _metrics(ppo_ws, 1)
    for key in ("update/steps", "update/epochs_run", "update/early_stopped",
                "update/value_loss_step0", "update/value_loss_last", "update/kl_k1_per_token",
                "update/kl_k3_per_token", "update/clipfrac_mean", "update/approx_kl_last"):
        assert key in m and math.isfinite(m[key]), key
    assert m["update/steps"] > 0 and m["update/value_head_reused"] == 0.0
    assert m["update/n_reused"] == 0.0                              # nothing before iteration 1
    assert (ppo_ws / layout.policy(1) / REPLAY_FILE).is_file()


def test_iteration_2_reuses_head_and_rollouts_of_iteration_1(ppo_ws: Path) -> None:
    m = _metrics(ppo_ws, 2)
    assert m["update/value_head_reused"] == 1.0
    n1 = sum(1 for _ in jsonl.read(ppo_ws / layout.rollouts(1)))
    assert m["update/n_reused"] == n1 and m["update/reuse_staleness_mean"] == 1.0
    assert 0 < m["update/reuse_ess_frac"] <= 1.0
    assert 0.0 <= m["update/reuse_truncated_frac"] <= 1.0
    head1 = load_file(str(ppo_ws / layout.policy(1) / value_head.VALUE_HEAD_FILE))
    head2 = load_file(str(ppo_ws / layout.policy(2) / value_head.VALUE_HEAD_FILE))
    assert not torch.equal(head1["linear.weight"], head2["linear.weight"])


def _nonempty_rollouts(path: Path) -> list[dict[str, Any]]:
    return [rec for _, rec in jsonl.read(path) if rec["response_ids"]]


def test_iteration_3_reuses_rollouts_of_two_versions_back(ppo_ws: Path) -> None:
    """update@3 (iterations_back 2) reuses iteration 2's rollouts (1 back) and iteration 1's
    (2 back), each weighed against its own sampler's log-probs, with ESS per origin; what it
    keeps for update@4 leaves iteration 1's out (it would be 3 back there)."""
    n1 = len(_nonempty_rollouts(ppo_ws / layout.rollouts(1)))
    n2 = len(_nonempty_rollouts(ppo_ws / layout.rollouts(2)))
    n3 = len(_nonempty_rollouts(ppo_ws / layout.rollouts(3)))
    m = _metrics(ppo_ws, 3)
    assert m["update/n_reused"] == n1 + n2 and m["update/reuse_dropped_stale"] == 0
    assert m["update/reuse/iter_1/n"] == n1 and m["update/reuse/iter_2/n"] == n2
    assert m["update/reuse_staleness_mean"] == pytest.approx((2 * n1 + n2) / (n1 + n2))
    for origin in (1, 2):
        assert 0 < m[f"update/reuse/iter_{origin}/ess_frac"] <= 1.0
    iterations = [rec["iteration"] for _, rec in jsonl.read(ppo_ws / layout.policy(3) / REPLAY_FILE)]
    assert iterations == [3] * n3 + [2] * n2
    # update@2 kept iteration 2's and 1's: both within 2 back at update@3
    kept2 = [rec["iteration"] for _, rec in jsonl.read(ppo_ws / layout.policy(2) / REPLAY_FILE)]
    assert kept2 == [2] * n2 + [1] * n1


def test_update_reads_only_the_inputs_its_dvc_yaml_declares(ppo_ws: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """update@3 in a workspace holding only params.yaml, the dvc.yaml rendered for its params
    and the data deps that file declares for update@3: the rollouts of iterations 1 and 2
    are not among them (they come through models/iter_2/policy, update@2's out), and the
    stage reuses them all the same."""
    from tasks.config import conditions
    from tasks.config.params import load_params
    monkeypatch.setenv(stage.THREADS_ENV, "2")
    text = conditions.render((REPO / "dvc.yaml").read_text(),
                             load_params(ppo_ws / layout.PARAMS_FILE))
    deps = yaml.safe_load(text)["stages"]["update"]["do"]["deps"]
    data = [d.replace("${key}", "3").replace("${item.prev}", "2") for d in deps
            if not d.startswith("tasks/")]
    assert sorted(data) == sorted([layout.rollouts(3), layout.reward_model(3),
                                   layout.policy(0), layout.policy(2)])
    root = tmp_path / "ws"
    root.mkdir()
    shutil.copy(ppo_ws / layout.PARAMS_FILE, root / layout.PARAMS_FILE)
    (root / "dvc.yaml").write_text(text)
    for rel in data:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if (ppo_ws / rel).is_dir():
            shutil.copytree(ppo_ws / rel, root / rel)
        else:
            shutil.copy(ppo_ws / rel, root / rel)
    run_stage(update.main, root, 3)
    assert not (root / layout.rollouts(1)).exists() and not (root / layout.rollouts(2)).exists()
    m, full = _metrics(root, 3), _metrics(ppo_ws, 3)
    for key in ("update/n_reused", "update/reuse/iter_1/n", "update/reuse/iter_2/n"):
        assert m[key] == full[key] > 0, key


def test_value_reuse_loads_the_previous_head(ppo_ws: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """update@2 with value_reuse starts from iteration 1's head exactly; without, from zero."""
    monkeypatch.setenv(stage.THREADS_ENV, "2")
    seen: list[dict[str, torch.Tensor]] = []
    load = value_head.load_or_init

    def spy(*args: Any, **kwargs: Any) -> tuple[value_head.ValueHead, bool]:
        head, loaded = load(*args, **kwargs)
        seen.append({k: v.clone() for k, v in head.state_dict().items()})
        return head, loaded

    monkeypatch.setattr(value_head, "load_or_init", spy)
    root = tmp_path / "ws"
    shutil.copytree(ppo_ws, root)
    set_params(root / layout.PARAMS_FILE, update__ppo__reuse__iterations_back=0)
    run_stage(update.main, root, 2)
    with_reuse = _metrics(root, 2)
    set_params(root / layout.PARAMS_FILE, update__ppo__value_reuse=False)
    run_stage(update.main, root, 2)
    without = _metrics(root, 2)
    head1 = load_file(str(root / layout.policy(1) / value_head.VALUE_HEAD_FILE))
    assert torch.equal(seen[0]["linear.weight"], head1["linear.weight"])
    assert float(seen[1]["linear.weight"].abs().sum()) == 0.0
    assert (with_reuse["update/value_head_reused"], without["update/value_head_reused"]) == (1, 0)
    assert with_reuse["update/value_loss_step0"] != without["update/value_loss_step0"]
    print(f"\nvalue_loss_step0 tiny@2: reuse {with_reuse['update/value_loss_step0']:.4f}, "
          f"fresh {without['update/value_loss_step0']:.4f}")


def test_reuse_across_a_temperature_change_is_refused_at_the_update(
        ppo_ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A person lowers rollout.generation.temperature for iteration 2 with reuse on: update@2
    would score iteration 1's rollouts (drawn at 1.0) at 0.7. It stops with one line naming
    both temperatures; before, it read the first rollout's temperature and used it for all."""
    from tasks.core.errors import InputError
    monkeypatch.setenv(stage.THREADS_ENV, "2")
    root = tmp_path / "ws"
    shutil.copytree(ppo_ws, root)
    set_params(root / layout.PARAMS_FILE, rollout__generation__temperature=0.7)
    run_stage(rollout.main, root, 2)
    with pytest.raises(InputError, match=r"sampled at different temperatures \[0\.7, 1\.0\]"):
        run_stage(update.main, root, 2)


# --- params -----------------------------------------------------------------------------------

@pytest.mark.parametrize("line, message", [
    ("truncate: [2.0, 1.0]", "update.ppo.reuse.truncate: must be [lo, hi]"),
    ("truncate: [0.5]", "update.ppo.reuse.truncate: must be [lo, hi]"),
    ("iterations_back: -1", "update.ppo.reuse.iterations_back: must be >= 0, got -1"),
    ("iterations_back: 3", "update.ppo.reuse.max_staleness: must be >= iterations_back (3), "
                           "got 1"),
    ("level: word", "update.ppo.reuse.level: expected one of ['token', 'sequence']"),
])
def test_bad_reuse_params_name_file_line_and_key(line: str, message: str) -> None:
    from tasks.config.params import ParamsError, parse_params
    text = ('iterations:\n  "1": {prev: 0}\nupdate:\n  ppo:\n    reuse:\n'
            f'      {line}\n')
    with pytest.raises(ParamsError) as e:
        parse_params(text, "p.yaml")
    assert str(e.value).startswith("p.yaml:6: " + message)
