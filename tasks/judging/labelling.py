"""Preference pairs from a judge's verdicts: what the `judge` stage and the off-policy
cold start (`collect_offpolicy`) both make of K samples per prompt.

For each prompt the judge scores its K samples; best and worst (and, with `pairs_per_prompt` > 1,
second best and second worst, ...) are compared in both orders and become preference pairs when
the verdict is clear: DPO's pairs. The reward model learns from more: with `pool_pairs: all`,
every pair of the K samples whose scores differ by at least `pool_margin` and whose verdict
holds in both orders (up to K(K-1)/2 per prompt, 28 at K = 8) joins the pool that the next
reward model trains on: off-policy cold start, on-policy iteration.

Pairwise judges (`judge.kind: llm | http`) have no scores to rank by: they compare a seeded set
of pairs of the K samples instead (`pairwise_groups`), with their verdicts cached.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from itertools import combinations, groupby
from pathlib import Path

import torch

from tasks.data import audit
from tasks.data.records import PreferencePair, Prompt, Rollout, Sampled
from tasks.judging.judge_factory import make_judge
from tasks.judging.judges import (
    LexiconJudge,
    PairwiseJudge,
    PointwiseJudge,
    Verdict,
    is_pointwise,
    judge_pair,
    judge_pairs,
    position_flipped,
    verdict_rates,
)
from tasks.judging.pairwise import PairwiseLLMJudge
from tasks.schemas.judge import JudgeParams

# (prompt, response texts, meta for its pairs[, each response's sampled tokens])
Group = tuple[Prompt, Sequence[str], dict[str, object]] \
    | tuple[Prompt, Sequence[str], dict[str, object], Sequence[Sampled]]


def ranked_pairs(judge: PointwiseJudge, prompt: Prompt, responses: Sequence[str],
                 source: str, meta: dict[str, object], n_pairs: int = 1,
                 sampled: Sequence[Sampled] = ()
                 ) -> tuple[list[PreferencePair], list[Verdict], list[float | None]]:
    """Up to `n_pairs` pairs of one prompt's responses: the i-th best against the i-th worst
    (best vs worst first), each kept only when the judge prefers the better one in both orders.

    Ranks are disjoint (i < valid / 2), so no kept pair reuses a response (equal scores are a
    tie, never kept), and each later pair has a narrower score gap than the one before.
    `sampled` (one per response, or empty) are the tokens the policy drew: each pair carries
    its two sides' own. Returns (pairs, one verdict per comparison, scores).
    """
    scores = judge.score([prompt] * len(responses), responses)
    valid = [i for i, s in enumerate(scores) if s is not None]
    if len(valid) < 2:
        return [], ["invalid"], scores
    # best first and worst first; equal scores keep the response order on both sides
    down = sorted(valid, key=lambda i: (-scores[i], i))   # type: ignore[operator]
    up = sorted(valid, key=lambda i: (scores[i], i))      # type: ignore[index]
    pairs: list[PreferencePair] = []
    verdicts: list[Verdict] = []
    for rank in range(min(n_pairs, len(valid) // 2)):
        best, worst = down[rank], up[rank]
        verdict = judge_pair(judge, prompt, responses[best], responses[worst]) \
            if scores[best] != scores[worst] else "tie"
        verdicts.append(verdict)
        if verdict == "A":
            tokens = {responses[i]: sampled[i] for i in (best, worst)} if sampled else {}
            pairs.append(PreferencePair(prompt, responses[best], responses[worst], source, {
                **meta, "judge": f"{judge.kind}:{judge.version}", "pair_rank": rank,
                "score_chosen": scores[best], "score_rejected": scores[worst]}, tokens))
    return pairs, verdicts, scores


def margin_pairs(judge: PointwiseJudge, prompt: Prompt, responses: Sequence[str],
                 scores: Sequence[float | None], source: str, meta: dict[str, object],
                 margin: float, sampled: Sequence[Sampled] = ()) -> list[PreferencePair]:
    """Every pair (i, j) of one prompt's valid responses whose scores differ by at least
    `margin`, the higher one chosen, kept when the judge agrees in both orders."""
    pairs = []
    for i, j in combinations(range(len(responses)), 2):
        si, sj = scores[i], scores[j]
        if si is None or sj is None or abs(si - sj) < margin or responses[i] == responses[j]:
            continue
        hi, lo = (i, j) if si > sj else (j, i)
        if judge_pair(judge, prompt, responses[hi], responses[lo]) != "A":
            continue
        tokens = {responses[k]: sampled[k] for k in (hi, lo)} if sampled else {}
        pairs.append(PreferencePair(prompt, responses[hi], responses[lo], source, {
            **meta, "judge": f"{judge.kind}:{judge.version}", "pair_rank": -1,
            "score_chosen": scores[hi], "score_rejected": scores[lo]}, tokens))
    return pairs


def union(first: Sequence[PreferencePair], more: Sequence[PreferencePair]) -> list[PreferencePair]:
    """`first`, then the pairs of `more` whose (prompt, chosen, rejected) it lacks."""
    key = lambda p: (p.prompt, p.chosen, p.rejected)
    seen = {key(p) for p in first}
    return list(first) + [p for p in more if key(p) not in seen]


# one group's (ranked pairs, pool pairs, verdicts, scores)
GroupResult = tuple[list[PreferencePair], list[PreferencePair], list[Verdict], list[float | None]]


def judge_group(judge: PointwiseJudge, group: Group, source: str, pairs_per_prompt: int = 1,
                pool_margin: float | None = None) -> GroupResult:
    """One prompt's ranked pairs and pool pairs (the ranked ones, plus with `pool_margin`
    every margin pair), its verdicts and its responses' scores."""
    prompt, responses, meta, *sampled = group
    pairs, verdicts, scores = ranked_pairs(judge, prompt, responses, source, meta,
                                           pairs_per_prompt, *sampled)
    more = [] if pool_margin is None else margin_pairs(
        judge, prompt, responses, scores, source, meta, pool_margin, *sampled)
    return pairs, union(pairs, more), verdicts, scores


def judge_groups(judge: PointwiseJudge, groups: Sequence[Group], source: str,
                 pairs_per_prompt: int = 1, pool_margin: float | None = None
                 ) -> tuple[list[PreferencePair], list[PreferencePair], dict[str, float]]:
    """Ranked pairs (DPO's) and pool pairs (the reward model's) for every group of
    responses, with verdict rates and score stats."""
    return collect_groups([judge_group(judge, g, source, pairs_per_prompt, pool_margin)
                           for g in groups])


def collect_groups(results: Sequence[GroupResult]
                   ) -> tuple[list[PreferencePair], list[PreferencePair], dict[str, float]]:
    """The groups' pairs and pool pairs in group order, and their metrics."""
    pairs = [x for r in results for x in r[0]]
    pool = [x for r in results for x in r[1]]
    verdicts = [v for r in results for v in r[2]]
    all_scores = [s for r in results for s in r[3]]
    valid = [s for s in all_scores if s is not None]
    metrics = {f"judge/{k}": v for k, v in verdict_rates(verdicts).items()}
    metrics.update({
        "judge/n_pairs": float(len(pairs)),
        "judge/n_pool_pairs": float(len(pool)),
        "judge/n_prompts_with_pair": float(len({p.meta.get("prompt_id", i)
                                                for i, p in enumerate(pairs)})),
        "judge/n_responses": float(len(all_scores)),
        "judge/invalid_response_rate": 1 - len(valid) / max(len(all_scores), 1),
        "judge/mean_score": sum(valid) / max(len(valid), 1),
    })
    return pairs, pool, metrics


def judge_shard(jp: JudgeParams, root: Path, source: str, threads: int,
                groups: Sequence[Group]) -> list[GroupResult]:
    """A Ray task's share of `judge_all`: its own judge, built from the same params and
    files, on the stage's torch thread count (a reward model's scores keep their bits), on
    the CPU (Ray workers are CPU processes here: no GPU is requested for them)."""
    torch.set_num_threads(threads)
    judge = make_judge(jp, root)
    return [judge_group(judge, g, source, jp.pairs_per_prompt,  # type: ignore[arg-type]
                        pool_margin(jp)) for g in groups]


def seeded_pairs(key: str, responses: Sequence[str], n: int) -> list[tuple[int, int]]:
    """A fixed set of `n` index pairs (i < j, different texts) of one prompt's responses,
    drawn by an RNG seeded from `key` (the prompt id): the same prompt and K, the same pairs."""
    cands = [(i, j) for i, j in combinations(range(len(responses)), 2)
             if responses[i] != responses[j]]
    random.Random(int(hashlib.md5(key.encode()).hexdigest()[:16], 16)).shuffle(cands)
    return cands[:n]


def pairwise_plan(groups: Sequence[Group], jp: JudgeParams) -> list[tuple[Group, int, int]]:
    """The comparisons `pairwise_groups` asks for: (group, i, j), seeded per prompt."""
    return [(g, i, j) for n, g in enumerate(groups)
            for i, j in seeded_pairs(str(g[2].get("prompt_id", n)), g[1],
                                     jp.comparisons_per_prompt)]


def pairwise_groups(judge: PairwiseJudge, groups: Sequence[Group], source: str,
                    jp: JudgeParams) -> tuple[list[PreferencePair], list[PreferencePair],
                                              dict[str, float]]:
    """Pairs for a judge without scores: per prompt a seeded set of comparisons among its K
    samples (`comparisons_per_prompt`), all shown in both orders at once; a pair whose verdict
    is clear (A or B in both orders) has its winner chosen. DPO's pairs: up to
    `pairs_per_prompt` of them with disjoint responses, in the seeded order; the pool: those,
    or with `pool_pairs: all` every clear one. Metrics: verdict, tie, invalid and
    position-bias rates, the judge's counters, and agreement with the lexicon judge."""
    plan = pairwise_plan(groups, jp)
    results = judge_pairs(judge, [(g[0], g[1][i], g[1][j]) for g, i, j in plan])
    stats = getattr(judge, "stats", None)
    if stats is not None:
        stats.check_answered(f"{judge.kind} judge ({source})")
        print(f"{judge.kind} judge ({source}): {stats.summary()}")
    pairs, pool, clear = [], [], []
    for key, rows in groupby(zip(plan, results), key=lambda r: id(r[0][0])):
        used: set[int] = set()
        picked = 0
        for (g, i, j), (verdict, _, _) in rows:
            if verdict not in ("A", "B"):
                continue
            hi, lo = (i, j) if verdict == "A" else (j, i)
            prompt, responses, meta, *sampled = g
            clear.append((prompt, responses[hi], responses[lo]))
            dpo = picked < jp.pairs_per_prompt and not {hi, lo} & used
            tokens = {responses[k]: sampled[0][k] for k in (hi, lo)} if sampled else {}
            pair = PreferencePair(prompt, responses[hi], responses[lo], source, {
                **meta, "judge": f"{judge.kind}:{judge.version}",
                "pair_rank": picked if dpo else -1}, tokens)
            if dpo:
                pairs.append(pair)
                used |= {hi, lo}
                picked += 1
            if dpo or jp.pool_pairs == "all":
                pool.append(pair)
    verdicts = [v for v, _, _ in results]
    flips = sum(position_flipped(f, r) for _, f, r in results)
    both = sum("invalid" not in (f, r) for _, f, r in results)
    metrics = {f"judge/{k}": v for k, v in verdict_rates(verdicts).items()}
    metrics.update({
        "judge/n_pairs": float(len(pairs)), "judge/n_pool_pairs": float(len(pool)),
        "judge/n_prompts_with_pair": float(len({p.meta.get("prompt_id", i)
                                                for i, p in enumerate(pairs)})),
        "judge/n_responses": float(sum(len(g[1]) for g in groups)),
        "judge/position_bias_rate": flips / both if both else 0.0,
        "judge/n_position_flips": float(flips),
    })
    metrics.update(stats.metrics("judge/") if stats is not None else {})
    metrics.update(lexicon_agreement(jp, clear, "judge/"))
    return pairs, pool, metrics


def lexicon_agreement(jp: JudgeParams, clear: Sequence[tuple[Prompt, str, str]],
                      prefix: str) -> dict[str, float]:
    """How often the VADER lexicon judge (same tie margin and minimum words), shown the same
    pairs in both orders, also prefers the pairwise judge's winner: over the pairs it has a
    clear verdict on."""
    lex = LexiconJudge(jp.tie_margin, jp.min_words, "vader-v1")
    said = [judge_pair(lex, p, a, b) for p, a, b in clear]
    decided = [v for v in said if v in ("A", "B")]
    return {f"{prefix}lexicon_agreement": sum(v == "A" for v in decided) / max(len(decided), 1),
            f"{prefix}lexicon_agreement_n": float(len(decided))}


def audited_pairs(pool: Sequence[PreferencePair], labels: dict[str, audit.AuditLabel]
                  ) -> list[tuple[PreferencePair, str]]:
    """Pool pairs a person gave a side (`chosen_ok` or `swap`), with that verdict."""
    return [(p, labels[pid].verdict) for p in pool for pid in [audit.pair_id(p)]
            if pid in labels and labels[pid].verdict != "drop"]


def audit_agreement(judge: PairwiseJudge, pool: Sequence[PreferencePair],
                    labels: dict[str, audit.AuditLabel], prefix: str) -> dict[str, float]:
    """How often the judge sides with the people who audited earlier pairs: each pool pair
    with a `chosen_ok` or `swap` label (a `drop` has no side) is shown to the judge in both
    orders; over those it decides, the rate at which it prefers the person's winner. Empty
    when nothing is labelled."""
    audited = audited_pairs(pool, labels)
    if not audited:
        return {}
    said = judge_pairs(judge, [(p.prompt, p.chosen, p.rejected) for p, _ in audited])
    decided = [(v == "A") == (human == "chosen_ok")
               for (v, _, _), (_, human) in zip(said, audited) if v in ("A", "B")]
    return {f"{prefix}audit_agreement": sum(decided) / max(len(decided), 1),
            f"{prefix}audit_agreement_n": float(len(decided)),
            f"{prefix}audit_labelled_n": float(len(audited))}


def judge_all(judge: PairwiseJudge, groups: Sequence[Group], source: str, jp: JudgeParams,
              root: Path | None = None
              ) -> tuple[list[PreferencePair], list[PreferencePair], dict[str, float]]:
    """Pointwise judges: `judge_groups` (best vs worst, margin pairs), exactly as before, on
    `jp.workers` Ray workers when more than 1 (shards of the groups; with `root`, the
    workspace the judge's files are read from); pairwise judges: `pairwise_groups`."""
    if not is_pointwise(judge):
        return pairwise_groups(judge, groups, source, jp)
    if jp.workers > 1 and root is not None:
        from tasks.runtime import ray_pool  # only here: nothing imports Ray otherwise
        args = (jp, root, source, torch.get_num_threads())
        parts = ray_pool.map_shards(judge_shard, args, groups, jp.workers)
        return collect_groups([r for part in parts for r in part])
    return judge_groups(judge, groups, source,  # type: ignore[arg-type]
                        jp.pairs_per_prompt, pool_margin(jp))


def requests_needed(judge: PairwiseLLMJudge, groups: Sequence[Group], jp: JudgeParams,
                    audited: Sequence[PreferencePair] = ()) -> tuple[int, int]:
    """(requests, comparisons): what judging `groups` (and the `audited` pairs' agreement)
    would send to the judge's backend, before any is sent: every comparison in both orders,
    less those its verdict cache answers, each distinct one asked once. Retries not counted."""
    items = [(g[0], g[1][i], g[1][j]) for g, i, j in pairwise_plan(groups, jp)]
    items += [(p.prompt, p.chosen, p.rejected) for p in audited]
    orders = items + [(p, b, a) for p, a, b in items]
    return judge.uncached(orders), len(orders)


def rollout_groups(rollouts: Sequence[Rollout], iteration: int) -> list[Group]:
    """Group consecutive rollouts of one prompt: (prompt, texts, meta, sampled tokens) each."""
    return [(rs[0].prompt, [r.text for r in rs],
             {"prompt_id": pid, "policy": rs[0].policy, "iteration": iteration},
             [Sampled(r.response_ids, r.finished) for r in rs])
            for pid, grp in groupby(rollouts, key=lambda r: r.prompt_id) for rs in [list(grp)]]


def pool_margin(jp: JudgeParams) -> float | None:
    """The score gap that makes a margin pair (pool_pairs: all), None for ranked pairs only."""
    return max(jp.pool_margin, jp.tie_margin) if jp.pool_pairs == "all" else None

