"""`update.processes` / `train_rm.processes` = 2: the stage re-launches itself under torchrun
(gloo on CPU) and each rank trains on its shard of every global batch. On the tiny model the
per-step losses and the final weights match the one-process run within float32 reduction-order
noise, and the workspace gains exactly the files the one-process run writes."""
from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from functools import reduce
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import run_cli, run_stage, tiny_stage_workspace
from tasks.config.params import ParamsError, parse_params
from tasks.core import layout
from tasks.runtime import distributed, stage
from tasks.stages import judge, rollout, train_rm, update
from test_dpo_family import SETUP

REPO = Path(__file__).resolve().parents[1]
LOSS_TOL = 1e-5      # per-step loss, absolute: float32 sums in another order, then 4-16 steps
WEIGHT_TOL = 1e-5    # every weight, absolute (lr 1e-3: a step moves a weight by ~1e-3)
PPO_WEIGHT_TOL = 5e-5  # PPO: 24 AdamW steps (twice DPO's) at lr 1e-3, i.e. 5% of one step


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Set-up and iteration 1 up to its reward model (tiny profile): update@1's inputs."""
    root = tiny_stage_workspace(tmp_path_factory.mktemp("ddp") / "ws")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(stage.THREADS_ENV, "2")
        for main in SETUP:
            run_stage(main, root)
        for main in (rollout.main, judge.main):
            run_stage(main, root, 1)
    yield root


# 16 pairs (8 on-policy, 8 off-policy at weight 0.5), batches of 3: 12 steps, the last batch of
# each epoch a single pair (rank 1's shard empty), the SFT term on
DPO_EDITS = {"update.dpo.batch_size": 3, "update.dpo.offpolicy_mix": 0.5,
             "update.dpo.offpolicy_weight": 0.5, "update.dpo.sft_weight": 0.1}
RM_EDITS = {"train_rm.batch_size": 3, "train_rm.head_init": "random"}
# PPO on the 48 rollouts (12 prompts x 4) and iteration 1's RM: minibatches of one prompt group
# (4 rollouts, split 2 + 2 over the ranks), 2 epochs: 24 steps, the KL term in the loss (k3)
PPO_EDITS = {"update.algo": "ppo", "update.ppo.minibatch_size": 3, "update.ppo.epochs": 2,
             "update.ppo.kl_mode": "loss", "update.ppo.kl_estimator": "k3"}


@pytest.fixture(scope="module")
def base_rm(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base plus train_rm@1 (PPO's reward)."""
    root = tmp_path_factory.mktemp("ddp_rm") / "ws"
    shutil.copytree(base, root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(stage.THREADS_ENV, "2")
        run_stage(train_rm.main, root, 1)
    return root


def set_keys(path: Path, edits: dict[str, object]) -> None:
    """Set dotted keys, present or not (`processes` is not in the tiny profile), in a copy."""
    data = yaml.safe_load(path.read_text())
    for dotted, value in edits.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[last] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def files(root: Path) -> set[str]:
    return {str(f.relative_to(root)) for f in root.rglob("*") if f.is_file()}


def run_with(base: Path, tmp: Path, main: object, edits: dict[str, object], section: str, n: int,
             mp: pytest.MonkeyPatch) -> tuple[Path, set[str], list[float]]:
    """Run a stage@1 on a fresh copy of base with `section.processes = n`: the workspace, the
    files it gained and the per-step losses rank 0 recorded."""
    root = tmp / f"ws{n}"
    shutil.copytree(base, root)
    set_keys(root / layout.PARAMS_FILE, {**edits, f"{section}.processes": n})
    losses = tmp / f"losses{n}.json"
    mp.setenv(stage.THREADS_ENV, "2")
    mp.setenv(distributed.LOSSES_ENV, str(losses))
    before = files(root)
    run_stage(main, root, 1)
    return root, files(root) - before, json.loads(losses.read_text())["losses"]


def assert_same_run(one: tuple[Path, set[str], list[float]],
                    two: tuple[Path, set[str], list[float]], model_dir: str,
                    weight_tol: float = WEIGHT_TOL) -> None:
    (root1, new1, losses1), (root2, new2, losses2) = one, two
    assert new1 == new2                                    # the same files, nothing from rank 1
    assert len(losses1) == len(losses2) >= 8
    assert losses2 == pytest.approx(losses1, abs=LOSS_TOL, rel=0)
    w1 = load_file(str(root1 / model_dir / "model.safetensors"))
    w2 = load_file(str(root2 / model_dir / "model.safetensors"))
    assert w1.keys() == w2.keys()
    diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    assert diff <= weight_tol, diff
    gap = max(abs(a - b) for a, b in zip(losses1, losses2))
    print(f"{model_dir}: {len(losses1)} steps, max |loss diff| {gap:.2e}, max |weight diff| "
          f"{diff:.2e}")
    w0 = load_file(str(root1 / layout.policy(0) / "model.safetensors"))
    assert any(not torch.equal(w0[k], w2[k]) for k in w2 if ".layers." in k and k in w0)

def test_dpo_update_on_two_processes_matches_one(base: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    one = run_with(base, tmp_path, update.main, DPO_EDITS, "update", 1, monkeypatch)
    two = run_with(base, tmp_path, update.main, DPO_EDITS, "update", 2, monkeypatch)
    assert sorted(x for x in one[1] if not x.startswith(layout.policy(1))) == \
        [layout.metrics(1, "update")]                      # one policy dir, one metrics file
    assert_same_run(one, two, layout.policy(1))
    m1, m2 = (json.loads((r / layout.metrics(1, "update")).read_text()) for r in (one[0], two[0]))
    assert m1.keys() == m2.keys()
    # reward accuracies count margins > 0. At the first step pi = ref and every margin is
    # rounding noise (the reference scores the pairs in other batches than the policy, and
    # each rank in others again: CPU-dependent bits), so that step's accuracy may differ by
    # up to 1, the mean over the steps by 1 / steps; later margins are far from 0
    signs = {"update/reward_accuracy_mean": 1 / m1["update/steps"]}
    rest = lambda m: {k: v for k, v in m.items() if k not in signs}
    assert rest(m2) == pytest.approx(rest(m1), abs=1e-4)
    for k, tol in signs.items():
        assert abs(m2[k] - m1[k]) <= tol + 1e-4, (k, m1[k], m2[k])


def test_rm_fine_tuning_on_two_processes_matches_one(base: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    one = run_with(base, tmp_path, train_rm.main, RM_EDITS, "train_rm", 1, monkeypatch)
    two = run_with(base, tmp_path, train_rm.main, RM_EDITS, "train_rm", 2, monkeypatch)
    assert_same_run(one, two, layout.reward_model(1))


@pytest.mark.slow       # ~20 s: keeps `make test` from growing; CI runs it
def test_ppo_update_on_two_processes_matches_one(base_rm: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    one = run_with(base_rm, tmp_path, update.main, PPO_EDITS, "update", 1, monkeypatch)
    two = run_with(base_rm, tmp_path, update.main, PPO_EDITS, "update", 2, monkeypatch)
    assert "value_head.safetensors" in {Path(x).name for x in one[1]}
    assert_same_run(one, two, layout.policy(1), PPO_WEIGHT_TOL)
    head1, head2 = (load_file(str(r / layout.policy(1) / "value_head.safetensors"))
                    for r in (one[0], two[0]))
    head_diff = max(float((head1[k] - head2[k]).abs().max()) for k in head1)
    print(f"value head: max |weight diff| {head_diff:.2e}")
    assert head_diff <= PPO_WEIGHT_TOL
    m1, m2 = (json.loads((r / layout.metrics(1, "update")).read_text()) for r in (one[0], two[0]))
    assert m1.keys() == m2.keys() and m1["update/steps"] == m2["update/steps"] == 24
    assert m2 == pytest.approx(m1, abs=1e-4)


@pytest.mark.slow
def test_ppo_on_two_processes_through_the_cli(tmp_path: Path) -> None:
    """The tiny loop with PPO on 2 torchrun processes, run as a person runs it: both updates
    say they ran on 2 processes, and each iteration ends with one commit and one registered
    policy carrying its value head."""
    profile = tmp_path / "tiny-ppo-2.yaml"
    shutil.copy(REPO / "params" / "tiny.yaml", profile)
    set_keys(profile, {"update.algo": "ppo", "update.processes": 2})
    ws = tmp_path / "ws"
    out = run_cli("run", "--params", str(profile), "--workspace", str(ws), timeout=1200).stdout
    for it in (1, 2):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"update@{it}: ppo, "))
        assert line.endswith(" steps on 2 processes"), line
        assert (ws / layout.policy(it) / "value_head.safetensors").is_file()
    log = subprocess.run(["git", "log", "--format=%s"], cwd=ws, capture_output=True,
                         text=True).stdout.splitlines()
    log = [m for m in log if m.startswith("alignloop: iteration")]
    assert log == ["alignloop: iteration 2", "alignloop: iteration 1", "alignloop: iteration 0"]
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    versions = client.search_model_versions("name = 'alignloop-policy'")
    assert sorted(int(v.version) for v in versions) == [1, 2]


def test_processes_must_be_positive() -> None:
    head, update_etc = (REPO / "params" / "tiny.yaml").read_text().split("\nupdate:\n", 1)
    edit = lambda *pairs: head + "\nupdate:\n" + reduce(
        lambda t, p: t.replace(p[0], p[1], 1), pairs, update_etc)
    with pytest.raises(ParamsError, match=r"tiny.yaml:\d+: update.processes: must be >= 1"):
        parse_params(edit(("processes: 1\n", "processes: 0\n")), "tiny.yaml")
    ppo = parse_params(edit(("processes: 1\n", "processes: 2\n"), ("algo: dpo\n", "algo: ppo\n")),
                       "tiny.yaml")
    assert (ppo.update.processes, ppo.update.algo) == (2, "ppo")
