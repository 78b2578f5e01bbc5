"""Smoke tests of the evaluate stage on the loop's workspace (tests/stage_loop.py): its metrics
against the samples it stores, the best-of-N baseline, the reward model's paired scoring of the
policy's and the reference's responses, and the red-team set with the gate's check on it."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from stage_loop import Workspace, run
from tasks.config.params import load_params
from tasks.core import layout
from tasks.models import lm


@pytest.fixture(scope="module")
def ws(stage_loop: Workspace) -> Workspace:
    """One iteration of the whole loop, every stage's main() called in DAG order (the session's
    one run, shared by the per-stage smoke tests)."""
    return stage_loop


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
