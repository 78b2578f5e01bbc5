"""Stage `evaluate`: the iteration's policy against the reference on held-out prompts.

Reported: win rate by the judge and by the reward model (ties half, 95% bootstrap interval,
counts, tie and invalid rates), mean judge score of both, KL(policy || reference) per response,
and response lengths. One metrics JSON per iteration plus the paired samples.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tasks import jsonl, layout, lm, stage
from tasks.judges import PointwiseJudge, Verdict, judge_pair, make_judge
from tasks.jsonl import DataError
from tasks.params import MonitorParams
from tasks.records import Rollout, parse_rollout, prompt_to_record
from tasks.reward_model import load_reward_model, reward_mean_std, rewards
from tasks.rollout import load_prompts, sample_rollouts
from tasks.winrate import win_rate


@torch.no_grad()
def kl_per_response(policy: torch.nn.Module, ref: torch.nn.Module,
                    samples: Sequence[Rollout], pad_id: int) -> float:
    """Monte-Carlo KL(pi || ref): mean over policy samples of sum_t log pi - log ref."""
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    pi, mask = lm.response_logprobs(policy, prompts, responses, pad_id)
    ref_lp, _ = lm.response_logprobs(ref, prompts, responses, pad_id)
    return float(((pi - ref_lp) * mask).sum(-1).mean())


def rm_verdicts(r_policy: torch.Tensor, r_ref: torch.Tensor) -> list[Verdict]:
    return ["A" if a > b else "B" if b > a else "tie" for a, b in zip(r_policy.tolist(),
                                                                        r_ref.tolist())]


def rm_disagreement(rm: torch.nn.Module, pol: Sequence[Rollout], refs: Sequence[Rollout],
                    pad_id: int) -> dict[str, float]:
    """Mean over samples of the RM ensemble's std of r(x, y) (0 for a single RM): on the
    policy's samples, and on the reference's for comparison (policy >> reference: the policy
    has moved where the reward model is unsure)."""
    _, sd_pol = reward_mean_std(rm, [s.prompt_ids for s in pol], [s.response_ids for s in pol],
                                pad_id)
    _, sd_ref = reward_mean_std(rm, [s.prompt_ids for s in refs],
                                [s.response_ids for s in refs], pad_id)
    return {"eval/rm_disagreement": float(sd_pol.mean()),
            "eval/rm_disagreement_ref": float(sd_ref.mean())}


def compare(judge: PointwiseJudge, pol: Sequence[Rollout], ref: Sequence[Rollout],
            n_boot: int, seed: int) -> tuple[dict[str, float], list[Verdict]]:
    verdicts = [judge_pair(judge, a.prompt, a.text, b.text) for a, b in zip(pol, ref)]
    wr = win_rate(verdicts, n_boot, seed)
    s_pol = [x for x in judge.score([s.prompt for s in pol], [s.text for s in pol]) if x is not None]
    s_ref = [x for x in judge.score([s.prompt for s in ref], [s.text for s in ref]) if x is not None]
    metrics = {
        "eval/win_rate": wr["win_rate"], "eval/win_rate_ci_low": wr["ci_low"],
        "eval/win_rate_ci_high": wr["ci_high"], "eval/n": wr["n"],
        "eval/tie_rate": wr["rate_tie"], "eval/invalid_rate": wr["rate_invalid"],
        "eval/judge_score": sum(s_pol) / max(len(s_pol), 1),
        "eval/ref_judge_score": sum(s_ref) / max(len(s_ref), 1),
    }
    return metrics, verdicts


def hacking_flags(metrics: dict[str, float], p: MonitorParams) -> dict[str, float]:
    """Reward-hacking monitors, measured not assumed: length drift against the reference, and
    RM-ensemble disagreement on policy samples against that on reference samples (the policy
    leaving the region where the reward model can be trusted). 1.0 = flagged."""
    drift = abs(metrics["eval/length_ratio"] - 1.0)
    ratio = metrics.get("eval/rm_disagreement", 0.0) / max(
        metrics.get("eval/rm_disagreement_ref", 0.0), 1e-9)
    flags = {"eval/length_drift": drift, "eval/rm_disagreement_ratio": ratio,
             "eval/flag_length_drift": float(drift > p.max_length_drift),
             "eval/flag_rm_disagreement": float(metrics.get("eval/rm_disagreement", 0.0) > 0
                                                and ratio > p.max_rm_disagreement_ratio)}
    flags["eval/hacking_flag"] = max(flags["eval/flag_length_drift"],
                                     flags["eval/flag_rm_disagreement"])
    return flags


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "")
    p, it, root = args.params, args.it, args.root
    pol_dir, ref_dir = root / layout.policy(it), root / layout.policy(0)
    policy, ref = lm.load_causal_lm(pol_dir), lm.load_causal_lm(ref_dir)
    tok = lm.load_tokenizer(pol_dir)
    prompts = load_prompts(str(root / layout.PROMPTS_HELDOUT), p.evaluate.n_prompts)
    gen, mpt = p.evaluate.generation, p.model.max_prompt_tokens
    pol = sample_rollouts(policy, tok, prompts, 1, gen, mpt, lm.weights_md5(pol_dir), it,
                          stage.generator(p.seed, 4, it))
    ref_path = str(root / layout.REFERENCE_SAMPLES)
    refs = [parse_rollout(rec, ref_path, n) for n, rec in jsonl.read(ref_path)]
    if [r.prompt_id for r in refs] != [pid for pid, _ in prompts]:
        raise DataError(f"{ref_path}: reference samples are for other prompts than "
                        f"{layout.PROMPTS_HELDOUT}; rerun reference_samples")
    metrics, verdicts = compare(make_judge(p.judge), pol, refs, p.evaluate.bootstrap, p.seed)
    rm = load_reward_model(root / layout.reward_model(it))
    with torch.no_grad():
        r_pol, r_ref = (rewards(rm, [s.prompt_ids for s in x], [s.response_ids for s in x],
                                tok.pad_token_id) for x in (pol, refs))
    rm_wr = win_rate(rm_verdicts(r_pol, r_ref), p.evaluate.bootstrap, p.seed)
    metrics.update(rm_disagreement(rm, pol, refs, tok.pad_token_id))
    len_pol = sum(len(s.response_ids) for s in pol) / len(pol)
    len_ref = sum(len(s.response_ids) for s in refs) / len(refs)
    metrics.update({
        "eval/rm_win_rate": rm_wr["win_rate"], "eval/rm_win_rate_ci_low": rm_wr["ci_low"],
        "eval/rm_win_rate_ci_high": rm_wr["ci_high"],
        "eval/kl": kl_per_response(policy, ref, pol, tok.pad_token_id),
        "eval/length": len_pol, "eval/ref_length": len_ref,
        "eval/length_ratio": len_pol / max(len_ref, 1e-9),
    })
    metrics.update(hacking_flags(metrics, p.evaluate.monitors))
    jsonl.write(root / layout.eval_samples(it), (
        {"prompt_id": a.prompt_id, "prompt": prompt_to_record(a.prompt), "policy": a.text,
         "reference": b.text, "judge_verdict": v, "rm_policy": float(x), "rm_reference": float(y)}
        for a, b, v, x, y in zip(pol, refs, verdicts, r_pol.tolist(), r_ref.tolist())))
    stage.write_metrics(root, layout.metrics(it, "evaluate"), metrics)
    print(f"evaluate@{it}: win rate {metrics['eval/win_rate']:.3f} "
          f"[{metrics['eval/win_rate_ci_low']:.3f}, {metrics['eval/win_rate_ci_high']:.3f}], "
          f"KL {metrics['eval/kl']:.3f}")


if __name__ == "__main__":
    stage.run_main(lambda: main())
