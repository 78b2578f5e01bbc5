"""Reusing earlier samples (tasks/policy/pair_reuse.py, tasks/functional/offpolicy.py): the
pair importance weights, ESS and the staleness rule on hand-computed values, the pair records'
sampler log-probs, and the replay PPO keeps for N versions back.

Tolerances: values computed in float64 from a few numbers are compared with abs=1e-12 (the
arithmetic is exact up to rounding); log-probs computed by a model's forward pass against the
same model's own log-probs with abs=1e-5 (one fp32 forward against another, different shapes).
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import transformers

from tasks.config.params import lineage, parse_params, sampler_of
from tasks.core.jsonl import DataError
from tasks.data.records import (
    Message,
    PreferencePair,
    Rollout,
    Sampled,
    parse_pair,
    with_sampler_logprobs,
)
from tasks.functional.offpolicy import mean_log_ratio, pair_is_weights, weight_metrics
from tasks.policy import pair_reuse
from tasks.policy.ppo import replay_for_next, reuse_window
from tasks.reward.features import EncodedPair
from tasks.schemas.update import DPOParams, PPOParams, ReuseParams
from tasks.stages.update import staleness_of

TOL = 1e-12


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


# --- the weights ------------------------------------------------------------------------------

def test_mean_log_ratio_is_the_per_token_mean_over_the_mask() -> None:
    logp = t(-1.0, -2.0, -0.5, -1.0, -3.0, 0.0).reshape(2, 3)
    beh = t(-1.5, -1.0, -0.6, -1.2, -9.0, -9.0).reshape(2, 3)
    mask = t(1, 1, 1, 1, 0, 0).reshape(2, 3)
    # row 1: (0.5 - 1.0 + 0.1) / 3 = -0.4 / 3; row 2: one token, 0.2 (the rest is off the mask)
    assert mean_log_ratio(logp, beh, mask).tolist() == pytest.approx([-0.4 / 3, 0.2], abs=TOL)


def test_pair_weight_is_the_truncated_product_of_the_sides_ratios() -> None:
    lbar_c, lbar_r = t(0.2, 0.5, -1.0), t(0.3, 0.4, -1.0)
    w, raw = pair_is_weights(lbar_c, lbar_r, 2.0)
    # exp(0.5) = 1.6487 (inside), exp(0.9) = 2.4596 (truncated to c = 2), exp(-2) = 0.1353
    assert raw.tolist() == pytest.approx([math.exp(0.5), math.exp(0.9), math.exp(-2.0)], abs=TOL)
    assert w.tolist() == pytest.approx([math.exp(0.5), 2.0, math.exp(-2.0)], abs=TOL)


def test_weight_metrics_overall_and_per_origin() -> None:
    w, raw = t(2.0, 1.0, 0.5, 1.0), t(3.0, 1.0, 0.5, 1.0)
    m = weight_metrics(w, raw, [1, 1, 2, 2], 0.0, 2.0, "x")
    # all: (2 + 1 + 0.5 + 1)^2 / (4 + 1 + 0.25 + 1) = 20.25 / 6.25 = 3.24
    assert m["x_ess"] == pytest.approx(3.24, abs=TOL)
    assert m["x_ess_frac"] == pytest.approx(3.24 / 4, abs=TOL)
    assert m["x_truncated_frac"] == 0.25 and m["x_n"] == 4.0
    assert m["x_weight_mean"] == pytest.approx(4.5 / 4, abs=TOL)
    # iteration 1: (2 + 1)^2 / (4 + 1) = 1.8; iteration 2: 1.5^2 / 1.25 = 1.8 as well
    assert m["x/iter_1/ess"] == pytest.approx(1.8, abs=TOL)
    assert m["x/iter_1/truncated_frac"] == 0.5
    assert m["x/iter_2/ess"] == pytest.approx(1.8, abs=TOL)
    assert m["x/iter_2/ess_frac"] == pytest.approx(0.9, abs=TOL)
    assert m["x/iter_2/truncated_frac"] == 0.0


def test_is_weights_with_the_fallback_for_pairs_without_sampler_logprobs() -> None:
    d = DPOParams(offpolicy_weighting="is", is_truncate=2.0, offpolicy_weight=0.5)
    lbar_c, lbar_r = t(0.2, 0.5, 0.0), t(0.3, 0.4, 0.0)
    w, m = pair_reuse.pair_weights(lbar_c, lbar_r, [True, True, False], [1, 2, 0], [1, 0, 1], d)
    # e^0.5 = 1.6487; e^0.9 truncated to 2; the third (imported) at offpolicy_weight 0.5
    assert w.tolist() == pytest.approx([math.exp(0.5), 2.0, 0.5], abs=TOL)
    ess = (math.exp(0.5) + 2.0) ** 2 / (math.exp(1.0) + 4.0)          # 13.31 / 6.718 = 1.9812
    assert m["update/offpolicy_ess"] == pytest.approx(ess, abs=TOL)
    assert m["update/offpolicy_ess_frac"] == pytest.approx(ess / 2, abs=TOL)
    assert m["update/offpolicy_truncated_frac"] == 0.5
    assert m["update/offpolicy/iter_1/ess"] == pytest.approx(1.0, abs=TOL)
    assert m["update/offpolicy/iter_2/truncated_frac"] == 1.0
    assert "update/offpolicy/iter_0/ess" not in m                     # no weighted pair there
    assert m["update/offpolicy_fallback_n"] == 1.0
    assert m["update/offpolicy_staleness_mean"] == pytest.approx(2 / 3, abs=TOL)


def test_fixed_weighting_is_offpolicy_weight_for_every_pair() -> None:
    d = DPOParams(offpolicy_weight=0.7)                               # the default: fixed
    w, m = pair_reuse.pair_weights(t(5.0, -5.0), t(5.0, -5.0), [True, True], [1, 1], [1, 1], d)
    assert w.tolist() == [0.7, 0.7]
    assert set(m) == {"update/offpolicy_staleness_mean"}


@pytest.fixture()
def policy() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=24, hidden_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2,
                                   intermediate_size=32, max_position_embeddings=32,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_start_log_ratios_against_the_policys_own_and_shifted_logprobs(
        policy: torch.nn.Module) -> None:
    from tasks.models import lm
    enc = [EncodedPair((3, 4), (5, 6, 1), (7, 1)), EncodedPair((8,), (9,), (10, 11, 12, 1))]
    own = []
    for e in enc:
        lp_c, _ = lm.response_logprobs(policy, [e.prompt_ids], [e.chosen_ids], 0)
        lp_r, _ = lm.response_logprobs(policy, [e.prompt_ids], [e.rejected_ids], 0)
        own.append((lp_c[0].tolist(), lp_r[0].tolist()))
    c, r = pair_reuse.start_log_ratios(policy, enc, own, 0, 1, "fp32")
    assert c.tolist() == pytest.approx([0.0, 0.0], abs=1e-5)          # pi = mu: ratio 1
    assert r.tolist() == pytest.approx([0.0, 0.0], abs=1e-5)
    # a sampler 0.3 nats less likely per chosen token, 0.1 more per rejected one
    shifted = [([x - 0.3 for x in a], [x + 0.1 for x in b]) for a, b in own]
    c, r = pair_reuse.start_log_ratios(policy, enc, shifted, 0, 2, "fp32")
    assert c.tolist() == pytest.approx([0.3, 0.3], abs=1e-5)
    assert r.tolist() == pytest.approx([-0.1, -0.1], abs=1e-5)


# --- staleness --------------------------------------------------------------------------------

BRANCHED = ('iterations:\n  "1": {prev: 0}\n  "2": {prev: 1}\n  "3": {prev: 1}\n'
            '  "4": {prev: 3}\n')


def test_lineage_and_staleness_follow_the_prev_chain() -> None:
    p = parse_params(BRANCHED)              # iteration 2 refused: 3 continued from 1
    assert lineage(p, 4) == [3, 1, 0] and lineage(p, 1) == [0]
    assert [sampler_of(p, k) for k in (0, 1, 2, 3, 4)] == [0, 0, 1, 1, 3]
    age = staleness_of(p, 4)                # update@4 starts from policy 3
    # rollout@4 was drawn by policy 3 (0 back), @3 and @2 by policy 1 (1 back), @1 and the
    # cold start by policy 0 (2 back)
    assert [age(k) for k in (4, 3, 2, 1, 0)] == [0, 1, 1, 2, 2]
    linear = parse_params('iterations:\n  "1": {prev: 0}\n  "2": {prev: 1}\n  "3": {prev: 2}\n')
    assert [staleness_of(linear, 3)(k) for k in (3, 2, 1, 0)] == [0, 1, 2, 2]


def test_max_staleness_drops_older_pairs_and_zero_keeps_all() -> None:
    assert pair_reuse.fresh([0, 1, 2, 3], 2) == [True, True, True, False]
    assert pair_reuse.fresh([0, 1, 2, 3], 0) == [True] * 4


def _pair(meta: dict[str, Any]) -> PreferencePair:
    return PreferencePair((Message("user", "q"),), "a", "b", "iter_1", meta)


def test_origin_of_a_pool_pair() -> None:
    assert pair_reuse.origin_of(_pair({"iteration": 3}), "pool.jsonl:4") == 3
    assert pair_reuse.origin_of(_pair({}), "pool.jsonl:4") == 0          # imported
    with pytest.raises(DataError, match=r"^pool.jsonl:4: field 'meta.iteration' must be a "
                                        r"non-negative integer, got 'x'$"):
        pair_reuse.origin_of(_pair({"iteration": "x"}), "pool.jsonl:4")


def test_a_book_pair_reports_under_its_source_workspace_iteration() -> None:
    book = {"iteration": 0, "book": {"workspace": "/w/a", "iteration": 3}}
    assert pair_reuse.origin_label(_pair(book), 0) == "book_iter_3"
    assert pair_reuse.origin_label(_pair({"iteration": 2}), 2) == 2
    assert pair_reuse.origin_label(_pair({"book": {"iteration": True}}), 0) == 0   # not an int
    w, raw = t(2.0, 1.0, 0.5), t(3.0, 1.0, 0.5)
    m = weight_metrics(w, raw, ["book_iter_3", "book_iter_3", 1], 0.0, 2.0, "x")
    # book iteration 3: (2 + 1)^2 / (4 + 1) = 1.8, half truncated; iteration 1: one pair
    assert m["x/book_iter_3/ess"] == pytest.approx(1.8, abs=TOL)
    assert m["x/book_iter_3/truncated_frac"] == 0.5
    assert m["x/iter_1/n"] == 1.0 and m["x_n"] == 3.0


def test_an_offline_iteration_takes_the_loops_dpo_pairs_first_then_draws_by_the_seed() -> None:
    dpo = [True, False, False, True, False, True, False, False, False, False]   # 0, 3, 5

    def draw(n: int, seed: int = 0) -> list[int]:
        return pair_reuse.offline_indices(dpo, n, torch.Generator().manual_seed(seed))
    assert draw(0) == list(range(10)) and draw(10) == draw(25) == list(range(10))
    five = draw(5)                                   # the three DPO pairs and two others
    assert {0, 3, 5} <= set(five) and len(set(five)) == 5 and five == sorted(five)
    assert draw(5) == five                           # the same seed, the same pairs
    assert any(draw(5, s) != five for s in range(1, 6))
    two = draw(2)                                    # fewer than the DPO pairs: two of them
    assert len(two) == 2 and set(two) <= {0, 3, 5}
    assert pair_reuse.is_dpo_pair(_pair({"pair_rank": 0}))
    assert not pair_reuse.is_dpo_pair(_pair({"pair_rank": -1}))
    assert not pair_reuse.is_dpo_pair(_pair({}))                    # imported: no rank


OFFLINE = 'iterations:\n  "1": {prev: 0}\n  "2": {prev: 1}\nrollout:\n  offline: [1]\n'


def test_offline_iterations_are_checked_against_the_iterations_and_the_algorithm() -> None:
    from tasks.config import conditions
    from tasks.core.errors import InputError
    p = parse_params(OFFLINE)
    assert p.rollout.offline == (1,) and p.update.dpo.offline_pairs == 0
    assert conditions.holds("update_reads_pair_pool", p)      # offpolicy_mix is 0
    with pytest.raises(InputError, match=r"rollout\.offline.*3 is not an iteration"):
        parse_params(OFFLINE.replace("[1]", "[3]"))
    with pytest.raises(InputError, match=r"rollout\.offline.*only DPO reads; update\.algo is "
                                         r"ppo"):
        parse_params(OFFLINE + "update:\n  algo: ppo\n")
    with pytest.raises(InputError, match=r"offline_pairs.*must be >= 0"):
        parse_params(OFFLINE + "update:\n  dpo:\n    offline_pairs: -1\n")


# --- sampler log-probs in pair records --------------------------------------------------------

REC = {"prompt": "q", "chosen": "a", "rejected": "b", "chosen_ids": [5, 1],
       "rejected_ids": [6, 7, 1], "chosen_finished": True, "rejected_finished": True}


def test_pair_records_carry_and_check_sampler_logprobs() -> None:
    rec = {**REC, "chosen_logprobs": [-0.5, -0.25], "rejected_logprobs": [-1.0, -2.0, 0.0]}
    pair = parse_pair(rec, "p.jsonl", 3, "x")
    assert pair.tokens("a") == Sampled((5, 1), True, (-0.5, -0.25))
    assert pair.to_record()["rejected_logprobs"] == [-1.0, -2.0, 0.0]
    assert "chosen_logprobs" not in parse_pair(REC, "p.jsonl", 3, "x").to_record()
    enc = EncodedPair((9,), (5,), (6, 7))                             # cut to fit max_length
    assert pair_reuse.behaviour_logprobs(pair, enc) == ((-0.5,), (-1.0, -2.0))
    assert pair_reuse.behaviour_logprobs(parse_pair(REC, "p.jsonl", 3, "x"), enc) is None


@pytest.mark.parametrize("extra, message", [
    ({"chosen_logprobs": [-0.5, -0.25]}, "field 'rejected_logprobs' missing"),
    ({"chosen_logprobs": [-0.5], "rejected_logprobs": [-1.0, -2.0, 0.0]},
     "field 'chosen_logprobs' has 1 entries for 2 sampled ids"),
    ({"chosen_logprobs": [-0.5, 0.5], "rejected_logprobs": [-1.0, -2.0, 0.0]},
     "field 'chosen_logprobs' must be a list of finite log-probs"),
])
def test_bad_sampler_logprobs_name_file_line_and_field(extra: dict[str, Any],
                                                        message: str) -> None:
    with pytest.raises(DataError, match=r"^p\.jsonl:3: " + message):
        parse_pair({**REC, **extra}, "p.jsonl", 3, "x")


def _rollout(pid: str, ids: tuple[int, ...], lps: tuple[float, ...], it: int = 1) -> Rollout:
    return Rollout(pid, (Message("user", "q"),), (3,), ids, lps, True, "t", "md5", it)


def test_with_sampler_logprobs_matches_rollouts_by_prompt_and_ids() -> None:
    pair = PreferencePair((Message("user", "q"),), "a", "b", "iter_1", {"prompt_id": "p1"},
                          {"a": Sampled((5, 1), True), "b": Sampled((6, 1), True)})
    rollouts = [_rollout("p1", (5, 1), (-0.1, -0.2)), _rollout("p2", (6, 1), (-9.0, -9.0)),
                _rollout("p1", (6, 1), (-0.3, -0.4))]
    (out,) = with_sampler_logprobs([pair], rollouts)
    assert out.tokens("a") == Sampled((5, 1), True, (-0.1, -0.2))
    assert out.tokens("b") == Sampled((6, 1), True, (-0.3, -0.4))     # p1's, not p2's


# --- PPO's replay: N versions back ------------------------------------------------------------

def test_replay_keeps_what_the_next_update_may_still_reuse() -> None:
    p = PPOParams(reuse=ReuseParams(iterations_back=2, max_staleness=2))
    assert reuse_window(p) == 2
    fresh = [_rollout("a", (5,), (-1.0,), it=3)]
    reused = [_rollout("b", (6,), (-1.0,), it=2), _rollout("c", (7,), (-1.0,), it=1)]
    age = lambda k: 3 - k                     # update@3 on a linear lineage: @2 1 back, @1 2 back
    kept = replay_for_next(fresh, reused, p, age)
    # at update@4: @3 is 1 back, @2 2 back (kept), @1 3 back (beyond 2: left out)
    assert [r.iteration for r in kept] == [3, 2]
    one = PPOParams(reuse=ReuseParams(iterations_back=1, max_staleness=1))
    assert [r.iteration for r in replay_for_next(fresh, reused, one, age)] == [3]
