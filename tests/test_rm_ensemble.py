"""Reward-model ensemble and human audit: exact values on hand-built cases (milliseconds).

The end-to-end runs of `train_rm` with `ensemble: 3` and with audit labels are in
tests/test_dpo_family.py, which builds a tiny workspace."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from tasks import audit, layout, stage
from tasks.jsonl import DataError
from tasks.losses import bradley_terry_loss, bradley_terry_margin_loss
from tasks.records import Message, PreferencePair
from tasks.reward_model import (RewardEnsemble, ensemble_agreement, member_dirs, member_rewards,
                                reward_mean_std, rewards)


def t(*xs: float) -> Tensor:
    return torch.tensor(xs, dtype=torch.float64)


# --- Bradley-Terry with a margin --------------------------------------------------------------

def test_margin_bradley_terry_exact_value() -> None:
    # r_c - r_r = 1, margin 0.5: -log sigma(0.5) = log(1 + e^-0.5) = 0.474077
    loss = bradley_terry_margin_loss(t(1.0), t(0.0), margin=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.5)), abs=1e-12)
    assert loss.item() == pytest.approx(0.4740769841801067, abs=1e-12)
    # margin 0 is plain Bradley-Terry; a margin always costs more
    r_c, r_r = t(0.0, 2.0, -1.0), t(0.0, 0.0, 2.0)
    assert torch.allclose(bradley_terry_margin_loss(r_c, r_r, 0.0), bradley_terry_loss(r_c, r_r))
    assert bool((bradley_terry_margin_loss(r_c, r_r, 1.0) > bradley_terry_loss(r_c, r_r)).all())


# --- ensemble scoring -------------------------------------------------------------------------

class _Backbone(torch.nn.Module):
    """hidden state = the token id itself (H = 1): the reward is w * (last real token id)."""

    def forward(self, input_ids: Tensor, attention_mask: Tensor,
                position_ids: Tensor | None = None) -> SimpleNamespace:
        return SimpleNamespace(last_hidden_state=input_ids.double()[..., None])   # (B, T, 1)


class _Member(torch.nn.Module):
    base_model_prefix = "model"

    def __init__(self, w: float):
        super().__init__()
        self.model = _Backbone()
        self.score = torch.nn.Linear(1, 1, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.score.weight.fill_(w)


def test_ensemble_mean_and_std_on_a_hand_built_case() -> None:
    ens = RewardEnsemble([_Member(w) for w in (1.0, 2.0, 3.0)])   # type: ignore[misc]
    prompts, responses = [(5, 6), (5,)], [(2,), (4, 9)]      # last real tokens: 2 and 9 (pad 0)
    r = member_rewards(ens, prompts, responses, pad_id=0)                      # (K, B)
    assert torch.equal(r, t(2.0, 9.0, 4.0, 18.0, 6.0, 27.0).reshape(3, 2))
    mean, std = reward_mean_std(ens, prompts, responses, pad_id=0, batch_size=1)
    assert torch.allclose(mean, t(4.0, 18.0))
    # population std of {1, 2, 3} * x = x * sqrt(2/3)
    assert torch.allclose(std, t(2.0, 9.0) * math.sqrt(2.0 / 3.0))
    assert torch.allclose(rewards(ens, prompts, responses, 0), mean)           # PPO's reward
    # a single model is an ensemble of one: its std is 0, its mean is its reward
    one = _Member(2.0)
    one_mean, one_std = reward_mean_std(one, prompts, responses, 0)   # type: ignore[arg-type]
    assert torch.allclose(one_mean, t(4.0, 18.0)) and torch.equal(one_std, t(0.0, 0.0))


def test_ensemble_agreement_hand_values() -> None:
    margins = t(1.0, -1.0, 2.0,
                1.0, 1.0, 3.0,
                1.0, 1.0, -1.0).reshape(3, 3)                # (K=3 members, N=3 pairs)
    m = ensemble_agreement(margins)
    assert m["accuracy"] == pytest.approx(1.0)               # means 1, 1/3, 4/3 all > 0
    assert m["member_accuracy"] == pytest.approx(7 / 9)
    assert m["disagreement"] == pytest.approx(2 / 3)         # pairs 2 and 3 split the members
    stds = [0.0, math.sqrt(8 / 9), math.sqrt(((2 - 4/3)**2 + (3 - 4/3)**2 + (-1 - 4/3)**2) / 3)]
    assert m["margin_std"] == pytest.approx(sum(stds) / 3)
    assert math.isnan(ensemble_agreement(torch.zeros(3, 0))["accuracy"])


def test_member_dirs_single_and_ensemble(tmp_path: Path) -> None:
    single = tmp_path / "rm1"
    single.mkdir()
    (single / "config.json").write_text("{}")
    assert member_dirs(single) == [single]
    ens = tmp_path / "rm3"
    for i in (0, 1, 2, 10):
        (ens / f"{layout.RM_MEMBER_PREFIX}{i}").mkdir(parents=True)
        (ens / f"{layout.RM_MEMBER_PREFIX}{i}" / "config.json").write_text("{}")
    assert [d.name for d in member_dirs(ens)] == ["member_0", "member_1", "member_2", "member_10"]


# --- audit: pair ids, labels, override, queue -------------------------------------------------

def pair(i: int, source: str = "iter_1", **meta: object) -> PreferencePair:
    return PreferencePair((Message("user", f"Review movie {i}."),), f"great {i}", f"bad {i}",
                          source, dict(meta))


def test_pair_id_is_the_md5_of_prompt_chosen_rejected() -> None:
    p = pair(1)
    key = json.dumps([[{"content": "Review movie 1.", "role": "user"}], "great 1", "bad 1"],
                     ensure_ascii=False, sort_keys=True)
    assert audit.pair_id(p) == hashlib.md5(key.encode()).hexdigest()
    assert audit.pair_id(pair(1, "cold_start", judge="x")) == audit.pair_id(p)   # content only
    swapped = PreferencePair(p.prompt, p.rejected, p.chosen, p.source)
    assert audit.pair_id(swapped) != audit.pair_id(p)


def write_labels(path: Path, *recs: dict[str, object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_audit_override_flips_one_pair_and_drops_another(tmp_path: Path) -> None:
    pool = [pair(0), pair(1), pair(2), pair(3, "cold_start")]
    ids = [audit.pair_id(p) for p in pool]
    labels = audit.parse_labels(write_labels(
        tmp_path / "labels.jsonl",
        {"pair_id": ids[1], "verdict": "swap", "note": "the judge liked the sarcasm"},
        {"pair_id": ids[2], "verdict": "drop", "reason": "random"},
        {"pair_id": ids[3], "verdict": "chosen_ok", "reason": "random"},
        {"pair_id": "f" * 32, "verdict": "drop"}))            # not in this pool: ignored
    out, m = audit.apply_audit(pool, labels)
    assert [(p.chosen, p.rejected) for p in out] == [("great 0", "bad 0"), ("bad 1", "great 1"),
                                                     ("great 3", "bad 3")]
    assert out[1].meta["audit"] == "swap" and out[1].meta["audit_of"] == ids[1]
    assert pool[1].chosen == "great 1"                       # the input is not mutated
    assert m["rm/audit_n"] == 3 and m["rm/audit_n_unmatched"] == 1
    assert m["rm/audit_judge_error_rate"] == pytest.approx(2 / 3)
    assert m["rm/audit_swap_rate"] == pytest.approx(1 / 3)
    assert m["rm/audit_drop_rate"] == pytest.approx(1 / 3)
    assert m["rm/audit_n_random"] == 2 and m["rm/audit_judge_error_rate_random"] == 0.5


def test_no_labels_change_nothing() -> None:
    pool = [pair(0), pair(1)]
    out, m = audit.apply_audit(pool, {})
    assert out == pool and m["rm/audit_n"] == 0 and math.isnan(m["rm/audit_judge_error_rate"])


@pytest.mark.parametrize("line, message", [
    ('{"pair_id": "abc", "verdict": "maybe"}', "field 'verdict' must be one of"),
    ('{"verdict": "swap"}', "field 'pair_id' must be a non-empty string"),
    ('{"pair_id": "abc", "verdict": "swap", "note": 3}', "must be strings"),
    ('{"pair_id": "abc", "verdict": "swap"', "invalid JSON"),
])
def test_malformed_labels_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "labels.jsonl"
    path.write_text('{"pair_id": "ok", "verdict": "drop"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=rf"labels.jsonl:3: .*{message}"):
        audit.parse_labels(path)


def test_a_pair_labelled_twice_is_an_error(tmp_path: Path) -> None:
    path = write_labels(tmp_path / "labels.jsonl", {"pair_id": "a", "verdict": "drop"},
                        {"pair_id": "a", "verdict": "swap"})
    with pytest.raises(DataError, match="labels.jsonl:2: pair_id a already labelled at line 1"):
        audit.parse_labels(path)


def test_ensure_labels_file_creates_an_empty_one_and_keeps_an_existing_one(tmp_path: Path
                                                                           ) -> None:
    path = tmp_path / "audit" / "labels.jsonl"
    audit.ensure_labels_file(path)
    assert path.read_text() == "" and audit.parse_labels(path) == {}
    path.write_text('{"pair_id": "a", "verdict": "drop"}\n')
    audit.ensure_labels_file(path)
    assert "a" in audit.parse_labels(path)


def test_queue_ranks_by_disagreement_then_samples_the_rest() -> None:
    pairs = [pair(i, judge="lexicon:v", score_chosen=0.5, score_rejected=0.1) for i in range(8)]
    # member margins (K=2, N=8); std over members = |a - b| / 2 = 0, 3, 1, 5, 2, 0, 4, 0.5
    margins = t(1, 4, 1, 6, 3, 2, 5, 1,
                1, -2, 3, -4, 7, 2, -3, 2).reshape(2, 8)
    labels = {audit.pair_id(pairs[3]): audit.AuditLabel(audit.pair_id(pairs[3]), "swap")}
    queue = audit.build_queue(pairs, margins, labels, top_n=3, random_n=2,
                              rng=stage.generator(0, 6, 1))
    top = [q for q in queue if q["reason"] == "disagreement"]
    # std 4, 3, 2 (pair 3, std 5, is already audited)
    assert [q["chosen"] for q in top] == ["great 6", "great 1", "great 4"]
    assert [q["rm_margin_std"] for q in top] == pytest.approx([4.0, 3.0, 2.0])
    assert top[0]["rm_margin_mean"] == pytest.approx(1.0) and top[0]["score_chosen"] == 0.5
    rand = [q for q in queue if q["reason"] == "random"]
    assert len(rand) == 2 and [q["rank"] for q in queue] == list(range(5))
    picked = {q["pair_id"] for q in queue}
    assert len(picked) == 5 and audit.pair_id(pairs[3]) not in picked
    again = audit.build_queue(pairs, margins, labels, 3, 2, stage.generator(0, 6, 1))
    assert again == queue                                     # seeded
    # a queue line with a verdict added is itself a valid label
    label = audit._label({**queue[0], "verdict": "swap"}, "queue:1")
    assert (label.pair_id, label.reason) == (queue[0]["pair_id"], "disagreement")


def test_single_model_queue_is_only_the_random_sample() -> None:
    pairs = [pair(i) for i in range(6)]
    queue = audit.build_queue(pairs, torch.ones(1, 6), {}, top_n=3, random_n=4,
                              rng=stage.generator(0, 6, 1))
    assert [q["reason"] for q in queue] == ["random"] * 4


def test_truncated_backbone_keeps_the_first_blocks(tmp_path: Path) -> None:
    """num_layers = 1 keeps block 0 of the initial model (same weights) and drops the rest."""
    from tasks.params import TinyModelParams
    from tasks.reward_model import init_reward_model
    from tasks.tiny_model import save_tiny
    tiny_model_dir = tmp_path / "m"
    tiny_model_dir.mkdir()
    save_tiny(TinyModelParams(num_layers=3), 0, tiny_model_dir)
    full = init_reward_model(tiny_model_dir)
    cut = init_reward_model(tiny_model_dir, num_layers=1)
    assert len(cut.model.layers) == 1 == cut.config.num_hidden_layers
    assert len(full.model.layers) > 1
    for (k, v), (k2, v2) in zip(cut.model.layers[0].state_dict().items(),
                                full.model.layers[0].state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    r = member_rewards(cut, [(1, 2, 3)], [(4, 5)], pad_id=0)
    assert r.shape == (1, 1) and torch.isfinite(r).all()


def test_shared_responses_are_scored_once_with_the_same_rewards(tmp_path: Path) -> None:
    """member_pair_rewards scores each distinct (prompt, response) once; the rewards equal
    scoring every pair's two sides separately, and gradients reach the model."""
    from tasks.params import TinyModelParams
    from tasks.reward_model import EncodedPair, init_reward_model, member_pair_rewards
    from tasks.tiny_model import save_tiny
    save_tiny(TinyModelParams(num_layers=1), 0, tmp_path)
    model = init_reward_model(tmp_path, torch.Generator().manual_seed(0))
    x, y = (1, 2, 3), (7, 8)
    a, b, c = (4, 5), (6,), (9, 10, 11)
    batch = [EncodedPair(x, a, b), EncodedPair(x, a, c), EncodedPair(x, c, b), EncodedPair(y, a, b)]
    r_c, r_r = member_pair_rewards(model, batch, pad_id=0)
    with torch.no_grad():
        single = {(p, r): float(member_rewards(model, [p], [r], 0)) for p, r in
                  [(x, a), (x, b), (x, c), (y, a), (y, b)]}
    assert r_c[0].tolist() == pytest.approx([single[(e.prompt_ids, e.chosen_ids)]
                                             for e in batch], abs=1e-5)
    assert r_r[0].tolist() == pytest.approx([single[(e.prompt_ids, e.rejected_ids)]
                                             for e in batch], abs=1e-5)
    (r_c - r_r).sum().backward()
    assert model.score.weight.grad is not None and model.score.weight.grad.abs().sum() > 0


def test_prompt_batches_keep_a_prompts_pairs_together() -> None:
    from tasks.reward_model import EncodedPair, prompt_batches
    data = [EncodedPair((p,), (i,), (i + 100,)) for p in range(5) for i in range(3)]
    batches = prompt_batches(data, 6, torch.Generator().manual_seed(1))
    flat = [e for bt in batches for e in bt]
    assert sorted(flat, key=lambda e: (e.prompt_ids, e.chosen_ids)) == data   # each pair once
    assert [len(bt) for bt in batches] == [6, 6, 3]
    runs = [e.prompt_ids for e in flat]
    assert sum(1 for i in range(1, len(runs)) if runs[i] != runs[i - 1]) == 4  # contiguous
    again = prompt_batches(data, 6, torch.Generator().manual_seed(1))
    assert again == batches and prompt_batches(data, 6, torch.Generator().manual_seed(2)) != batches


def _word_pairs(n_prompts: int, per_prompt: int, g: torch.Generator) -> list:
    """`per_prompt` pairs per prompt: token 7 preferred over token 9 at one place of a body."""
    from tasks.reward_model import EncodedPair
    out = []
    for _ in range(n_prompts):
        prompt = tuple(torch.randint(20, 60, (4,), generator=g).tolist())
        for _ in range(per_prompt):
            body = torch.randint(20, 60, (6,), generator=g).tolist()
            at = int(torch.randint(0, 6, (1,), generator=g))
            good, bad = list(body), list(body)
            good[at], bad[at] = 7, 9
            out.append(EncodedPair(prompt, tuple(good), tuple(bad)))
    return out


def test_mean_pooling_and_the_probe_head_learn_a_word_preference(tmp_path: Path) -> None:
    """pooling: mean reads the average of the response's states; head_init: probe fits the head
    on frozen features so that held-out pairs with the same preference (token 7 good, token 9
    bad, anywhere in the response) are ranked right, with no gradient step on the backbone."""
    from tasks.params import TinyModelParams, TrainRMParams
    from tasks.probe import fit_probe_head
    from tasks.reward_model import init_reward_model, pair_margins
    from tasks.tiny_model import save_tiny
    save_tiny(TinyModelParams(num_layers=1), 0, tmp_path)
    model = init_reward_model(tmp_path, torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.model.state_dict().items()}
    g = torch.Generator().manual_seed(3)

    def pairs(n: int) -> list:
        return _word_pairs(n, 1, g)
    p = TrainRMParams(pooling="mean", head_init="probe", epochs=0, probe_l2=0.1)
    m = fit_probe_head(model, pairs(64), p, pad_id=0)
    assert m["probe_train_accuracy"] > 0.9
    ens = RewardEnsemble([model], "fp32", "mean")
    assert float((pair_margins(ens, pairs(64), 0) > 0).float().mean()) > 0.85
    assert all(torch.equal(v, before[k]) for k, v in model.model.state_dict().items())
    # the same response scored alone or packed with others: pooling sees only its own tokens
    x, y1, y2 = (21, 22), (30, 31, 32), (40,)
    with torch.no_grad():
        both = member_rewards(ens, [x, x], [y1, y2], 0)[0].tolist()
        alone = [float(member_rewards(ens, [x], [y], 0)) for y in (y1, y2)]
    assert both == pytest.approx(alone, abs=1e-5)


def test_frozen_features_give_the_same_probe_and_metrics_as_rescoring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `epochs: 0` train_rm computes each response's features once (FrozenFeatures) and
    fits the probe, scores train / held-out pairs and the audit margins from them: the probe's
    weights are the uncached fit's bit for bit (one member), the metrics and margins those of
    scoring the pairs again through the model (to float32 noise), and a response seen in many
    pairs goes through the backbone once."""
    from tasks.params import TinyModelParams, TrainRMParams
    from tasks.probe import FrozenFeatures, fit_probe_head
    from tasks.reward_model import (EncodedPair, ensemble_metrics, heads, init_reward_model,
                                    pair_margins)
    from tasks.tiny_model import save_tiny
    save_tiny(TinyModelParams(num_layers=1), 0, tmp_path)
    g = torch.Generator().manual_seed(5)
    pool = []                       # 12 prompts x 4 samples, every pair of them: 6 per prompt
    for _ in range(12):
        x = tuple(torch.randint(20, 60, (5,), generator=g).tolist())
        ys = [tuple(torch.randint(20, 60, (int(torch.randint(2, 7, (1,), generator=g)),),
                                  generator=g).tolist()) for _ in range(4)]
        pool += [EncodedPair(x, ys[i], ys[j]) for i in range(4) for j in range(i + 1, 4)]
    train, held = pool[:54], pool[54:]
    p = TrainRMParams(pooling="mean", head_init="probe", epochs=0, probe_l2=0.1)
    plain = init_reward_model(tmp_path, torch.Generator().manual_seed(0))
    fit_probe_head(plain, train, p, pad_id=0)
    cached = init_reward_model(tmp_path, torch.Generator().manual_seed(0))
    cache = FrozenFeatures(cached, 0, p.pooling, p.precision)
    from tasks import probe
    computed: list[int] = []       # responses through the cached model's backbone
    real = probe.features

    def counting(model, prompts, responses, *a, **k):  # type: ignore[no-untyped-def]
        if model is cached:
            computed.append(len(responses))
        return real(model, prompts, responses, *a, **k)
    monkeypatch.setattr(probe, "features", counting)
    fit_probe_head(cached, train, p, pad_id=0, cache=cache)
    assert torch.equal(cached.score.weight, plain.score.weight)
    for members in ([plain], [plain, init_reward_model(tmp_path, torch.Generator().manual_seed(1))]):
        ens = RewardEnsemble(members, "fp32", "mean")
        with_cache, stats_c = ensemble_metrics(ens, train, held, 0, cache)
        again, stats_a = ensemble_metrics(ens, train, held, 0)
        for k in ("rm/accuracy", "rm/train_accuracy", "rm/ensemble_disagreement"):
            assert with_cache[k] == again[k], k
        assert with_cache["rm/ensemble_margin_std"] == pytest.approx(
            again["rm/ensemble_margin_std"], abs=1e-5)
        assert (stats_c["mean"], stats_c["std"]) == pytest.approx(
            (stats_a["mean"], stats_a["std"]), abs=1e-5)
        assert torch.allclose(cache.margins(heads(ens), pool), pair_margins(ens, pool, 0),
                              atol=1e-5)
    unique = {(e.prompt_ids, side) for e in pool for side in (e.chosen_ids, e.rejected_ids)}
    assert len(cache.rows) == len(unique) == 48 == sum(computed)


# --- the probe's L2 by cross-validation over training prompts -------------------------------


def _isotropic(n_prompts: int, seed: int) -> tuple[Tensor, list[tuple[int, ...]]]:
    """Chosen-minus-rejected features of 4 pairs per prompt: coordinate 0 carries the
    preference under heavy label noise, 100 more carry none. Few pairs for the width: a weak
    L2 fits the noise, a strong one keeps near the mean difference (the better direction)."""
    g = torch.Generator().manual_seed(seed)
    diff = torch.randn(4 * n_prompts, 101, generator=g)
    diff[:, 0] += 1.0
    return diff, [(i // 4, 7) for i in range(4 * n_prompts)]


def _confounded(n: int, seed: int) -> tuple[Tensor, list[tuple[int, ...]]]:
    """Coordinate 0 is the preference plus a large shared nuisance z, coordinate 1 is z alone:
    only a weakly regularised fit learns to subtract them; a strong L2 stays near the mean
    difference, which z swamps."""
    g = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(n, generator=g)
    diff = 0.3 * torch.randn(n, 5, generator=g)
    diff[:, 0] += 0.3 + z
    diff[:, 1] += z
    return diff, [(i // 4, 7) for i in range(n)]


def test_cross_validation_over_prompts_picks_the_l2_that_predicts_fresh_pairs() -> None:
    """choose_probe_l2 reads only the training pairs and lands on the side of the grid that
    predicts fresh pairs better, in both directions: strong where a weak L2 overfits, weak
    where a strong one cannot separate the signal. The folds group pairs by prompt."""
    from tasks.probe import _probe_fit, choose_probe_l2, probe_fold
    grid = (0.001, 0.01, 0.1, 1.0, 10.0)
    for make, n, side in ((_isotropic, 30, "strong"), (_confounded, 800, "weak")):
        diff, prompts = make(n, 0)
        fresh, _ = make(4000 if make is _confounded else 1000, 1)
        acc = {l2: float((fresh @ _probe_fit(diff, l2) > 0).float().mean()) for l2 in grid}
        chosen, cv = choose_probe_l2(diff, prompts, grid)
        assert set(cv) == set(grid)
        assert (chosen >= 0.1) if side == "strong" else (chosen <= 0.01)
        wrong = min(grid) if side == "strong" else max(grid)
        assert acc[chosen] > acc[wrong] + 0.02, (make.__name__, chosen, acc)
    folds: dict[tuple[int, ...], set[int]] = {}
    for x in _isotropic(30, 0)[1]:
        folds.setdefault(x, set()).add(probe_fold(x, 5))
    assert all(len(f) == 1 for f in folds.values()) and len(set().union(*folds.values())) == 5


def test_probe_head_reports_the_chosen_l2_and_falls_back_below_five_prompts(tmp_path: Path
                                                                              ) -> None:
    """fit_probe_head with `probe_l2_grid`: the head is the probe at the CV choice (the same
    weights as fitting that L2 directly) and the metrics name it; with fewer training prompts
    than folds, `probe_l2` is used as written."""
    from tasks.params import TinyModelParams, TrainRMParams
    from tasks.probe import fit_probe_head
    from tasks.reward_model import EncodedPair, init_reward_model
    from tasks.tiny_model import save_tiny
    save_tiny(TinyModelParams(num_layers=1), 0, tmp_path)
    g = torch.Generator().manual_seed(4)
    pool = []
    for _ in range(12):
        x = tuple(torch.randint(20, 60, (5,), generator=g).tolist())
        ys = [tuple(torch.randint(20, 60, (4,), generator=g).tolist()) for _ in range(4)]
        pool += [EncodedPair(x, ys[i], ys[j]) for i in range(4) for j in range(i + 1, 4)]
    grid = TrainRMParams(pooling="mean", head_init="probe", epochs=0, probe_l2=0.1,
                         probe_l2_grid=(0.03, 0.3, 3.0))
    model = init_reward_model(tmp_path, torch.Generator().manual_seed(0))
    m = fit_probe_head(model, pool, grid, pad_id=0)
    assert m["probe_l2"] in (0.03, 0.3, 3.0) and 0.0 <= m["probe_cv_accuracy"] <= 1.0
    direct = init_reward_model(tmp_path, torch.Generator().manual_seed(0))
    fixed = TrainRMParams(pooling="mean", head_init="probe", epochs=0, probe_l2=m["probe_l2"])
    fit_probe_head(direct, pool, fixed, pad_id=0)
    assert torch.equal(model.score.weight, direct.score.weight)
    few = init_reward_model(tmp_path, torch.Generator().manual_seed(0))
    m_few = fit_probe_head(few, pool[:6 * 4], grid, pad_id=0)         # 4 prompts < 5 folds
    assert m_few["probe_l2"] == 0.1 and "probe_cv_accuracy" not in m_few


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_features_at_every_depth_equal_a_truncated_models(tmp_path: Path, pooling: str) -> None:
    """One forward pass through all blocks gives, for each depth d, exactly the features a
    model cut to d blocks computes (its final norm included)."""
    from tasks.params import TinyModelParams
    from tasks.probe import features_at_depths
    from tasks.reward_model import features, init_reward_model
    from tasks.tiny_model import save_tiny
    save_tiny(TinyModelParams(num_layers=4), 0, tmp_path)
    prompts, responses = [(21, 22, 23), (21, 22, 23), (30,)], [(40, 41), (42,), (50, 51, 52)]
    with torch.no_grad():
        every = features_at_depths(init_reward_model(tmp_path), prompts, responses, 0, pooling,
                                   [1, 2, 4])                                     # (B, D, H)
        for j, d in enumerate([1, 2, 4]):
            cut = init_reward_model(tmp_path, num_layers=d)
            assert torch.allclose(every[:, j], features(cut, prompts, responses, 0, pooling),
                                  atol=1e-6), d


def test_the_probes_depth_is_chosen_by_cross_validation_and_kept(tmp_path: Path) -> None:
    """choose_depth picks the depth whose probe (at its best L2) has the lowest left-out
    log-loss over the training prompts, computed independently here on models cut to each
    depth; it cuts the model to it, and the probe fitted through its cache is bit for bit the
    probe fitted on a fresh model of that depth. A grid deeper than the backbone is one line."""
    from tasks.params import TinyModelParams, TrainRMParams
    from tasks.probe import PROBE_FOLDS, FrozenFeatures, choose_depth, fit_probe_head, probe_cv
    from tasks.reward_model import depth, init_reward_model
    from tasks.tiny_model import save_tiny
    save_tiny(TinyModelParams(num_layers=3), 0, tmp_path)
    train = _word_pairs(10, 4, torch.Generator().manual_seed(5))
    p = TrainRMParams(pooling="mean", head_init="probe", epochs=0, probe_l2_grid=(0.1, 1.0),
                      num_layers_grid=(1, 2, 3))
    expected = {}
    for d in (1, 2, 3):
        cache = FrozenFeatures(init_reward_model(tmp_path, num_layers=d), 0, "mean", "fp32")
        diff = (cache.get([(e.prompt_ids, e.chosen_ids) for e in train])
                - cache.get([(e.prompt_ids, e.rejected_ids) for e in train]))
        expected[d] = min(probe_cv(diff, [e.prompt_ids for e in train], (0.1, 1.0),
                                   PROBE_FOLDS)[0].values())
    model = init_reward_model(tmp_path, torch.Generator().manual_seed(0))
    cache, m = choose_depth(model, train, p, 0)
    best = min(expected, key=lambda d: (expected[d], d))
    assert m["num_layers"] == best and depth(model) == best and cache.model is model
    assert m["depth_cv_loss"] == pytest.approx(expected[best], abs=1e-6)
    fit_probe_head(model, train, p, 0, cache=cache)
    fresh = init_reward_model(tmp_path, torch.Generator().manual_seed(0), best)
    fit_probe_head(fresh, train, p, 0)
    assert torch.allclose(model.score.weight, fresh.score.weight, atol=1e-6)
    with pytest.raises(DataError, match=r"num_layers_grid: 5 blocks asked for, the backbone "
                                        r"has 3"):
        choose_depth(init_reward_model(tmp_path), train,
                     TrainRMParams(pooling="mean", head_init="probe", epochs=0,
                                   num_layers_grid=(2, 5)), 0)
