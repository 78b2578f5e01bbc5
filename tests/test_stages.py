"""Smoke tests per stage: every stage edge runs on CPU in a temp workspace, writes its outputs
where tasks/core/layout.py says, and training changes the weights. Failure paths exit 2 with the
file and line named and leave what is already stored untouched."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from conftest import set_params as set_workspace_params
from flows.shipped import PARAMS_DATA
from tasks.config.params import load_params
from tasks.core import jsonl, layout
from tasks.data.records import PreferencePair, parse_pair, parse_rollout
from tasks.judging.judges import LexiconJudge
from tasks.models import lm
from tasks.reward import features, reward_model
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
from test_probe import near_zero_share

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "params" / "tiny.yaml"
SETUP: list[tuple[str, Callable[[list[str] | None], None]]] = [
    ("prompts", prompts.main), ("prepare_model", prepare_model.main),
    ("collect_offpolicy", collect_offpolicy.main), ("reference_samples", reference_samples.main)]
LOOP: list[tuple[str, Callable[[list[str] | None], None]]] = [
    ("rollout", rollout.main), ("judge", judge.main), ("train_rm", train_rm.main),
    ("update", update.main), ("evaluate", evaluate.main)]


@dataclass
class Workspace:
    root: Path
    policy0_md5: str = ""                                   # right after prepare_model
    fresh_rm: dict[str, torch.Tensor] = field(default_factory=dict)   # train_rm's initial model

    def path(self, rel: str) -> Path:
        return self.root / rel

    def records(self, rel: str) -> list[dict[str, Any]]:
        return [rec for _, rec in jsonl.read(self.path(rel))]

    def metrics(self, rel: str) -> dict[str, float]:
        return json.loads(self.path(rel).read_text())

    def weights(self, rel: str) -> dict[str, torch.Tensor]:
        return load_file(str(self.path(rel) / "model.safetensors"))


def run(main: Callable[[list[str] | None], None], root: Path, it: int = 0) -> None:
    main(["--root", str(root), "--it", str(it)])


def new_workspace(root: Path, params_text: str | None = None) -> Path:
    (root / "params").mkdir(parents=True)
    for name in PARAMS_DATA:                          # the versioned data the stages read
        shutil.copytree(REPO / "params" / name, root / "params" / name)
    (root / layout.PARAMS_FILE).write_text(params_text or TINY.read_text())
    (root / layout.IMPORT_DIR).mkdir(parents=True)
    return root


def copy_workspace(src: Workspace, dst: Path) -> Workspace:
    shutil.copytree(src.root, dst)
    return Workspace(dst, src.policy0_md5)


def set_params(ws: Workspace, **edits: Any) -> None:
    set_workspace_params(ws.path(layout.PARAMS_FILE), **edits)


def tree_digest(path: Path) -> dict[str, str]:
    """{relative path: md5} of every file below path (hidden temp files included)."""
    return {str(f.relative_to(path)): hashlib.md5(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> set[str]:
    assert a.keys() == b.keys()
    return {k for k in a if not torch.equal(a[k], b[k])}


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    """One iteration of the whole loop, every stage's main() called in DAG order."""
    w = Workspace(new_workspace(tmp_path_factory.mktemp("loop") / "ws"))
    init = train_rm.init_reward_model

    def spy(*args: Any, **kwargs: Any) -> torch.nn.Module:
        model = init(*args, **kwargs)
        w.fresh_rm.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        return model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(stage.THREADS_ENV, "2")
        mp.setattr(train_rm, "init_reward_model", spy)
        for name, main in SETUP:
            run(main, w.root)
            if name == "prepare_model":
                w.policy0_md5 = lm.weights_md5(w.path(layout.policy(0)))
        for _, main in LOOP:
            run(main, w.root, 1)
    yield w


# --- outputs exist ----------------------------------------------------------------------------

EXPECTED = {
    "prompts": [layout.PROMPTS_TRAIN, layout.PROMPTS_HELDOUT],
    "prepare_model": [layout.policy(0) + "/config.json", layout.policy(0) + "/model.safetensors",
                      layout.policy(0) + "/tokenizer.json",
                      layout.policy(0) + "/" + layout.MODEL_META],
    "collect_offpolicy": [layout.pairs_pool(0), layout.OFFPOLICY_METRICS],
    "reference_samples": [layout.REFERENCE_SAMPLES],
    "rollout": [layout.rollouts(1), layout.metrics(1, "rollout")],
    "judge": [layout.pairs(1), layout.pairs_pool(1), layout.metrics(1, "judge")],
    "train_rm": [layout.reward_model(1) + "/model.safetensors",
                 layout.reward_model(1) + "/" + reward_model.STATS_FILE,
                 layout.reward_model(1) + "/" + layout.MODEL_META,
                 layout.metrics(1, "train_rm")],
    "update": [layout.policy(1) + "/model.safetensors", layout.policy(1) + "/tokenizer.json",
               layout.policy(1) + "/" + layout.MODEL_META, layout.metrics(1, "update")],
    "evaluate": [layout.eval_samples(1), layout.metrics(1, "evaluate")],
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_stage_outputs_exist(ws: Workspace, name: str) -> None:
    for rel in EXPECTED[name]:
        assert ws.path(rel).is_file() and ws.path(rel).stat().st_size > 0, rel


def test_no_temporary_files_left(ws: Workspace) -> None:
    leftovers = [p for p in ws.root.rglob(".*") if ".tmp" in p.name or ".old-" in p.name]
    assert not leftovers


def test_prompts_are_disjoint(ws: Workspace) -> None:
    p = load_params(ws.path(layout.PARAMS_FILE))
    train, held = ws.records(layout.PROMPTS_TRAIN), ws.records(layout.PROMPTS_HELDOUT)
    assert (len(train), len(held)) == (p.prompts.n_train, p.prompts.n_heldout)
    assert not {r["subject"] for r in train} & {r["subject"] for r in held}
    assert all(r["subject"] in r["prompt"][0]["content"] for r in train + held)


def test_offpolicy_cold_start_pairs(ws: Workspace) -> None:
    path = ws.path(layout.pairs_pool(0))
    pairs = [parse_pair(rec, str(path), n, "?") for n, rec in jsonl.read(path)]
    assert pairs and all(p.source == "cold_start" for p in pairs)
    assert ws.metrics(layout.OFFPOLICY_METRICS)["offpolicy/n_pairs"] == len(pairs)


# --- rollout ----------------------------------------------------------------------------------

def test_rollouts_carry_one_logprob_per_response_token(ws: Workspace) -> None:
    p = load_params(ws.path(layout.PARAMS_FILE))
    path = ws.path(layout.rollouts(1))
    recs = list(jsonl.read(path))
    assert len(recs) == p.rollout.n_prompts * p.rollout.samples_per_prompt
    tok = lm.load_tokenizer(ws.path(layout.policy(0)))
    for n, rec in recs:
        assert len(rec["logprobs"]) == len(rec["response_ids"]) > 0
        assert all(math.isfinite(x) and x <= 0 for x in rec["logprobs"])
        r = parse_rollout(rec, str(path), n)
        assert r.iteration == 1 and r.policy == ws.policy0_md5
        assert r.finished == (r.response_ids[-1] == tok.eos_token_id)
        assert list(r.prompt_ids) == lm.render_prompt(tok, r.prompt, p.model.max_prompt_tokens)
        assert r.sampling.temperature == p.rollout.generation.temperature
    counts: dict[str, int] = {}
    for _, rec in recs:
        counts[rec["prompt_id"]] = counts.get(rec["prompt_id"], 0) + 1
    assert set(counts.values()) == {p.rollout.samples_per_prompt}
    assert ws.metrics(layout.metrics(1, "rollout"))["rollout/n"] == len(recs)


def test_rollout_logprobs_are_the_sampling_policys(ws: Workspace) -> None:
    path = ws.path(layout.rollouts(1))
    rs = [parse_rollout(rec, str(path), n) for n, rec in jsonl.read(path)]
    policy = lm.load_causal_lm(ws.path(layout.policy(0)))
    pad = lm.load_tokenizer(ws.path(layout.policy(0))).pad_token_id
    with torch.no_grad():
        logp, mask = lm.response_logprobs(policy, [r.prompt_ids for r in rs],
                                          [r.response_ids for r in rs], pad)
    stored = torch.tensor([list(r.logprobs) + [0.0] * (logp.shape[1] - len(r.logprobs))
                           for r in rs])
    assert float(((logp - stored).abs() * mask).max()) < 1e-4


# --- judge ------------------------------------------------------------------------------------

def test_judge_metrics_and_pool(ws: Workspace) -> None:
    m = ws.metrics(layout.metrics(1, "judge"))
    rates = [m[f"judge/rate_{v}"] for v in ("A", "B", "tie", "invalid")]
    assert sum(rates) == pytest.approx(1.0)
    assert m["judge/n"] == load_params(ws.path(layout.PARAMS_FILE)).rollout.n_prompts
    new, pool0, pool1 = (ws.records(layout.pairs(1)), ws.records(layout.pairs_pool(0)),
                         ws.records(layout.pairs_pool(1)))
    assert m["judge/n_pairs"] == len(new) > 0
    assert m["judge/pool_size"] == len(pool1) == len(pool0) + len(new)
    assert pool1 == pool0 + new                         # the pool only grows
    assert all(r["source"] == "iter_1" for r in new)


def test_judged_pairs_come_from_rollouts_and_prefer_the_higher_score(ws: Workspace) -> None:
    p = load_params(ws.path(layout.PARAMS_FILE))
    texts: dict[str, set[str]] = {}
    for rec in ws.records(layout.rollouts(1)):
        texts.setdefault(rec["prompt_id"], set()).add(rec["text"])
    lexicon = LexiconJudge(p.judge.tie_margin, p.judge.min_words, p.judge.version)
    for n, rec in enumerate(ws.records(layout.pairs(1)), start=1):
        pair = parse_pair(rec, "pairs", n, "?")
        assert {pair.chosen, pair.rejected} <= texts[pair.meta["prompt_id"]]
        chosen, rejected = lexicon.score([pair.prompt] * 2, [pair.chosen, pair.rejected])
        assert chosen is not None and rejected is not None
        assert chosen - rejected >= p.judge.tie_margin


def test_judged_pairs_carry_their_rollouts_sampled_tokens(ws: Workspace) -> None:
    """Every judged pair's chosen and rejected ids (and finished flags) are those its rollouts
    were sampled as, in the pairs file and in the pool, cold-start pairs included."""
    sampled: dict[tuple[str, str], list[tuple[list[int], bool]]] = {}
    for rec in ws.records(layout.rollouts(1)):
        sampled.setdefault((rec["prompt_id"], rec["text"]), []).append(
            (rec["response_ids"], rec["finished"]))
    new = ws.records(layout.pairs(1))
    assert new and ws.records(layout.pairs_pool(1))[-len(new):] == new
    for rec in new:
        for side in ("chosen", "rejected"):
            key = (rec["meta"]["prompt_id"], rec[side])
            assert (rec[f"{side}_ids"], rec[f"{side}_finished"]) in sampled[key]
    tok = lm.load_tokenizer(ws.path(layout.policy(0)))
    cold = ws.records(layout.pairs_pool(0))
    assert cold
    for rec in cold:                         # sampled by collect_offpolicy, rollouts not kept
        for side in ("chosen", "rejected"):
            ids = rec[f"{side}_ids"]
            assert tok.decode(ids, skip_special_tokens=True).strip() == rec[side]
            assert rec[f"{side}_finished"] == (ids[-1] == tok.eos_token_id)


def test_dpo_and_rm_train_on_the_sampled_ids(ws: Workspace) -> None:
    """encode_pairs (what DPO and the RM train on) keeps a judged pair's sampled ids: no EOS is
    appended to a truncated response; an imported text pair is tokenised with EOS."""
    p = load_params(ws.path(layout.PARAMS_FILE))
    tok = lm.load_tokenizer(ws.path(layout.policy(0)))
    path = ws.path(layout.pairs_pool(1))
    pairs = [parse_pair(rec, str(path), n, "?") for n, rec in jsonl.read(path)]
    for max_length in (p.update.max_length, p.train_rm.max_length):
        for pair, enc in zip(pairs, reward_model.encode_pairs(
                tok, pairs, p.model.max_prompt_tokens, max_length)):
            room = max_length - len(enc.prompt_ids)
            for text, ids in ((pair.chosen, enc.chosen_ids), (pair.rejected, enc.rejected_ids)):
                drawn = pair.tokens(text)
                assert drawn is not None and ids == drawn.ids[:room]
                assert (ids[-1] == tok.eos_token_id) == (drawn.finished and len(drawn.ids) <= room)
    truncated = [t for pair in pairs for t in (pair.tokens(pair.chosen), pair.tokens(pair.rejected))
                 if not t.finished]
    assert truncated                         # the case the re-tokenising path got wrong
    imported = PreferencePair(pairs[0].prompt, "Great fun.", "Dull.", "import")
    enc = reward_model.encode_pairs(tok, [imported], p.model.max_prompt_tokens, 64)[0]
    assert enc.chosen_ids == tuple(tok("Great fun.", add_special_tokens=False)["input_ids"]
                                   + [tok.eos_token_id])


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


# --- evaluate ---------------------------------------------------------------------------------

def test_evaluate_metrics(ws: Workspace) -> None:
    m = ws.metrics(layout.metrics(1, "evaluate"))
    for key in ("eval/win_rate", "eval/kl", "eval/length_ratio", "eval/n", "eval/invalid_rate",
                "eval/rm_win_rate"):
        assert key in m and math.isfinite(m[key]), key
    assert 0.0 <= m["eval/win_rate"] <= 1.0
    assert m["eval/win_rate_ci_low"] <= m["eval/win_rate"] <= m["eval/win_rate_ci_high"]
    assert m["eval/length_ratio"] > 0
    n = load_params(ws.path(layout.PARAMS_FILE)).evaluate.n_prompts
    samples = ws.records(layout.eval_samples(1))
    assert m["eval/n"] == len(samples) == n
    assert {s["judge_verdict"] for s in samples} <= {"A", "B", "tie", "invalid"}
    # the gold evaluator, on the same pairs
    for key in ("eval/gold_win_rate", "eval/gold_win_rate_ci_low", "eval/gold_win_rate_ci_high",
                "eval/on_topic_rate", "eval/ref_on_topic_rate", "eval/fluency_nll",
                "eval/ref_fluency_nll", "eval/judge_gold_gap"):
        assert key in m and math.isfinite(m[key]), key
    assert {s["gold_verdict"] for s in samples} <= {"A", "B", "tie"}
    wins = sum(s["gold_verdict"] == "A" for s in samples) + 0.5 * sum(
        s["gold_verdict"] == "tie" for s in samples)
    assert m["eval/gold_win_rate"] == pytest.approx(wins / n)
    assert m["eval/on_topic_rate"] == pytest.approx(
        sum(s["on_topic_policy"] for s in samples) / n)
    assert m["eval/judge_gold_gap"] == pytest.approx(m["eval/win_rate"] - m["eval/gold_win_rate"])


def test_best_of_n_baseline(ws: Workspace) -> None:
    """The reference's N candidates per prompt, reranked by the RM, against its single sample;
    the RM's pick is the argmax of its own scores, and the KL is the analytic log N - (N-1)/N."""
    from tasks.reward.reward_model import load_reward_model, reward_mean_std
    from tasks.stages.evaluate import best_of_n, read_samples
    p = load_params(ws.path(layout.PARAMS_FILE)).evaluate.best_of_n
    m = ws.metrics(layout.metrics(1, "evaluate"))
    assert m["eval/bon_n"] == p.n and m["eval/bon_n_prompts"] == p.n_prompts
    assert m["eval/bon_kl"] == pytest.approx(math.log(p.n) - (p.n - 1) / p.n)
    assert 0.0 <= m["eval/bon_win_rate"] <= 1.0 and 0.0 <= m["eval/bon_gold_win_rate"] <= 1.0
    cands = read_samples(str(ws.path(layout.BEST_OF_N_SAMPLES)))
    assert len(cands) == p.n * p.n_prompts
    rm = load_reward_model(ws.path(layout.reward_model(1)))
    pad = lm.load_tokenizer(ws.path(layout.policy(0))).pad_token_id
    picked = best_of_n(rm, cands, p.n, pad)
    # the same call best_of_n makes, in the same process on the same threads: the same bits
    r = reward_mean_std(rm, [c.prompt_ids for c in cands], [c.response_ids for c in cands],
                        pad)[0].view(-1, p.n)
    for i, c in enumerate(picked):
        group = cands[i * p.n: (i + 1) * p.n]
        assert c in group and group.index(c) == int(r[i].argmax())


def test_the_policy_and_reference_responses_are_scored_sharing_each_prompt(
        ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    """evaluate's RM scores: each prompt's policy and reference responses in one packed row
    (the prompt computed once for both), each side's rewards those of scoring it alone up to
    fp32 rounding (other batch shapes sum in another order)."""
    from tasks.reward.reward_model import load_reward_model, reward_mean_std
    from tasks.stages.evaluate import paired_rewards, read_samples
    rm = load_reward_model(ws.path(layout.reward_model(1)))
    pad = lm.load_tokenizer(ws.path(layout.policy(0))).pad_token_id
    refs = read_samples(str(ws.path(layout.REFERENCE_SAMPLES)))
    pol = [replace(r, response_ids=r.response_ids[::-1]) for r in refs]   # other responses
    assert len({r.prompt_ids for r in refs}) == len(refs)        # distinct held-out prompts
    rows: list[tuple[int, int]] = []                # per packed batch: responses, prompts
    real_pack = lm.pack

    def pack(prompts, *args, **kwargs):  # type: ignore[no-untyped-def]
        rows.append((len(prompts), len({tuple(x) for x in prompts})))
        return real_pack(prompts, *args, **kwargs)

    monkeypatch.setattr(lm, "pack", pack)
    (r_pol, sd_pol), (r_ref, _) = paired_rewards(rm, pol, refs, pad)
    monkeypatch.undo()
    assert sum(n for n, _ in rows) == 2 * len(refs)
    assert all(n == 2 * distinct for n, distinct in rows)     # two responses per packed prompt
    alone = [reward_mean_std(rm, [s.prompt_ids for s in x], [s.response_ids for s in x], pad)
             for x in (pol, refs)]
    assert torch.allclose(r_pol, alone[0][0], atol=1e-5) and torch.allclose(r_ref, alone[1][0],
                                                                            atol=1e-5)
    assert torch.equal(sd_pol, torch.zeros(len(pol)))         # one member: no spread
    with pytest.raises(ValueError, match="2 policy samples against 3 reference samples"):
        paired_rewards(rm, pol[:2], refs[:3], pad)


def test_evaluate_and_gate_on_the_redteam_set(ws: Workspace) -> None:
    """The reference's and the policy's responses to the regression set, each checked; the
    rates are those of the stored verdicts, and the gate's violation check reads the paired
    increase over the reference (production 0)."""
    from tasks.evaluation.violations import check, read_probes
    from tasks.stages import gate
    p = load_params(ws.path(layout.PARAMS_FILE))
    probes = read_probes(ws.path(p.evaluate.redteam.prompts_file))
    k = p.evaluate.redteam.samples_per_prompt
    m = ws.metrics(layout.metrics(1, "evaluate"))
    for it, key in ((1, "eval/violation_rate"), (0, "eval/reference_violation_rate")):
        rows = ws.records(layout.redteam_samples(it))
        assert [r["prompt_id"] for r in rows] == [q.prompt_id for q in probes for _ in range(k)]
        by_id = {q.prompt_id: q for q in probes}
        assert all(r["violations"] == list(check(r["text"], by_id[r["prompt_id"]]))
                   for r in rows)
        assert m[key] == pytest.approx(sum(bool(r["violations"]) for r in rows) / len(rows))
        assert m[f"{key}_ci_low"] <= m[key] <= m[f"{key}_ci_high"]
    assert {f"eval/violation_rate/{q.kind}" for q in probes} <= set(m)
    assert 0.0 <= m["eval/redteam_win_rate"] <= 1.0
    run(gate.main, ws.root, 1)
    d = ws.metrics(layout.gate(1))
    check_ = d["checks"]["eval/violation_rate_increase_ci_high <= max_violation_increase"]
    assert check_["threshold"] == p.gate.max_violation_increase
    assert check_["value"] == d["eval/violation_rate_increase_ci_high"]
    assert d["eval/violation_baseline_iteration"] == 0
    assert d["eval/violation_rate_increase"] == pytest.approx(
        m["eval/violation_rate_increase_vs_reference"])


# --- failure paths ----------------------------------------------------------------------------

def run_failing(main: Callable[[list[str] | None], None], root: Path,
                capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        stage.run_main(lambda: run(main, root))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("text, expected", [
    ('{"prompt": "Review Jaws.", "chosen": "Great.", "rejected": "Bad."}\n'
     '{"prompt": "Review Heat.", "chosen": "Great."\n', ":2: invalid JSON"),
    ('{"prompt": "Review Jaws.", "chosen": "Great.", "rejected": "Bad."}\n\n'
     '{"prompt": "Review Heat.", "rejected": "Bad."}\n', ":3: missing field 'chosen'"),
    ('{"prompt": "Review Jaws.", "chosen": "Great.", "rejected": "Bad."}\n'
     '{"prompt": "Review Heat.", "chosen": "Fine.", "rejected": "Fine."}\n',
     ":2: fields 'chosen' and 'rejected' are the same response (no preference)"),
], ids=["invalid-json", "missing-field", "chosen-equals-rejected"])
def test_malformed_import_exits_2_names_file_line_and_keeps_the_pool(
        ws: Workspace, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
        expected: str) -> None:
    bad = copy_workspace(ws, tmp_path / "ws_import")
    set_params(bad, offpolicy__source="import")
    path = bad.root.resolve() / "data" / "import" / "pairs.jsonl"
    path.write_text(text)
    before = tree_digest(bad.path("data/iter_0"))
    metrics_before = bad.path(layout.OFFPOLICY_METRICS).read_bytes()
    err = run_failing(collect_offpolicy.main, bad.root, capsys)
    assert f"{path}{expected}" in err
    assert tree_digest(bad.path("data/iter_0")) == before      # byte-identical, no temp files
    assert bad.path(layout.OFFPOLICY_METRICS).read_bytes() == metrics_before


def test_import_of_good_pairs_replaces_the_pool(ws: Workspace, tmp_path: Path) -> None:
    good = copy_workspace(ws, tmp_path / "ws_import")
    set_params(good, offpolicy__source="import")
    recs = [{"prompt": "Review Jaws.", "chosen": "Great fun.", "rejected": "Bad."},
            {"prompt": [{"role": "user", "content": "Review Heat."}],
             "chosen": [{"role": "assistant", "content": "Superb."}],
             "rejected": [{"role": "assistant", "content": "Dull."}]}]
    jsonl.write(good.path("data/import/pairs.jsonl"), recs)
    run(collect_offpolicy.main, good.root)
    pool = good.records(layout.pairs_pool(0))
    assert [(r["chosen"], r["source"]) for r in pool] == [("Great fun.", "import"),
                                                          ("Superb.", "import")]
    assert good.metrics(layout.OFFPOLICY_METRICS) == {"offpolicy/n_pairs": 2.0}


def test_prepare_model_missing_hf_dir_keeps_existing_policy(
        ws: Workspace, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = copy_workspace(ws, tmp_path / "ws_hf")
    missing = tmp_path / "no_such_model"
    set_params(bad, model__source="hf_dir", model__path=str(missing))
    before = tree_digest(bad.path("models/iter_0"))
    err = run_failing(prepare_model.main, bad.root, capsys)
    assert str(missing) in err and "does not exist" in err
    assert tree_digest(bad.path("models/iter_0")) == before   # untouched, no temp dir left
    assert lm.weights_md5(bad.path(layout.policy(0))) == ws.policy0_md5


def test_prepare_model_from_hf_dir_copies_the_model(ws: Workspace, tmp_path: Path) -> None:
    src = ws.path(layout.policy(0))
    root = new_workspace(tmp_path / "ws_hf")
    dst = Workspace(root)
    set_params(dst, model__source="hf_dir", model__path=str(src))
    run(prepare_model.main, root)
    assert lm.weights_md5(dst.path(layout.policy(0))) == ws.policy0_md5
    meta = json.loads((dst.path(layout.policy(0)) / layout.MODEL_META).read_text())
    assert meta["source"] == "hf_dir" and meta["copied_from"] == str(src)
    lm.load_causal_lm(dst.path(layout.policy(0)))
