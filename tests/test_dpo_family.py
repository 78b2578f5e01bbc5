"""The DPO family (sigmoid, IPO, cDPO), its pair sources and off-policy mixing, the reference
choice, and the reward-model ensemble with its audit queue: exact loss values, then one tiny
end-to-end run per variant in a temp workspace (CPU, seconds each)."""
from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_stage, set_params, tiny_stage_workspace
from tasks.core import jsonl, layout
from tasks.data import audit
from tasks.data.records import parse_pair, parse_rollout
from tasks.functional.losses import (
    DPO_LOSSES,
    LENGTH_NORMALISED_LOSSES,
    cdpo_loss,
    dpo_sigmoid_loss,
    ipo_loss,
)
from tasks.models import lm
from tasks.policy.dpo import offpolicy_indices, pair_logprobs
from tasks.reward import reward_model
from tasks.runtime import stage
from tasks.stages import (
    collect_offpolicy,
    evaluate,
    judge,
    prepare_model,
    prompts,
    reference_samples,
    rollout,
    train_rm,
    update,
)

REPO = Path(__file__).resolve().parents[1]


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


# --- losses: exact values ---------------------------------------------------------------------

def test_ipo_exact_value() -> None:
    # h = (pi_c - ref_c) - (pi_r - ref_r) = (-1 - -2) - (-3 - -2) = 2
    assert ipo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5).item() == \
        pytest.approx((2.0 - 1.0) ** 2, abs=1e-12)           # target 1/(2 beta) = 1
    assert ipo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.1).item() == \
        pytest.approx((2.0 - 5.0) ** 2, abs=1e-12)           # target 5
    # at zero margin the loss is the squared target, and it is minimal at h = 1/(2 beta)
    assert ipo_loss(t(-4.0), t(-2.0), t(-4.0), t(-2.0), 0.1).item() == pytest.approx(25.0)
    assert ipo_loss(t(3.0), t(0.0), t(0.0), t(0.0), beta=1 / 6).item() == 0.0


def test_cdpo_with_no_smoothing_is_sigmoid_dpo() -> None:
    g = torch.Generator().manual_seed(0)
    pi_c, pi_r, ref_c, ref_r = (torch.randn(16, generator=g, dtype=torch.float64) * 3
                                for _ in range(4))
    assert torch.allclose(cdpo_loss(pi_c, pi_r, ref_c, ref_r, 0.3, 0.0),
                          dpo_sigmoid_loss(pi_c, pi_r, ref_c, ref_r, 0.3), atol=1e-12)


def test_cdpo_hand_value_at_eps_0_1() -> None:
    # beta * h = 0.5 * 2 = 1: 0.9 * log(1 + e^-1) + 0.1 * log(1 + e^1) = log(1 + e^-1) + 0.1
    loss = cdpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.9 * math.log1p(math.exp(-1)) +
                                        0.1 * math.log1p(math.exp(1)), abs=1e-12)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)) + 0.1, abs=1e-12)  # 0.41326
    # at zero margin every eps gives log 2
    assert cdpo_loss(t(0.0), t(0.0), t(0.0), t(0.0), 0.1, 0.3).item() == \
        pytest.approx(math.log(2), abs=1e-12)


def test_loss_table_selects_by_name() -> None:
    args = (t(-1.0), t(-3.0), t(-2.0), t(-2.0), 0.5)
    assert set(DPO_LOSSES) == {"sigmoid", "ipo", "cdpo"}
    assert DPO_LOSSES["sigmoid"](*args, 0.0).item() == pytest.approx(math.log1p(math.exp(-1)))
    assert DPO_LOSSES["ipo"](*args, 0.0).item() == pytest.approx(1.0)
    assert DPO_LOSSES["cdpo"](*args, 0.1).item() == pytest.approx(math.log1p(math.exp(-1)) + 0.1)
    assert LENGTH_NORMALISED_LOSSES == {"ipo"}


@pytest.mark.parametrize("n_on, pool, mix, n_off", [
    (10, 100, 0.0, 0), (10, 100, 0.5, 10), (10, 100, 0.2, 2), (10, 4, 0.5, 4), (0, 10, 0.5, 0)])
def test_offpolicy_share_of_training_pairs(n_on: int, pool: int, mix: float, n_off: int) -> None:
    idx = offpolicy_indices(n_on, pool, mix, torch.Generator().manual_seed(0))
    assert len(idx) == len(set(idx)) == n_off and all(0 <= i < pool for i in idx)
    assert idx == offpolicy_indices(n_on, pool, mix, torch.Generator().manual_seed(0))


# --- a tiny workspace -------------------------------------------------------------------------

SETUP = [prompts.main, prepare_model.main, collect_offpolicy.main, reference_samples.main]


def weights(root: Path, rel: str) -> dict[str, torch.Tensor]:
    return load_file(str(root / rel / "model.safetensors"))


def layers_changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    layers = [k for k in a if ".layers." in k]
    return bool(layers) and all(not torch.equal(a[k], b[k]) for k in layers)


def metrics(root: Path, it: int, name: str) -> dict[str, float]:
    return json.loads((root / layout.metrics(it, name)).read_text())


def records(root: Path, rel: str) -> list[dict[str, Any]]:
    return [rec for _, rec in jsonl.read(root / rel)]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Set-up, iteration 1 in full, and iteration 2 up to its reward model (tiny profile)."""
    root = tiny_stage_workspace(tmp_path_factory.mktemp("dpo_family") / "ws")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(stage.THREADS_ENV, "2")
        for main in SETUP:
            run_stage(main, root)
        for main in (rollout.main, judge.main, train_rm.main, update.main):
            run_stage(main, root, 1)
        for main in (rollout.main, judge.main, train_rm.main):
            run_stage(main, root, 2)
    yield root


@pytest.fixture()
def ws(base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(stage.THREADS_ENV, "2")
    root = tmp_path / "ws"
    shutil.copytree(base, root)
    return root


def model_meta(root: Path, rel: str) -> dict[str, Any]:
    return json.loads((root / rel / layout.MODEL_META).read_text())


# --- DPO variants end to end ------------------------------------------------------------------

def test_ipo_update(ws: Path) -> None:
    set_params(ws / layout.PARAMS_FILE, update__dpo__loss="ipo")
    run_stage(update.main, ws, 1)
    assert layers_changed(weights(ws, layout.policy(0)), weights(ws, layout.policy(1)))
    m = metrics(ws, 1, "update")
    # iteration 1 starts at the reference: h = 0 on the first batch, loss = (1/(2 beta))^2
    assert m["update/loss_first"] == pytest.approx((1 / (2 * 0.1)) ** 2, rel=1e-4)
    assert m["update/loss_last"] < m["update/loss_first"]
    for key in ("update/reward_accuracy_last", "update/reward_margin_mean", "update/n_pairs"):
        assert key in m and math.isfinite(m[key])


def test_cdpo_update(ws: Path) -> None:
    set_params(ws / layout.PARAMS_FILE, update__dpo__loss="cdpo", update__dpo__label_smoothing=0.1)
    run_stage(update.main, ws, 1)
    assert layers_changed(weights(ws, layout.policy(0)), weights(ws, layout.policy(1)))
    m = metrics(ws, 1, "update")
    assert m["update/loss_first"] == pytest.approx(math.log(2), abs=1e-4)
    assert 0.0 <= m["update/reward_accuracy_last"] <= 1.0


def test_sft_anchor_adds_the_chosen_responses_per_token_nll(ws: Path) -> None:
    """update.dpo.sft_weight w: the loss is DPO's plus w times the per-token NLL of the chosen
    response. Iteration 1 starts at the reference (DPO's first loss is log 2), and one batch
    holds every pair, so the first loss is known exactly from the initial policy."""
    from tasks.config.params import load_params
    set_params(ws / layout.PARAMS_FILE, update__dpo__sft_weight=0.5, update__dpo__batch_size=64)
    run_stage(update.main, ws, 1)
    m = metrics(ws, 1, "update")
    p = load_params(ws / layout.PARAMS_FILE)
    policy, tok = lm.load_causal_lm(ws / layout.policy(0)), lm.load_tokenizer(ws / layout.policy(0))
    path = str(ws / layout.pairs(1))
    pairs = [parse_pair(rec, path, n, "?") for n, rec in jsonl.read(path)]
    enc = reward_model.encode_pairs(tok, pairs, p.model.max_prompt_tokens, p.update.max_length)
    with torch.no_grad():
        s_c, _ = pair_logprobs(policy, enc, tok.pad_token_id)
    nll = float((-s_c / t(*[len(e.chosen_ids) for e in enc]).float()).mean())
    assert m["update/steps"] == p.update.dpo.epochs and nll > 1.0
    assert m["update/chosen_nll_first"] == pytest.approx(nll, rel=1e-4)
    assert m["update/loss_first"] == pytest.approx(math.log(2) + 0.5 * nll, rel=1e-4)
    assert m["update/chosen_nll_last"] < m["update/chosen_nll_first"]


def test_ipo_sees_per_token_mean_logprobs(ws: Path) -> None:
    policy = lm.load_causal_lm(ws / layout.policy(0))
    tok = lm.load_tokenizer(ws / layout.policy(0))
    path = str(ws / layout.pairs(1))
    pairs = [parse_pair(rec, path, n, "?") for n, rec in jsonl.read(path)][:3]
    enc = reward_model.encode_pairs(tok, pairs, 48, 64)
    with torch.no_grad():
        s_c, s_r = pair_logprobs(policy, enc, tok.pad_token_id)
        m_c, m_r = pair_logprobs(policy, enc, tok.pad_token_id, per_token_mean=True)
    assert torch.allclose(m_c, s_c / t(*[len(e.chosen_ids) for e in enc]).float(), atol=1e-5)
    assert torch.allclose(m_r, s_r / t(*[len(e.rejected_ids) for e in enc]).float(), atol=1e-5)


def test_reference_previous_is_last_iterations_policy(ws: Path) -> None:
    set_params(ws / layout.PARAMS_FILE, update__reference="previous")
    run_stage(update.main, ws, 2)
    meta = model_meta(ws, layout.policy(2))
    assert (meta["parent"], meta["reference"]) == (layout.policy(1), layout.policy(1))
    assert layers_changed(weights(ws, layout.policy(1)), weights(ws, layout.policy(2)))
    # the policy starts AT the previous policy, so the first batch's margin is zero (up to
    # rounding: the reference's log-probs come from other batches)
    assert metrics(ws, 2, "update")["update/loss_first"] == pytest.approx(math.log(2), abs=1e-4)
    set_params(ws / layout.PARAMS_FILE, update__reference="initial")
    run_stage(update.main, ws, 2)
    assert model_meta(ws, layout.policy(2))["reference"] == layout.policy(0)
    assert abs(metrics(ws, 2, "update")["update/loss_first"] - math.log(2)) > 1e-4


def test_pair_source_rm_reranks_the_rollouts(ws: Path) -> None:
    set_params(ws / layout.PARAMS_FILE, update__dpo__pair_source="rm")
    run_stage(update.main, ws, 1)
    assert layers_changed(weights(ws, layout.policy(0)), weights(ws, layout.policy(1)))
    m = metrics(ws, 1, "update")
    # one pair per prompt whose best and worst rollouts differ in reward
    path = str(ws / layout.rollouts(1))
    rs = [r for r in (parse_rollout(rec, path, n) for n, rec in jsonl.read(path)) if r.response_ids]
    rm = reward_model.load_reward_model(ws / layout.reward_model(1))
    pad = lm.load_tokenizer(ws / layout.policy(0)).pad_token_id
    mean, _ = reward_model.reward_mean_std(rm, [r.prompt_ids for r in rs],
                                           [r.response_ids for r in rs], pad)
    by_prompt: dict[str, list[float]] = {}
    for r, x in zip(rs, mean.tolist()):
        by_prompt.setdefault(r.prompt_id, []).append(x)
    expected = sum(1 for xs in by_prompt.values() if max(xs) > min(xs))
    assert m["update/rm_pairs"] == m["update/n_onpolicy_pairs"] == m["update/n_pairs"] == expected
    assert expected > 0 and m["update/rm_pair_gap_mean"] > 0
    assert m["update/n_offpolicy_pairs"] == 0


def test_offpolicy_mix_half(ws: Path, base: Path) -> None:
    set_params(ws / layout.PARAMS_FILE, update__dpo__offpolicy_mix=0.5, update__dpo__offpolicy_weight=0.5)
    run_stage(update.main, ws, 1)
    m = metrics(ws, 1, "update")
    n_on, pool0 = len(records(ws, layout.pairs(1))), len(records(ws, layout.pairs_pool(0)))
    assert m["update/n_onpolicy_pairs"] == n_on
    assert m["update/n_offpolicy_pairs"] == min(n_on, pool0) > 0
    assert m["update/n_pairs"] == m["update/n_onpolicy_pairs"] + m["update/n_offpolicy_pairs"]
    assert m["update/offpolicy_weight"] == 0.5
    after = weights(ws, layout.policy(1))
    assert layers_changed(weights(ws, layout.policy(0)), after)
    assert layers_changed(weights(base, layout.policy(1)), after)     # not the unmixed policy
    assert metrics(base, 1, "update")["update/n_offpolicy_pairs"] == 0


def test_offpolicy_importance_weights_and_staleness(ws: Path) -> None:
    """update@2 reuses pool 1 (the cold start's and iteration 1's pairs, both drawn by policy 0:
    one version before policy 1) at truncated importance weights against the sampler's stored
    log-probs; the cold start's pairs, marked as drawn off this lineage (older than all of
    it), are dropped by max_staleness 1 and counted."""
    pool_path = ws / layout.pairs_pool(1)
    pool = records(ws, layout.pairs_pool(1))
    assert all("chosen_logprobs" in r for r in pool)                  # judged pairs carry them
    for r in pool:
        if r["meta"]["iteration"] == 0:
            r["meta"]["iteration"] = 7          # sampler policy 6: not on 2's lineage [1, 0]
    jsonl.write(pool_path, pool)
    n_cold = sum(r["meta"]["iteration"] == 7 for r in pool)
    assert 0 < n_cold < len(pool)
    set_params(ws / layout.PARAMS_FILE, update__dpo__offpolicy_mix=0.5,
               update__dpo__offpolicy_weighting="is", update__dpo__max_staleness=1)
    run_stage(update.main, ws, 2)
    m = metrics(ws, 2, "update")
    n_off, n_on = m["update/n_offpolicy_pairs"], m["update/n_onpolicy_pairs"]
    assert m["update/offpolicy_dropped_stale"] == n_cold
    assert n_off == min(n_on, len(pool) - n_cold) > 0                 # mix 0.5: as many as on
    assert m["update/offpolicy_n"] == m["update/offpolicy/iter_1/n"] == n_off
    assert m["update/offpolicy_fallback_n"] == 0
    assert m["update/offpolicy_staleness_mean"] == 1.0
    assert 0 < m["update/offpolicy_ess"] <= n_off
    assert m["update/offpolicy_ess_frac"] == pytest.approx(m["update/offpolicy_ess"] / n_off)
    assert 0 < m["update/offpolicy_weight_mean"] <= 2.0               # truncated at c = 2
    assert 0.0 <= m["update/offpolicy_truncated_frac"] <= 1.0
    print(f"\ntiny@2 reused pairs: {n_off:.0f}, ESS {m['update/offpolicy_ess']:.2f}, truncated "
          f"{m['update/offpolicy_truncated_frac']:.2f}, mean weight "
          f"{m['update/offpolicy_weight_mean']:.3f}")


# --- reward-model ensemble and audit end to end -----------------------------------------------

@pytest.fixture(scope="module")
def ens(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The base workspace with train_rm@1 rerun as an ensemble of 3."""
    root = tmp_path_factory.mktemp("ensemble") / "ws"
    shutil.copytree(base, root)
    set_params(root / layout.PARAMS_FILE, train_rm__ensemble=3, train_rm__audit_top_n=3, train_rm__audit_random_n=2,
               train_rm__epochs=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(stage.THREADS_ENV, "2")
        run_stage(train_rm.main, root, 1)
    yield root


def test_ensemble_of_3_saves_members_that_differ(ens: Path) -> None:
    rm_dir = ens / layout.reward_model(1)
    assert not (rm_dir / "model.safetensors").exists()
    members = [weights(ens, f"{layout.reward_model(1)}/member_{i}") for i in range(3)]
    assert not (rm_dir / "member_3").exists()
    policy0 = weights(ens, layout.policy(0))
    heads = [m["score.weight"] for m in members]
    assert not torch.equal(heads[0], heads[1]) and not torch.equal(heads[1], heads[2])
    for m in members:
        assert layers_changed({k: policy0[k] for k in m if k in policy0}, m)
    assert model_meta(ens, layout.reward_model(1))["ensemble"] == 3
    m = metrics(ens, 1, "train_rm")
    assert m["rm/ensemble"] == 3 and m["rm/steps"] > 0
    assert 0.0 <= m["rm/ensemble_disagreement"] <= 1.0 and m["rm/ensemble_margin_std"] > 0
    assert 0.0 <= m["rm/accuracy"] <= 1.0 and m["rm/audit_n"] == 0
    assert reward_model.load_stats(rm_dir)["std"] > 0
    assert len(reward_model.load_reward_model(rm_dir)) == 3


def test_queue_lists_the_most_disputed_new_pairs(ens: Path) -> None:
    queue = records(ens, layout.audit_queue(1))
    new = {audit.pair_id(parse_pair(r, "p", 1, "?")) for r in records(ens, layout.pairs(1))}
    top = [q for q in queue if q["reason"] == "disagreement"]
    assert len(top) == min(3, len(new)) and {q["pair_id"] for q in queue} <= new
    stds = [q["rm_margin_std"] for q in top]
    assert stds == sorted(stds, reverse=True) and stds[0] > 0
    assert len(queue) == min(5, len(new)) == metrics(ens, 1, "train_rm")["rm/audit_queue_n"]


def test_evaluate_and_ppo_use_the_ensemble(ens: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(stage.THREADS_ENV, "2")
    root = tmp_path / "ws"
    shutil.copytree(ens, root)
    run_stage(evaluate.main, root, 1)
    m = metrics(root, 1, "evaluate")
    assert m["eval/rm_disagreement"] > 0 and m["eval/rm_disagreement_ref"] > 0
    set_params(root / layout.PARAMS_FILE, update__algo="ppo")                  # load_reward_model/rewards/load_stats
    run_stage(update.main, root, 1)
    assert layers_changed(weights(root, layout.policy(0)), weights(root, layout.policy(1)))


def test_single_rm_reports_no_disagreement(base: Path) -> None:
    m = metrics(base, 1, "train_rm")
    assert m["rm/ensemble"] == 1 and m["rm/ensemble_disagreement"] == 0.0
    assert m["rm/ensemble_margin_std"] == 0.0
    assert (base / layout.AUDIT_LABELS).read_text() == ""           # created empty


def test_audited_labels_override_the_judge_in_the_next_training(ens: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    monkeypatch.setenv(stage.THREADS_ENV, "2")
    root = tmp_path / "ws"
    shutil.copytree(ens, root)
    queue = records(root, layout.audit_queue(1))
    assert len(queue) >= 2
    labels = [{**queue[0], "verdict": "swap", "note": "judge missed the sarcasm"},
              {"pair_id": queue[1]["pair_id"], "verdict": "drop"}]
    (root / layout.AUDIT_LABELS).write_text("".join(json.dumps(x) + "\n" for x in labels))
    before = metrics(root, 1, "train_rm")
    run_stage(train_rm.main, root, 1)
    m = metrics(root, 1, "train_rm")
    assert m["rm/audit_n"] == 2 and m["rm/audit_judge_error_rate"] == 1.0
    assert m["rm/audit_swap_rate"] == m["rm/audit_drop_rate"] == 0.5
    assert m["rm/n_train"] + m["rm/n_heldout"] == before["rm/n_train"] + before["rm/n_heldout"] - 1
    again = {q["pair_id"] for q in records(root, layout.audit_queue(1))}
    assert not again & {queue[0]["pair_id"], queue[1]["pair_id"]}      # not queued twice
    # the judge's own records are untouched: the override lives in the labels file only
    assert records(root, layout.pairs_pool(1)) == records(ens, layout.pairs_pool(1))


# --- precision: auto ---------------------------------------------------------------------------

def test_precision_auto_trains_in_what_this_cpu_runs_natively(ws: Path, tmp_path: Path) -> None:
    """`precision: auto` (the default profiles') is bf16 only where the CPU has native bf16
    matmuls, else fp32: update@1 and train_rm@2 under auto write the same bytes as under the
    precision it resolves to here, and say which one ran. Bytes hold on every CPU: both runs
    are in this process, on the same inputs, shapes, threads and so the same kernels."""
    here = lm.effective_precision("auto")
    assert here == ("bf16" if lm.native_bf16() else "fp32")
    explicit = tmp_path / "explicit"
    shutil.copytree(ws, explicit)
    for root, value in ((ws, "auto"), (explicit, here)):
        set_params(root / layout.PARAMS_FILE, update__dpo__precision=value,
                   train_rm__precision=value)
        run_stage(update.main, root, 1)
        run_stage(train_rm.main, root, 2)
    for rel in (layout.policy(1), layout.reward_model(2)):
        files = sorted(p.relative_to(ws / rel) for p in (ws / rel).rglob("*.safetensors"))
        assert files
        for f in files:
            assert (ws / rel / f).read_bytes() == (explicit / rel / f).read_bytes(), f
    assert metrics(ws, 1, "update")["update/bf16"] == float(here == "bf16")
    assert metrics(ws, 2, "train_rm")["rm/bf16"] == float(here == "bf16")
    assert reward_model.load_stats(ws / layout.reward_model(2))["precision"] == here


def test_rm_pairs_skip_a_response_sampled_twice_whatever_its_scores_last_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """All K samples of a prompt the same response: no pair, even when the RM scored its two
    copies a rounding apart (rows of one batch can round differently on some CPUs)."""
    import tasks.policy.dpo as dpo
    from tasks.data.records import Rollout
    same = [Rollout("p0", (), (1, 2), (5, 6), (-0.1, -0.2), True, "x", "v0", 1)] * 2
    other = [Rollout("p1", (), (1, 3), (r,), (-0.1,), True, "y", "v0", 1) for r in (7, 8)]
    scores = torch.tensor([0.25, 0.25 + 3e-8, 0.1, 0.9])            # the copies part by 3e-8
    monkeypatch.setattr(dpo, "reward_mean_std", lambda *a, **k: (scores, torch.zeros(4)))
    pairs, metrics = dpo.rm_best_vs_worst(object(), same + other, pad_id=0, max_length=16)
    assert [(e.prompt_ids, e.chosen_ids, e.rejected_ids) for e in pairs] == [((1, 3), (8,), (7,))]
    assert metrics["update/rm_pairs"] == 1.0
