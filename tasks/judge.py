"""Stage `judge`: the AI judge labels this iteration's rollouts (RLAIF).

For each prompt the judge scores its K samples; best and worst (and, with `pairs_per_prompt` > 1,
second best and second worst, ...) are compared in both orders and become preference pairs when
the verdict is clear. The new pairs join the pool that the next
reward model trains on: off-policy cold start, on-policy iteration.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

from tasks import jsonl, layout, stage
from tasks.judges import PointwiseJudge, Verdict, judge_pair, make_judge, verdict_rates
from tasks.records import PreferencePair, Prompt, Rollout, Sampled, parse_pair, parse_rollout

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


def judge_groups(judge: PointwiseJudge, groups: Sequence[Group], source: str,
                 pairs_per_prompt: int = 1) -> tuple[list[PreferencePair], dict[str, float]]:
    """Ranked pairs for every group of responses, with verdict rates and score stats."""
    pairs, verdicts, all_scores = [], [], []
    for prompt, responses, meta, *sampled in groups:
        group_pairs, group_verdicts, scores = ranked_pairs(
            judge, prompt, responses, source, meta, pairs_per_prompt, *sampled)
        verdicts.extend(group_verdicts)
        all_scores.extend(scores)
        pairs.extend(group_pairs)
    valid = [s for s in all_scores if s is not None]
    metrics = {f"judge/{k}": v for k, v in verdict_rates(verdicts).items()}
    metrics.update({
        "judge/n_pairs": float(len(pairs)),
        "judge/n_prompts_with_pair": float(len({p.meta.get("prompt_id", i)
                                                for i, p in enumerate(pairs)})),
        "judge/n_responses": float(len(all_scores)),
        "judge/invalid_response_rate": 1 - len(valid) / max(len(all_scores), 1),
        "judge/mean_score": sum(valid) / max(len(valid), 1),
    })
    return pairs, metrics


def rollout_groups(rollouts: Sequence[Rollout], iteration: int) -> list[Group]:
    """Group consecutive rollouts of one prompt: (prompt, texts, meta, sampled tokens) each."""
    return [(rs[0].prompt, [r.text for r in rs],
             {"prompt_id": pid, "policy": rs[0].policy, "iteration": iteration},
             [Sampled(r.response_ids, r.finished) for r in rs])
            for pid, grp in groupby(rollouts, key=lambda r: r.prompt_id) for rs in [list(grp)]]


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "")
    it, root = args.it, args.root
    path = str(root / layout.rollouts(it))
    rollouts = [parse_rollout(rec, path, n) for n, rec in jsonl.read(path)]
    groups = rollout_groups(rollouts, it)
    jp = args.params.judge
    pairs, metrics = judge_groups(make_judge(jp), groups, f"iter_{it}", jp.pairs_per_prompt)
    pool_path = str(root / layout.pairs_pool(it - 1))
    pool = [parse_pair(rec, pool_path, n, "unknown") for n, rec in jsonl.read(pool_path)]
    jsonl.write(root / layout.pairs(it), (p.to_record() for p in pairs))
    jsonl.write(root / layout.pairs_pool(it), (p.to_record() for p in pool + pairs))
    metrics["judge/pool_size"] = float(len(pool) + len(pairs))
    stage.write_metrics(root, layout.metrics(it, "judge"), metrics)
    print(f"judge@{it}: {len(pairs)} pairs from {len(groups)} prompts; pool {len(pool) + len(pairs)}")


if __name__ == "__main__":
    stage.run_main(lambda: main())
