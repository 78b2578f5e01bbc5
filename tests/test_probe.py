"""The reward model's probe head (tasks/reward/probe.py): mean pooling and the probe learn a word
preference, frozen features give the same probe and metrics as rescoring, the probe's L2 and
the backbone's depth chosen by cross-validation over training prompts (tiny models, seconds)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from tasks.core.jsonl import DataError
from tasks.reward.reward_model import RewardEnsemble, member_rewards


def _word_pairs(n_prompts: int, per_prompt: int, g: torch.Generator) -> list:
    """`per_prompt` pairs per prompt: token 7 preferred over token 9 at one place of a body."""
    from tasks.reward.features import EncodedPair
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


def near_zero_share(margins: Tensor, eps: float = 1e-4) -> float:
    """The share of pairs whose ensemble-mean margin or any member's margin (K, N) lies within
    eps of 0: by that much, and no more, a rate of signs (accuracy, disagreement) may move when
    the margins are computed in other batches or kernels (float32 rounding, CPU-dependent)."""
    near = (margins.abs() < eps).any(0) | (margins.mean(0).abs() < eps)
    return float(near.float().mean())


def test_mean_pooling_and_the_probe_head_learn_a_word_preference(tmp_path: Path) -> None:
    """pooling: mean reads the average of the response's states; head_init: probe fits the head
    on frozen features so that held-out pairs with the same preference (token 7 good, token 9
    bad, anywhere in the response) are ranked right, with no gradient step on the backbone."""
    from tasks.config.params import TinyModelParams, TrainRMParams
    from tasks.models.tiny_model import save_tiny
    from tasks.reward.probe import fit_probe_head
    from tasks.reward.reward_model import init_reward_model, pair_margins
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
    from tasks.config.params import TinyModelParams, TrainRMParams
    from tasks.models.tiny_model import save_tiny
    from tasks.reward.features import EncodedPair, FrozenFeatures
    from tasks.reward.probe import fit_probe_head
    from tasks.reward.reward_model import ensemble_metrics, heads, init_reward_model, pair_margins
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
    from tasks.reward import features
    computed: list[int] = []       # responses through the cached model's backbone
    real = features.features

    def counting(model, prompts, responses, *a, **k):  # type: ignore[no-untyped-def]
        if model is cached:
            computed.append(len(responses))
        return real(model, prompts, responses, *a, **k)
    monkeypatch.setattr(features, "features", counting)
    fit_probe_head(cached, train, p, pad_id=0, cache=cache)
    # bits: both fits compute the same keys' features in the same batches (FrozenFeatures.get),
    # in one process on the same threads, then the same closed form: the same ops and shapes
    assert torch.equal(cached.score.weight, plain.score.weight)
    for members in ([plain], [plain, init_reward_model(tmp_path, torch.Generator().manual_seed(1))]):
        ens = RewardEnsemble(members, "fp32", "mean")
        with_cache, stats_c = ensemble_metrics(ens, train, held, 0, cache)
        again, stats_a = ensemble_metrics(ens, train, held, 0)
        # rescoring batches the pairs otherwise: margins agree to rounding, so these rates of
        # signs agree exactly unless a margin lies within rounding of 0
        held_near = near_zero_share(pair_margins(ens, held, 0))
        near = {"rm/accuracy": held_near, "rm/ensemble_disagreement": held_near,
                "rm/train_accuracy": near_zero_share(pair_margins(ens, train, 0))}
        for k, share in near.items():
            assert abs(with_cache[k] - again[k]) <= share + 1e-9, (k, share)
        assert with_cache["rm/ensemble_margin_std"] == pytest.approx(
            again["rm/ensemble_margin_std"], abs=1e-5)
        assert (stats_c["mean"], stats_c["std"]) == pytest.approx(
            (stats_a["mean"], stats_a["std"]), abs=1e-5)
        assert torch.allclose(cache.margins(heads(ens), pool), pair_margins(ens, pool, 0),
                              atol=1e-5)
    unique = {(e.prompt_ids, side) for e in pool for side in (e.chosen_ids, e.rejected_ids)}
    assert len(cache.rows) == len(unique) == 48 == sum(computed)


def test_stats_come_from_spaced_training_pairs_held_out_accuracy_from_all(tmp_path: Path
                                                                          ) -> None:
    """`stats_pairs` N: the normalisation stats and rm/train_accuracy are those of N training
    pairs evenly spaced over the pool's order (scored in the same batches as that list alone,
    so equal); held-out accuracy still reads every held-out pair."""
    from tasks.config.params import TinyModelParams
    from tasks.models.tiny_model import save_tiny
    from tasks.reward.features import EncodedPair
    from tasks.reward.reward_model import ensemble_metrics, init_reward_model, spaced
    save_tiny(TinyModelParams(num_layers=1), 0, tmp_path)
    g = torch.Generator().manual_seed(3)
    pool = [EncodedPair(tuple(torch.randint(20, 60, (4,), generator=g).tolist()),
                        tuple(torch.randint(20, 60, (3,), generator=g).tolist()),
                        tuple(torch.randint(20, 60, (5,), generator=g).tolist()))
            for _ in range(40)]
    train, held = pool[:30], pool[30:]
    assert spaced(train, 0) == train == spaced(train, 30) == spaced(train, 99)
    assert spaced(train, 3) == [train[0], train[10], train[20]]
    assert spaced(train, 7)[-1] == train[25] and len(set(spaced(train, 7))) == 7
    ens = RewardEnsemble([init_reward_model(tmp_path, torch.Generator().manual_seed(0))],
                         "fp32", "mean")
    some, stats_some = ensemble_metrics(ens, train, held, 0, stats_pairs=6)
    alone, stats_alone = ensemble_metrics(ens, spaced(train, 6), held, 0)
    every, stats_every = ensemble_metrics(ens, train, held, 0)
    assert (some["rm/n_train_scored"], some["rm/n_train"], every["rm/n_train_scored"]) == (
        6, 30, 30)
    assert stats_some == stats_alone != stats_every
    assert some["rm/train_accuracy"] == alone["rm/train_accuracy"]
    assert some["rm/accuracy"] == every["rm/accuracy"]


@pytest.mark.parametrize("settings,frozen", [
    ({"freeze_layers": 1}, ("model.embed_tokens.", "model.layers.0.")),
    ({"freeze_embeddings": True}, ("model.embed_tokens.",)),
])
def test_freeze_layers_trains_only_the_blocks_above_them(
        tmp_path: Path, settings: dict[str, object], frozen: tuple[str, ...]) -> None:
    """`freeze_layers: 1` on a two-block backbone: the embeddings and block 0 end as they were
    loaded, no gradient ever reached them (autograd stopped above them), block 1, the norm and
    the head moved, and the Bradley-Terry loss on the training pairs fell. With
    `freeze_embeddings` alone the embeddings are kept and both blocks train."""
    from tasks.config.params import TinyModelParams, TrainRMParams
    from tasks.models.tiny_model import save_tiny
    from tasks.reward.reward_model import init_reward_model, pair_margins, train_reward
    save_tiny(TinyModelParams(num_layers=2), 0, tmp_path)
    model = init_reward_model(tmp_path, torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pairs = _word_pairs(16, 2, torch.Generator().manual_seed(3))
    ens = RewardEnsemble([model], "fp32", "mean")
    loss = lambda: float(torch.nn.functional.softplus(-pair_margins(ens, pairs, 0)).mean())
    start = loss()
    p = TrainRMParams(pooling="mean", epochs=3, lr=3e-3, batch_size=8,
                      **settings)  # type: ignore[arg-type]
    train_reward(model, pairs, p, 0, torch.Generator().manual_seed(1))
    for k, q in model.named_parameters():
        moved = not torch.equal(q.detach(), before[k])
        assert moved != k.startswith(frozen), k
        assert (q.grad is None) == k.startswith(frozen), k
    assert loss() < start


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
    from tasks.reward.probe import choose_probe_l2, probe_fit, probe_fold
    grid = (0.001, 0.01, 0.1, 1.0, 10.0)
    for make, n, side in ((_isotropic, 30, "strong"), (_confounded, 800, "weak")):
        diff, prompts = make(n, 0)
        fresh, _ = make(4000 if make is _confounded else 1000, 1)
        acc = {l2: float((fresh @ probe_fit(diff, l2) > 0).float().mean()) for l2 in grid}
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
    from tasks.config.params import TinyModelParams, TrainRMParams
    from tasks.models.tiny_model import save_tiny
    from tasks.reward.features import EncodedPair
    from tasks.reward.probe import fit_probe_head
    from tasks.reward.reward_model import init_reward_model
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
    # bits: the same features (same batches, one process, same threads) and the same fit at
    # the same L2; cross-validation only chose that L2
    assert torch.equal(model.score.weight, direct.score.weight)
    few = init_reward_model(tmp_path, torch.Generator().manual_seed(0))
    m_few = fit_probe_head(few, pool[:6 * 4], grid, pad_id=0)         # 4 prompts < 5 folds
    assert m_few["probe_l2"] == 0.1 and "probe_cv_accuracy" not in m_few


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_features_at_every_depth_equal_a_truncated_models(tmp_path: Path, pooling: str) -> None:
    """One forward pass through all blocks gives, for each depth d, exactly the features a
    model cut to d blocks computes (its final norm included)."""
    from tasks.config.params import TinyModelParams
    from tasks.models.tiny_model import save_tiny
    from tasks.reward.features import features
    from tasks.reward.probe import features_at_depths
    from tasks.reward.reward_model import init_reward_model
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
    depth; it cuts the model to it, and the probe fitted through its cache is the probe fitted
    on a fresh model of that depth. Here the features are computed in other batches (cut
    models, chosen and rejected apart), so the losses and weights agree to float32 rounding,
    not bit for bit. A grid deeper than the backbone is one line."""
    from tasks.config.params import TinyModelParams, TrainRMParams
    from tasks.models.tiny_model import save_tiny
    from tasks.reward.features import FrozenFeatures, depth
    from tasks.reward.probe import PROBE_FOLDS, choose_depth, fit_probe_head, probe_cv
    from tasks.reward.reward_model import init_reward_model
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
    best, picked = min(expected, key=lambda d: (expected[d], d)), int(m["num_layers"])
    # the same depth, unless two depths' losses tie to within rounding
    assert picked == best or abs(expected[picked] - expected[best]) < 1e-5, expected
    assert depth(model) == picked and cache.model is model
    assert m["depth_cv_loss"] == pytest.approx(expected[picked], abs=1e-5)
    fit_probe_head(model, train, p, 0, cache=cache)
    fresh = init_reward_model(tmp_path, torch.Generator().manual_seed(0), picked)
    fit_probe_head(fresh, train, p, 0)
    assert torch.allclose(model.score.weight, fresh.score.weight, atol=1e-6)
    with pytest.raises(DataError, match=r"num_layers_grid: 5 blocks asked for, the backbone "
                                        r"has 3"):
        choose_depth(init_reward_model(tmp_path), train,
                     TrainRMParams(pooling="mean", head_init="probe", epochs=0,
                                   num_layers_grid=(2, 5)), 0)
