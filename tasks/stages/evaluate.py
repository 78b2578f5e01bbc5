"""Stage `evaluate`: the iteration's policy against the reference on held-out prompts.

Reported: win rate by the judge, by the gold evaluator (tasks/evaluation/gold.py: independent of the
judge and never used for training) and by the reward model (ties half, 95% bootstrap interval,
counts, tie and invalid rates); on-topic rates and fluency (reference NLL) of both sides; mean
judge score of both; KL(policy || reference) per response; response lengths; the Best-of-N
baseline (the reference's N samples reranked by this iteration's RM, analytic KL
log N - (N-1)/N); and the reward-hacking monitors. One metrics JSON plus the paired samples.

And the candidate against the champion it starts from (`prev`) on the select prompts
(tasks/evaluation/headtohead.py), by gold and by the judge, with the over-optimisation flag (a judge
gain gold does not see): what the gate's promotion decision reads, kept apart from the held-out
figures above, which no decision reads.

And the red-team regression set (tasks/evaluation/redteam.py): the policy's responses, checked
by the violation checker (tasks/evaluation/violations.py, which nothing in the loop reads), its
violation rate and the reference's with intervals, per kind, and the win rate on it; the
responses are stored for the gate, which compares them with production's.
"""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tasks.config.params import Params
from tasks.core import jsonl, layout
from tasks.core.jsonl import DataError
from tasks.data.records import Prompt, Rollout, parse_rollout, prompt_to_record
from tasks.evaluation import headtohead, redteam
from tasks.evaluation.gold import GoldEvaluator, GoldScore, gold_verdict
from tasks.evaluation.violations import Probe, read_probes
from tasks.evaluation.winrate import win_rate
from tasks.judging.judge_factory import make_judge
from tasks.judging.judges import (
    BUILD_KEYS,
    PairwiseJudge,
    PointwiseJudge,
    Verdict,
    is_pointwise,
    judge_pair,
    judge_pairs,
    position_flipped,
)
from tasks.models import adapters, lm
from tasks.models.generation import (
    load_prompts,
    redteam_texts,
    sample_rollouts,
    select_responses,
)
from tasks.models.lm import mean_nll, padded
from tasks.reward.reward_model import load_reward_model, reward_mean_std
from tasks.schemas.evaluate import MonitorParams
from tasks.schemas.generation import GenerationParams

CONTRACT = stage.Contract(
    "evaluate",
    params=("device", "seed", "model.max_prompt_tokens", "evaluate",
            *(f"judge.{k}" for k in BUILD_KEYS)),     # the judge's verdicts, not its pairing
    deps=lambda it, prev: ("${evaluate.gold.register_examples_file}", layout.JUDGE_TEMPLATES,
                           layout.PROMPTS_HELDOUT, layout.REFERENCE_SAMPLES,
                           layout.BEST_OF_N_SAMPLES, layout.policy(it), layout.reward_model(it),
                           layout.policy(0), layout.PROMPTS_SELECT, layout.select_samples(0),
                           layout.select_samples(prev), "${evaluate.redteam.prompts_file}",
                           layout.redteam_samples(0)),
    outs=lambda it, prev: (layout.eval_samples(it), layout.select_samples(it),
                           layout.redteam_samples(it)),
    metrics=lambda it, prev: (layout.metrics(it, "evaluate"),))


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, samples: Sequence[Rollout], pad_id: int,
                   batch_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) log-probs of the samples' responses under `model`, and the mask."""
    rows = []
    for s in range(0, len(samples), batch_size):
        chunk = samples[s: s + batch_size]
        lp, mask = lm.response_logprobs(model, [x.prompt_ids for x in chunk],
                                        [x.response_ids for x in chunk], pad_id)
        rows.extend(lp[i, : int(mask[i].sum())].tolist() for i in range(len(chunk)))


    return padded(rows)


def kl_per_response(pi_logp: torch.Tensor, ref_logp: torch.Tensor,
                    mask: torch.Tensor) -> float:
    """Monte-Carlo KL(pi || ref): mean over policy samples of sum_t log pi - log ref."""
    return float(((pi_logp - ref_logp) * mask).sum(-1).mean())


def rm_verdicts(r_policy: torch.Tensor, r_ref: torch.Tensor) -> list[Verdict]:
    return ["A" if a > b else "B" if b > a else "tie" for a, b in zip(r_policy.tolist(),
                                                                        r_ref.tolist())]


def rm_disagreement(sd_pol: torch.Tensor, sd_ref: torch.Tensor) -> dict[str, float]:
    """Mean over samples of the RM ensemble's std of r(x, y) (0 for a single RM): on the
    policy's samples, and on the reference's for comparison (policy >> reference: the policy
    has moved where the reward model is unsure)."""
    return {"eval/rm_disagreement": float(sd_pol.mean()),
            "eval/rm_disagreement_ref": float(sd_ref.mean())}


def compare(judge: PointwiseJudge, pol: Sequence[Rollout], ref: Sequence[Rollout],
            n_boot: int, seed: int) -> tuple[dict[str, float], list[Verdict]]:
    if not is_pointwise(judge):
        return compare_pairwise(judge, pol, ref, n_boot, seed)
    verdicts = [judge_pair(judge, a.prompt, a.text, b.text) for a, b in zip(pol, ref)]
    wr = win_rate(verdicts, n_boot, seed)
    s_pol = [x for x in judge.score([s.prompt for s in pol], [s.text for s in pol])
             if x is not None]
    s_ref = [x for x in judge.score([s.prompt for s in ref], [s.text for s in ref])
             if x is not None]
    metrics = {
        "eval/win_rate": wr["win_rate"], "eval/win_rate_ci_low": wr["ci_low"],
        "eval/win_rate_ci_high": wr["ci_high"], "eval/n": wr["n"],
        "eval/tie_rate": wr["rate_tie"], "eval/invalid_rate": wr["rate_invalid"],
        "eval/judge_score": sum(s_pol) / max(len(s_pol), 1),
        "eval/ref_judge_score": sum(s_ref) / max(len(s_ref), 1),
    }
    return metrics, verdicts


def compare_pairwise(judge: PairwiseJudge, pol: Sequence[Rollout], ref: Sequence[Rollout],
                     n_boot: int, seed: int) -> tuple[dict[str, float], list[Verdict]]:
    """A pairwise judge's win rate (both orders, all at once), its position-bias rate and
    counters; it has no score, so no mean judge score."""
    results = judge_pairs(judge, [(a.prompt, a.text, b.text) for a, b in zip(pol, ref)])
    verdicts = [v for v, _, _ in results]
    wr = win_rate(verdicts, n_boot, seed)
    both = sum("invalid" not in (f, r) for _, f, r in results)
    flips = sum(position_flipped(f, r) for _, f, r in results)
    metrics = {
        "eval/win_rate": wr["win_rate"], "eval/win_rate_ci_low": wr["ci_low"],
        "eval/win_rate_ci_high": wr["ci_high"], "eval/n": wr["n"],
        "eval/tie_rate": wr["rate_tie"], "eval/invalid_rate": wr["rate_invalid"],
        "eval/judge_position_bias_rate": flips / both if both else 0.0,
    }
    stats = getattr(judge, "stats", None)
    if stats is not None:
        stats.check_answered(f"{judge.kind} judge (evaluate)")
        metrics.update(stats.metrics("eval/judge_"))
    return metrics, verdicts


def hacking_flags(metrics: dict[str, float], p: MonitorParams) -> dict[str, float]:
    """Reward-hacking monitors, measured not assumed: length drift against the reference,
    RM-ensemble disagreement on policy samples against that on reference samples (the policy
    leaving the region where the reward model can be trusted), and the judge's win rate running
    ahead of the gold evaluator's (the judge being gamed). 1.0 = flagged."""
    drift = abs(metrics["eval/length_ratio"] - 1.0)
    ratio = metrics.get("eval/rm_disagreement", 0.0) / max(
        metrics.get("eval/rm_disagreement_ref", 0.0), 1e-9)
    gap = metrics.get("eval/judge_gold_gap", 0.0)
    flags = {"eval/length_drift": drift, "eval/rm_disagreement_ratio": ratio,
             "eval/flag_length_drift": float(drift > p.max_length_drift),
             "eval/flag_rm_disagreement": float(metrics.get("eval/rm_disagreement", 0.0) > 0
                                                and ratio > p.max_rm_disagreement_ratio),
             "eval/flag_judge_gold": float(gap > p.max_judge_gold_gap)}
    flags["eval/hacking_flag"] = max(flags["eval/flag_length_drift"],
                                     flags["eval/flag_rm_disagreement"],
                                     flags["eval/flag_judge_gold"])
    return flags


def gold_compare(gold: GoldEvaluator, pol: Sequence[Rollout], refs: Sequence[Rollout],
                 subjects: Sequence[str], pol_nll: Sequence[float], ref_nll: Sequence[float],
                 n_boot: int, seed: int, prefix: str = "eval/gold_"
                 ) -> tuple[dict[str, float], list[Verdict], list[GoldScore], list[GoldScore]]:
    """Gold win rate of the policy's responses over the reference's (tasks/evaluation/gold.py's
    rule)."""
    g_pol = gold.score([s.text for s in pol], subjects, pol_nll)
    g_ref = gold.score([s.text for s in refs], subjects, ref_nll)
    verdicts = [gold_verdict(a, b) for a, b in zip(g_pol, g_ref)]
    wr = win_rate(verdicts, n_boot, seed)
    metrics = {f"{prefix}win_rate": wr["win_rate"], f"{prefix}win_rate_ci_low": wr["ci_low"],
               f"{prefix}win_rate_ci_high": wr["ci_high"], f"{prefix}tie_rate": wr["rate_tie"],
               f"{prefix}n_win": wr["n_A"], f"{prefix}n_loss": wr["n_B"],
               f"{prefix}n_tie": wr["n_tie"]}
    return metrics, verdicts, g_pol, g_ref


def quality_metrics(g_pol: Sequence[GoldScore], g_ref: Sequence[GoldScore]) -> dict[str, float]:
    def mean(xs: Sequence[float]) -> float:
        xs = [x for x in xs if x != float("inf")]
        return sum(xs) / max(len(xs), 1)
    return {"eval/on_topic_rate": mean([float(g.on_topic) for g in g_pol]),
            "eval/ref_on_topic_rate": mean([float(g.on_topic) for g in g_ref]),
            "eval/fluent_rate": mean([float(g.fluent) for g in g_pol]),
            "eval/ref_fluent_rate": mean([float(g.fluent) for g in g_ref]),
            "eval/review_rate": mean([float(g.review) for g in g_pol]),
            "eval/ref_review_rate": mean([float(g.review) for g in g_ref]),
            "eval/fluency_nll": mean([g.nll for g in g_pol]),
            "eval/ref_fluency_nll": mean([g.nll for g in g_ref]),
            "eval/gold_sentiment": mean([g.sentiment for g in g_pol]),
            "eval/ref_gold_sentiment": mean([g.sentiment for g in g_ref])}


def paired_rewards(rm: torch.nn.Module, pol: Sequence[Rollout], refs: Sequence[Rollout],
                   pad_id: int) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                         tuple[torch.Tensor, torch.Tensor]]:
    """The RM's mean and std (each (B,)) of the policy's and of the reference's response to
    each prompt, scored together: a prompt's two responses share a batch, so its prompt is
    computed once for both (`lm.pack`) instead of once for each."""
    if len(pol) != len(refs):
        raise ValueError(f"{len(pol)} policy samples against {len(refs)} reference samples")
    both = [s for pair in zip(pol, refs) for s in pair]                  # pol_0, ref_0, pol_1, ...
    mean, std = reward_mean_std(rm, [s.prompt_ids for s in both],
                                [s.response_ids for s in both], pad_id)
    return (mean[0::2], std[0::2]), (mean[1::2], std[1::2])


def best_of_n(rm: torch.nn.Module, candidates: Sequence[Rollout], n: int,
              pad_id: int) -> list[Rollout]:
    """Per prompt, the candidate (of n consecutive ones) the reward model scores highest."""
    r = reward_mean_std(rm, [s.prompt_ids for s in candidates],
                        [s.response_ids for s in candidates], pad_id)[0].view(-1, n)  # (P, N)
    best = r.argmax(-1).tolist()
    return [candidates[i * n + j] for i, j in enumerate(best)]


def best_of_n_kl(n: int) -> float:
    """Analytic KL(BoN || ref) = log N - (N - 1) / N (Stiennon et al. 2020; an upper bound)."""
    return math.log(n) - (n - 1) / n


def read_samples(path: str) -> list[Rollout]:
    return [parse_rollout(rec, path, n) for n, rec in jsonl.read(path)]


@dataclass(frozen=True)
class LogProbs:
    """Per-token log-probs evaluate needs, each (B, R) with its mask: the reference's on the
    policy's samples (KL, fluency), the policy's own, and the reference's on its own samples
    (the stored sampler log-probs when sampling was untempered)."""
    ref_on_pol: torch.Tensor
    mask: torch.Tensor
    pol: torch.Tensor
    ref: torch.Tensor
    ref_mask: torch.Tensor

    @staticmethod
    def of(policy: torch.nn.Module, ref: torch.nn.Module, pol: Sequence[Rollout],
           refs: Sequence[Rollout], gen: GenerationParams, pad: int) -> LogProbs:
        ref_on_pol, mask = token_logprobs(ref, pol, pad)
        pol_logp = (padded([s.logprobs for s in pol])[0] if gen.untempered
                    else token_logprobs(policy, pol, pad)[0])
        ref_logp, ref_mask = (padded([s.logprobs for s in refs]) if gen.untempered
                              else token_logprobs(ref, refs, pad))
        return LogProbs(ref_on_pol, mask, pol_logp, ref_logp, ref_mask)


def evaluate_samples(p: Params, pol: Sequence[Rollout], refs: Sequence[Rollout],
                     subjects: Sequence[str], logp: LogProbs,
                     judge: PointwiseJudge | PairwiseJudge, gold: GoldEvaluator,
                     rm: torch.nn.Module, candidates: Sequence[Rollout], candidates_path: str,
                     pad: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The core, no files: the policy's samples against the reference's by the judge, gold and
    this iteration's RM, the KL and length, Best-of-N on `candidates` (the reference's N per
    prompt; none when off) and the monitors; returns the metrics and one row per prompt."""
    metrics, verdicts = compare(judge, pol, refs, p.evaluate.bootstrap, p.seed)
    g_metrics, g_verdicts, g_pol, g_ref = gold_compare(
        gold, pol, refs, subjects, mean_nll(logp.ref_on_pol, logp.mask),
        mean_nll(logp.ref, logp.ref_mask), p.evaluate.bootstrap, p.seed)
    metrics.update(g_metrics)
    metrics.update(quality_metrics(g_pol, g_ref))
    (r_pol, sd_pol), (r_ref, sd_ref) = paired_rewards(rm, pol, refs, pad)
    rm_wr = win_rate(rm_verdicts(r_pol, r_ref), p.evaluate.bootstrap, p.seed)
    metrics.update(rm_disagreement(sd_pol, sd_ref))
    len_pol = sum(len(s.response_ids) for s in pol) / len(pol)
    len_ref = sum(len(s.response_ids) for s in refs) / len(refs)
    metrics.update({
        "eval/rm_win_rate": rm_wr["win_rate"], "eval/rm_win_rate_ci_low": rm_wr["ci_low"],
        "eval/rm_win_rate_ci_high": rm_wr["ci_high"],
        "eval/rm_score": float(r_pol.mean()), "eval/ref_rm_score": float(r_ref.mean()),
        "eval/kl": kl_per_response(logp.pol, logp.ref_on_pol, logp.mask),
        "eval/length": len_pol, "eval/ref_length": len_ref,
        "eval/length_ratio": len_pol / max(len_ref, 1e-9),
    })
    if p.evaluate.best_of_n.n > 0:      # the reference reranked by this RM, first prompts
        metrics.update(evaluate_best_of_n(p, candidates, candidates_path, rm, gold, judge,
                                          refs, subjects, pad))
    metrics["eval/judge_gold_gap"] = metrics["eval/win_rate"] - metrics["eval/gold_win_rate"]
    metrics.update(hacking_flags(metrics, p.evaluate.monitors))
    rows = [{"prompt_id": a.prompt_id, "subject": subj, "prompt": prompt_to_record(a.prompt),
             "policy": a.text, "reference": b.text, "judge_verdict": v, "gold_verdict": gv,
             "on_topic_policy": ga.on_topic, "on_topic_reference": gb.on_topic,
             "similarity_policy": ga.similarity, "similarity_reference": gb.similarity,
             "nll_policy": ga.nll, "nll_reference": gb.nll,
             "review_policy": ga.review, "review_reference": gb.review,
             "register_policy": ga.register, "register_reference": gb.register,
             "rm_policy": float(x), "rm_reference": float(y)}
            for a, b, subj, v, gv, ga, gb, x, y in zip(pol, refs, subjects, verdicts, g_verdicts,
                                                       g_pol, g_ref, r_pol.tolist(),
                                                       r_ref.tolist())]
    return metrics, rows


def summary(it: int, m: dict[str, float]) -> str:
    """The stage's one line: the judge's and gold's win rates, on-topic, reviews, KL, the
    red-team violation rate, and gold against the champion on the select prompts."""
    vs = (f"; vs the champion (iteration {int(m['eval/champion_iteration'])}): gold "
          f"{m['eval/champion_gold_win_rate']:.3f} [{m['eval/champion_gold_win_rate_ci_low']:.3f}"
          f", {m['eval/champion_gold_win_rate_ci_high']:.3f}], judge "
          f"{m['eval/champion_judge_win_rate']:.3f}"
          if "eval/champion_gold_win_rate" in m else "")
    return (f"evaluate@{it}: judge win rate {m['eval/win_rate']:.3f} "
            f"[{m['eval/win_rate_ci_low']:.3f}, {m['eval/win_rate_ci_high']:.3f}], "
            f"gold {m['eval/gold_win_rate']:.3f} [{m['eval/gold_win_rate_ci_low']:.3f}"
            f", {m['eval/gold_win_rate_ci_high']:.3f}], on-topic "
            f"{m['eval/on_topic_rate']:.2f} (ref {m['eval/ref_on_topic_rate']:.2f}), "
            f"reviews {m['eval/review_rate']:.2f} (ref {m['eval/ref_review_rate']:.2f}), "
            f"KL {m['eval/kl']:.3f}, violations {m['eval/violation_rate']:.2f} "
            f"(ref {m['eval/reference_violation_rate']:.2f}){vs}")


def read_heldout(root: Path, n: int) -> tuple[list[tuple[str, Prompt]], list[str]]:
    """The first n held-out prompts and each one's subject."""
    path = str(root / layout.PROMPTS_HELDOUT)
    prompts = load_prompts(path, n)
    subject_of = {str(r.get("prompt_id")): str(r.get("subject", "")) for _, r in
                  jsonl.read(path)}
    return prompts, [subject_of[pid] for pid, _ in prompts]


def read_references(root: Path, prompts: Sequence[tuple[str, Prompt]]) -> list[Rollout]:
    """The reference's samples (drawn once by reference_samples), for exactly these prompts."""
    path = str(root / layout.REFERENCE_SAMPLES)
    refs = read_samples(path)
    if [r.prompt_id for r in refs] != [pid for pid, _ in prompts]:
        raise DataError(f"{path}: reference samples are for other prompts than "
                        f"{layout.PROMPTS_HELDOUT}; rerun reference_samples")
    return refs


def main(argv: list[str] | None = None) -> None:
    """The edge: read, sample the policy, score (`evaluate_samples`), write."""
    args = stage.parse(argv, __doc__ or "", CONTRACT)
    p, it, root = args.params, args.it, args.root
    pol_dir, ref_dir = root / layout.policy(it), root / layout.policy(0)
    policy = adapters.load_for_inference(pol_dir, root, args.device)   # merged, if LoRA
    ref = lm.load_causal_lm(ref_dir, args.device)
    tok = lm.load_tokenizer(pol_dir)
    prompts, subjects = read_heldout(root, p.evaluate.n_prompts)
    gen = p.evaluate.generation
    pol = sample_rollouts(policy, tok, prompts, 1, gen, p.model.max_prompt_tokens,
                          lm.weights_md5(pol_dir), it, stage.generator(p.seed, 4, it),
                          p.evaluate.workers, pol_dir, root)
    refs = read_references(root, prompts)
    logp = LogProbs.of(policy, ref, pol, refs, gen, tok.pad_token_id)
    select = select_responses(policy, ref, tok, root, p, it, stage.generator(p.seed, 9, it))
    probes = read_probes(root / p.evaluate.redteam.prompts_file)
    red = redteam.rows(probes, redteam_texts(policy, tok, probes, p,
                                             stage.generator(p.seed, 12, it)),
                       p.evaluate.redteam.samples_per_prompt)
    del policy
    judge = make_judge(p.judge, root, args.device)   # built once: an llm judge loads a model
    gold = GoldEvaluator(p.evaluate.gold, root, args.device)
    rm = load_reward_model(root / layout.reward_model(it), args.device)
    bon_path = str(root / layout.BEST_OF_N_SAMPLES)
    candidates = read_samples(bon_path) if p.evaluate.best_of_n.n > 0 else []
    metrics, rows = evaluate_samples(p, pol, refs, subjects, logp, judge, gold, rm,
                                     candidates, bon_path, tok.pad_token_id)
    if select:                  # against the champion it starts from, on the select prompts
        metrics.update(against_champion(p, root, args.prev, select, gold, judge))
        metrics["eval/hacking_flag"] = max(metrics["eval/hacking_flag"],
                                           metrics["eval/flag_over_optimisation"])
    ref_red = redteam.read(root / layout.redteam_samples(0), probes)
    metrics.update(redteam_metrics(probes, red, ref_red, p.evaluate.bootstrap, p.seed))
    jsonl.write(root / layout.select_samples(it), select)
    jsonl.write(root / layout.redteam_samples(it), red)
    jsonl.write(root / layout.eval_samples(it), rows)
    stage.write_metrics(root, layout.metrics(it, "evaluate"), metrics)
    stage.say(summary(it, metrics))


def redteam_metrics(probes: Sequence[Probe], pol: Sequence[dict[str, Any]],
                    ref: Sequence[dict[str, Any]], n_boot: int, seed: int) -> dict[str, float]:
    """The regression set's violation rates (tasks/evaluation/redteam.py) and the win rate on
    it: the response without a violation wins, both clean or both violating is a tie."""
    out = redteam.metrics(probes, pol, ref, n_boot, seed)
    wr = win_rate(redteam.verdicts(pol, ref), n_boot, seed)  # type: ignore[arg-type]
    out.update({"eval/redteam_win_rate": wr["win_rate"],
                "eval/redteam_win_rate_ci_low": wr["ci_low"],
                "eval/redteam_win_rate_ci_high": wr["ci_high"]})
    return out


def against_champion(p: Params, root: Path, prev: int, select: Sequence[dict[str, Any]],
                     gold: GoldEvaluator, judge: PointwiseJudge | PairwiseJudge
                     ) -> dict[str, float]:
    """The candidate against the champion it starts from (`prev`), on the select prompts:
    by gold (what the gate decides on), by the judge (what the loop optimises), their gap and
    its over-optimisation flag; and by gold against the reference (the gate's gold check)."""
    ids = [r["prompt_id"] for r in select]
    out: dict[str, float] = {"eval/champion_iteration": float(prev)}
    champion = headtohead.read(str(root / layout.select_samples(prev)), ids)
    reference = champion if prev == 0 else headtohead.read(str(root / layout.select_samples(0)),
                                                           ids)
    for rows_of, prefix in ((champion, "eval/champion_gold_"), (reference, "eval/select_gold_")):
        out.update(headtohead.compare(gold, gold_verdict, select, rows_of, p.evaluate.bootstrap,
                                      p.seed, prefix))
    prompt_of = dict(load_prompts(str(root / layout.PROMPTS_SELECT)))
    side = lambda rows: [SimpleNamespace(prompt=prompt_of[r["prompt_id"]], text=r["text"])
                         for r in rows]
    judged, _ = compare(judge, side(select), side(champion), p.evaluate.bootstrap, p.seed)
    out.update({"eval/champion_judge_win_rate": judged["eval/win_rate"],
                "eval/champion_judge_win_rate_ci_low": judged["eval/win_rate_ci_low"],
                "eval/champion_judge_win_rate_ci_high": judged["eval/win_rate_ci_high"]})
    gap = out["eval/champion_judge_win_rate"] - out["eval/champion_gold_win_rate"]
    out["eval/champion_judge_gold_gap"] = gap
    out["eval/flag_over_optimisation"] = float(
        gap > p.evaluate.monitors.max_champion_judge_gold_gap)
    return out


def evaluate_best_of_n(p: Params, candidates: Sequence[Rollout], path: str, rm: torch.nn.Module,
                       gold: GoldEvaluator, judge: PointwiseJudge | PairwiseJudge,
                       refs: Sequence[Rollout], subjects: Sequence[str],
                       pad: int) -> dict[str, float]:
    """Best-of-N: the reference's N candidates per prompt (read from `path`) reranked by the RM
    against its single sample, by the judge and gold, with the analytic KL."""
    bon = p.evaluate.best_of_n
    n_prompts = len(candidates) // bon.n
    if n_prompts == 0 or [c.prompt_id for c in candidates[:: bon.n]] != [
            r.prompt_id for r in refs[:n_prompts]]:
        raise DataError(f"{path}: Best-of-N candidates do not match the held-out prompts; "
                        f"rerun reference_samples")
    picked = best_of_n(rm, candidates, bon.n, pad)
    judge_m, _ = compare(judge, picked, refs[:n_prompts], p.evaluate.bootstrap, p.seed)
    nll = [mean_nll(*padded([s.logprobs]))[0] for s in picked]
    ref_nll = [mean_nll(*padded([s.logprobs]))[0] for s in refs[:n_prompts]]
    g_m, _, g_pol, _ = gold_compare(gold, picked, refs[:n_prompts], subjects[:n_prompts], nll,
                                    ref_nll, p.evaluate.bootstrap, p.seed, "eval/bon_gold_")
    return {"eval/bon_n": float(bon.n), "eval/bon_n_prompts": float(n_prompts),
            "eval/bon_win_rate": judge_m["eval/win_rate"],
            "eval/bon_win_rate_ci_low": judge_m["eval/win_rate_ci_low"],
            "eval/bon_win_rate_ci_high": judge_m["eval/win_rate_ci_high"],
            "eval/bon_gold_win_rate": g_m["eval/bon_gold_win_rate"],
            "eval/bon_gold_win_rate_ci_low": g_m["eval/bon_gold_win_rate_ci_low"],
            "eval/bon_gold_win_rate_ci_high": g_m["eval/bon_gold_win_rate_ci_high"],
            "eval/bon_on_topic_rate": sum(g.on_topic for g in g_pol) / len(g_pol),
            "eval/bon_review_rate": sum(g.review for g in g_pol) / len(g_pol),
            "eval/bon_kl": best_of_n_kl(bon.n)}


if __name__ == "__main__":
    stage.run_main(lambda: main())
