"""Smoke tests of the training stages on the loop's workspace (tests/stage_loop.py): train_rm
and update change the weights they should, reruns in a copy with other settings (the probe's
depth, frozen embeddings, spaced stats pairs, a KL budget, PPO) save what those settings say, and
a rerun gives the same bits whatever the global RNG."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from stage_loop import Workspace, changed, copy_workspace, run, set_params
from tasks.config.params import load_params
from tasks.core import layout
from tasks.data.records import parse_pair
from tasks.models import lm
from tasks.reward import features, reward_model
from tasks.runtime import stage
from tasks.stages import train_rm, update
from test_probe import near_zero_share


@pytest.fixture(scope="module")
def ws(stage_loop: Workspace) -> Workspace:
    """One iteration of the whole loop, every stage's main() called in DAG order (the session's
    one run, shared by the per-stage smoke tests)."""
    return stage_loop


# --- train_rm ---------------------------------------------------------------------------------

def test_reward_model_training_changed_head_and_backbone(ws: Workspace) -> None:
    rm = ws.weights(layout.reward_model(1))
    policy0 = ws.weights(layout.policy(0))
    fresh = ws.fresh_rm
    assert "score.weight" in rm and rm.keys() <= fresh.keys()
    # the fresh model is the initial policy's backbone plus a new head ...
    backbone = [k for k in rm if k in policy0]
    assert backbone and all(torch.equal(fresh[k], policy0[k]) for k in backbone)
    # ... and training moved both
    assert not torch.equal(rm["score.weight"], fresh["score.weight"])
    layers = [k for k in backbone if ".layers." in k]
    moved = [k for k in layers if not torch.equal(rm[k], policy0[k])]
    assert layers and len(moved) == len(layers)
    m = ws.metrics(layout.metrics(1, "train_rm"))
    assert m["rm/steps"] > 0 and 0.0 <= m["rm/accuracy"] <= 1.0
    assert m["rm/n_onpolicy"] == len(ws.records(layout.pairs(1)))
    stats = reward_model.load_stats(ws.path(layout.reward_model(1)))
    assert stats["std"] > 0


@pytest.mark.parametrize("epochs, ensemble", [(0, 1), (1, 2)])
def test_train_rm_chooses_the_probes_depth_and_saves_that_model(ws: Workspace, tmp_path: Path,
                                                                 epochs: int, ensemble: int
                                                                 ) -> None:
    """`num_layers_grid` with the probe alone, or with fine-tuning epochs after it (LP-FT, two
    members): the stage keeps the depth the probe's cross-validation chose, the saved reward
    model (loaded as evaluate and PPO load it) has that many blocks in every member, fine-tuned
    ones moved off the initial model, and scoring the held-out pairs through it gives the
    accuracy the stage reported (after fine-tuning: not from features cached before it)."""
    again = copy_workspace(ws, tmp_path / "ws")
    shutil.rmtree(again.path(layout.reward_model(1)))
    import yaml
    path = again.path(layout.PARAMS_FILE)          # the tiny profile leaves these at defaults
    data = yaml.safe_load(path.read_text())
    data["train_rm"].update(epochs=epochs, ensemble=ensemble, head_init="probe", pooling="mean",
                            num_layers_grid=[1, 2], probe_l2_grid=[0.1, 1.0])
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    run(train_rm.main, again.root, 1)
    m = again.metrics(layout.metrics(1, "train_rm"))
    assert m["rm/num_layers"] in (1.0, 2.0) and m["rm/depth_cv_loss"] > 0
    saved = reward_model.load_reward_model(again.path(layout.reward_model(1)))
    assert [features.depth(x) for x in saved.members] == [int(m["rm/num_layers"])] * ensemble
    initial = ws.weights(layout.policy(0))
    for member in saved.members:
        block = {k: v for k, v in member.state_dict().items() if ".layers.0." in k}
        assert block and block.keys() <= initial.keys()
        moved = [k for k, v in block.items() if not torch.equal(v, initial[k])]
        assert bool(moved) == (epochs > 0), moved
    p = load_params(again.path(layout.PARAMS_FILE))
    pool = [parse_pair(r, "pool", 0, "x") for r in again.records(layout.pairs_pool(1))]
    _, held = reward_model.heldout_split(pool, p.train_rm.heldout_fraction)
    tok = lm.load_tokenizer(again.path(layout.policy(0)))
    enc = reward_model.encode_pairs(tok, held, p.model.max_prompt_tokens, p.train_rm.max_length)
    margins = reward_model.pair_margins(saved, enc, tok.pad_token_id)              # (1, N)
    # the stage scored them through its feature cache (other batches): the same signs unless a
    # margin lies within rounding of 0
    assert abs(float((margins.mean(0) > 0).float().mean()) - m["rm/accuracy"]) <= \
        near_zero_share(margins) + 1e-9


def test_train_rm_is_reproducible_whatever_the_global_rng(ws: Workspace, tmp_path: Path) -> None:
    again = copy_workspace(ws, tmp_path / "ws")
    shutil.rmtree(again.path(layout.reward_model(1)))
    torch.manual_seed(12345)                            # unrelated earlier use of the global RNG
    torch.rand(7)
    run(train_rm.main, again.root, 1)
    # bits: the same process, inputs, shapes and thread count (ALIGNLOOP_THREADS) as the first
    # run: torch's CPU kernels are deterministic run to run
    assert not changed(again.weights(layout.reward_model(1)), ws.weights(layout.reward_model(1)))
    assert again.metrics(layout.metrics(1, "train_rm")) == ws.metrics(layout.metrics(1, "train_rm"))


def test_train_rm_stats_from_spaced_pairs_leave_training_and_the_queue_as_they_were(
        ws: Workspace, tmp_path: Path) -> None:
    """The stage rerun in a copy with `stats_pairs: 5`: the same weights, held-out accuracy and
    audit queue; the stats and train accuracy from 5 of the training pairs."""
    again = copy_workspace(ws, tmp_path / "ws")
    params = again.path(layout.PARAMS_FILE)           # a key the profile leaves to its default
    text = params.read_text().replace("\ntrain_rm:\n", "\ntrain_rm:\n  stats_pairs: 5\n", 1)
    assert text != params.read_text()
    params.write_text(text)
    shutil.rmtree(again.path(layout.reward_model(1)))
    run(train_rm.main, again.root, 1)
    assert not changed(again.weights(layout.reward_model(1)), ws.weights(layout.reward_model(1)))
    m, before = (w.metrics(layout.metrics(1, "train_rm")) for w in (again, ws))
    assert before["rm/n_train"] > 5 and m["rm/n_train_scored"] == 5
    assert m["rm/accuracy"] == before["rm/accuracy"]
    assert again.records(layout.audit_queue(1)) == ws.records(layout.audit_queue(1))
    assert (reward_model.load_stats(again.path(layout.reward_model(1)))
            != reward_model.load_stats(ws.path(layout.reward_model(1))))


# --- update -----------------------------------------------------------------------------------

def test_dpo_update_changed_the_policy(ws: Workspace) -> None:
    before, after = ws.weights(layout.policy(0)), ws.weights(layout.policy(1))
    diff = changed(before, after)
    layers = {k for k in before if ".layers." in k}
    assert layers and layers <= diff
    m = ws.metrics(layout.metrics(1, "update"))
    assert m["update/steps"] > 0 and m["update/n_pairs"] == len(ws.records(layout.pairs(1)))
    meta = json.loads((ws.path(layout.policy(1)) / layout.MODEL_META).read_text())
    assert (meta["algo"], meta["parent"], meta["reference"]) == \
        ("dpo", layout.policy(0), layout.policy(0))


def test_a_kl_budget_from_the_initial_model_measures_no_start_and_trains_the_same(
        ws: Workspace, tmp_path: Path) -> None:
    """update@1 (prev 0) rerun in a copy with a KL budget too large to stop it, checked after
    every step: its start is the initial model's 0, taken without a measurement
    (`update/kl_checks` counts one per step, none before it), and the weights are the run's
    without a budget (the measurements sample with their own generator and change nothing they
    measure). The tiny update's two steps move the policy too little for the sign of a k1
    estimate on a few samples to mean anything: its value is not asserted."""
    again = copy_workspace(ws, tmp_path / "ws")
    params = again.path(layout.PARAMS_FILE)
    text = params.read_text().replace(
        "\nupdate:\n", "\nupdate:\n  kl_budget:\n    total: 1000.0\n    check_every: 1\n", 1)
    assert text != params.read_text()
    params.write_text(text)
    run(update.main, again.root, 1)
    m = again.metrics(layout.metrics(1, "update"))
    assert (m["update/kl_start"], m["update/kl_stopped"]) == (0.0, 0.0)
    assert m["update/kl_checks"] == m["update/steps"] > 0
    assert math.isfinite(m["update/kl_last"])
    assert not changed(again.weights(layout.policy(1)), ws.weights(layout.policy(1)))


def test_train_rm_with_freeze_embeddings_saves_the_initial_models_embeddings(
        ws: Workspace, tmp_path: Path) -> None:
    """train_rm@1 rerun in a copy with `freeze_embeddings: true` (the default profile's
    setting): the reward model it saves holds the initial policy's token embeddings exactly,
    while its blocks moved, and it measured itself on the same held-out pairs."""
    again = copy_workspace(ws, tmp_path / "ws")
    params = again.path(layout.PARAMS_FILE)
    text = params.read_text().replace("\ntrain_rm:\n", "\ntrain_rm:\n  freeze_embeddings: true\n", 1)
    assert text != params.read_text()
    params.write_text(text)
    run(train_rm.main, again.root, 1)
    rm, base = again.weights(layout.reward_model(1)), ws.weights(layout.policy(0))
    key = "model.embed_tokens.weight"
    assert torch.equal(rm[key], base[key])
    blocks = {k for k in rm if ".layers." in k}
    assert blocks and blocks <= {k for k in blocks if not torch.equal(rm[k], base[k])}
    assert not torch.equal(ws.weights(layout.reward_model(1))[key], base[key])  # trained there
    ran, before = again.metrics(layout.metrics(1, "train_rm")), ws.metrics(
        layout.metrics(1, "train_rm"))
    assert ran["rm/n_heldout"] == before["rm/n_heldout"] and 0.0 <= ran["rm/accuracy"] <= 1.0


def test_initial_policy_untouched_by_the_loop(ws: Workspace) -> None:
    assert lm.weights_md5(ws.path(layout.policy(0))) == ws.policy0_md5


def test_ppo_update_changed_the_policy(ws: Workspace, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(stage.THREADS_ENV, "2")
    ppo = copy_workspace(ws, tmp_path / "ws_ppo")
    set_params(ppo, update__algo="ppo")
    run(update.main, ppo.root, 1)
    before, after = ppo.weights(layout.policy(0)), ppo.weights(layout.policy(1))
    layers = {k for k in before if ".layers." in k}
    assert layers and layers <= changed(before, after)
    assert changed(after, ws.weights(layout.policy(1)))       # not the DPO policy left over
    meta = json.loads((ppo.path(layout.policy(1)) / layout.MODEL_META).read_text())
    assert meta["algo"] == "ppo"
    m = ppo.metrics(layout.metrics(1, "update"))
    assert "update/clipfrac_mean" in m and 0.0 <= m["update/clipfrac_mean"] <= 1.0
    assert m["update/steps"] > 0 and m["update/n_rollouts"] == len(ws.records(layout.rollouts(1)))
    assert all(math.isfinite(v) for v in m.values())
    assert lm.weights_md5(ppo.path(layout.policy(0))) == ws.policy0_md5
