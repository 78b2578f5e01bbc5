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

from tasks.core import layout
from tasks.core.jsonl import DataError
from tasks.data import audit
from tasks.data.records import Message, PreferencePair
from tasks.functional.losses import bradley_terry_loss, bradley_terry_margin_loss
from tasks.reward.reward_model import (
    RewardEnsemble,
    ensemble_agreement,
    member_dirs,
    member_rewards,
    reward_mean_std,
    rewards,
)
from tasks.runtime import stage


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


def test_member_dirs_of_a_head_only_model_and_a_member_with_neither(tmp_path: Path) -> None:
    """A frozen backbone's members hold only head.safetensors; a member with no head and no
    config is refused in one line naming it."""
    from tasks.models.lm import ModelError
    from tasks.reward.reward_model import HEAD_FILE
    heads = tmp_path / "rm"
    for i in (0, 1):
        (heads / f"{layout.RM_MEMBER_PREFIX}{i}").mkdir(parents=True)
        (heads / f"{layout.RM_MEMBER_PREFIX}{i}" / HEAD_FILE).write_bytes(b"")
    assert [d.name for d in member_dirs(heads)] == ["member_0", "member_1"]
    (heads / f"{layout.RM_MEMBER_PREFIX}2").mkdir()
    with pytest.raises(ModelError, match=r"member_2: no config.json"):
        member_dirs(heads)


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
        {"pair_id": "f" * 32, "verdict": "drop", "source": "iter_9"}))  # a later pair: counted
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
    label = audit.parse_label({**queue[0], "verdict": "swap"}, "queue:1")
    assert (label.pair_id, label.reason) == (queue[0]["pair_id"], "disagreement")


def test_single_model_queue_is_only_the_random_sample() -> None:
    pairs = [pair(i) for i in range(6)]
    queue = audit.build_queue(pairs, torch.ones(1, 6), {}, top_n=3, random_n=4,
                              rng=stage.generator(0, 6, 1))
    assert [q["reason"] for q in queue] == ["random"] * 4


def test_queue_scores_only_what_it_needs() -> None:
    """Given a function of pair indices, K = 1 scores the queued pairs alone (nothing is
    ranked), K > 1 every unaudited pair (to rank them); the queue is the table's."""
    pairs = [pair(i) for i in range(8)]
    table = t(1, 4, 1, 6, 3, 2, 5, 1,
              1, -2, 3, -4, 7, 2, -3, 2).reshape(2, 8)
    labels = {audit.pair_id(pairs[3]): audit.AuditLabel(audit.pair_id(pairs[3]), "swap")}
    for k in (1, 2):
        asked: list[list[int]] = []

        def score(idx, k=k):  # type: ignore[no-untyped-def]
            asked.append(list(idx))
            return table[:k, list(idx)]
        queue = audit.build_queue(pairs, score, labels, 3, 2, stage.generator(0, 6, 1), k)
        assert queue == audit.build_queue(pairs, table[:k], labels, 3, 2,
                                          stage.generator(0, 6, 1))
        queued = [i for i in range(8) if audit.pair_id(pairs[i]) in
                  {q["pair_id"] for q in queue}]
        if k == 1:
            assert len(asked) == 1 and sorted(asked[0]) == queued and len(queued) == 2
        else:                       # ranked from one call; the queue reuses its margins
            assert asked == [[0, 1, 2, 4, 5, 6, 7]]


def test_truncated_backbone_keeps_the_first_blocks(tmp_path: Path) -> None:
    """num_layers = 1 keeps block 0 of the initial model (same weights) and drops the rest."""
    from tasks.config.params import TinyModelParams
    from tasks.models.tiny_model import save_tiny
    from tasks.reward.reward_model import init_reward_model
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
    from tasks.config.params import TinyModelParams
    from tasks.models.tiny_model import save_tiny
    from tasks.reward.features import EncodedPair
    from tasks.reward.reward_model import init_reward_model, member_pair_rewards
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
    from tasks.reward.features import EncodedPair
    from tasks.reward.reward_model import prompt_batches
    data = [EncodedPair((p,), (i,), (i + 100,)) for p in range(5) for i in range(3)]
    batches = prompt_batches(data, 6, torch.Generator().manual_seed(1))
    flat = [e for bt in batches for e in bt]
    assert sorted(flat, key=lambda e: (e.prompt_ids, e.chosen_ids)) == data   # each pair once
    assert [len(bt) for bt in batches] == [6, 6, 3]
    runs = [e.prompt_ids for e in flat]
    assert sum(1 for i in range(1, len(runs)) if runs[i] != runs[i - 1]) == 4  # contiguous
    again = prompt_batches(data, 6, torch.Generator().manual_seed(1))
    assert again == batches and prompt_batches(data, 6, torch.Generator().manual_seed(2)) != batches


@pytest.mark.parametrize("sizes, batch_size, expected", [
    ([5, 5, 5, 5], 8, [10, 10]),          # 10 is 2 over, 5 is 3 short: two prompts a batch
    ([3, 3, 3, 3, 3], 8, [9, 6]),         # 9 is 1 over, 6 is 2 short
    ([20, 2, 2], 8, None),                # a prompt over the size is a batch of its own
    ([1] * 10, 4, [4, 4, 2]),             # one pair a prompt: the fixed size, as before
])
def test_prompt_batches_score_each_response_once_an_epoch(sizes: list[int], batch_size: int,
                                                          expected: list[int] | None) -> None:
    from tasks.reward.features import EncodedPair
    from tasks.reward.reward_model import prompt_batches
    data = [EncodedPair((p,), (i,), (i + 100,)) for p, n in enumerate(sizes) for i in range(n)]
    batches = prompt_batches(data, batch_size, torch.Generator().manual_seed(0))
    where = {}
    for b, batch in enumerate(batches):
        for e in batch:
            assert where.setdefault(e.prompt_ids, b) == b    # a prompt's pairs in one batch
    key = lambda e: (e.prompt_ids, e.chosen_ids)
    assert sorted((e for bt in batches for e in bt), key=key) == data          # each once
    if expected is not None:
        assert [len(bt) for bt in batches] == expected
    else:
        assert any(len(bt) == 20 for bt in batches) and max(len(bt) for bt in batches) == 20


def test_the_window_keeps_the_newest_iterations_and_every_off_policy_and_audited_pair() -> None:
    from tasks.stages.train_rm import window
    pool = [pair(i, f"iter_{i % 5 + 1}") for i in range(10)] + [pair(10, "cold_start"),
                                                                 pair(11, "import")]
    audited = pool[0]                                          # iter_1, labelled chosen_ok
    labels = {audit.pair_id(audited): audit.AuditLabel(audit.pair_id(audited), "chosen_ok")}
    pairs, _ = audit.apply_audit(pool, labels)
    kept, m = window(pairs, labels, 2)
    assert [x.source for x in kept] == ["iter_1", "iter_4", "iter_5", "iter_4", "iter_5",
                                        "cold_start", "import"]
    assert m["rm/n_pool"] == 12 and m["rm/n_aged_out"] == 5 and m["rm/window_oldest"] == 4
    assert window(pairs, labels, 0)[0] == pairs                # 0: every pair
