"""Stage `judge`: the AI judge labels this iteration's rollouts (RLAIF).

For each prompt the judge scores its K samples; best and worst are compared in both orders and
become a preference pair when the verdict is clear. The new pairs join the pool that the next
reward model trains on: off-policy cold start, on-policy iteration.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

from tasks import jsonl, layout, stage
from tasks.judges import PointwiseJudge, Verdict, judge_pair, make_judge, verdict_rates
from tasks.records import PreferencePair, Prompt, Rollout, parse_pair, parse_rollout


def best_vs_worst(judge: PointwiseJudge, prompt: Prompt, responses: Sequence[str],
                  source: str, meta: dict[str, object]
                  ) -> tuple[PreferencePair | None, Verdict, list[float | None]]:
    """The pair (best, worst) of one prompt's responses, when the judge prefers best."""
    scores = judge.score([prompt] * len(responses), responses)
    valid = [i for i, s in enumerate(scores) if s is not None]
    if len(valid) < 2:
        return None, "invalid", scores
    best = max(valid, key=lambda i: scores[i])     # type: ignore[arg-type, return-value]
    worst = min(valid, key=lambda i: scores[i])    # type: ignore[arg-type, return-value]
    verdict = judge_pair(judge, prompt, responses[best], responses[worst]) if best != worst \
        else "tie"
    if verdict != "A":
        return None, verdict, scores
    pair_meta = {**meta, "judge": f"{judge.kind}:{judge.version}", "score_chosen": scores[best],
                 "score_rejected": scores[worst]}
    return PreferencePair(prompt, responses[best], responses[worst], source, pair_meta), \
        verdict, scores


def judge_groups(judge: PointwiseJudge,
                 groups: Sequence[tuple[Prompt, Sequence[str], dict[str, object]]],
                 source: str) -> tuple[list[PreferencePair], dict[str, float]]:
    """Best-vs-worst pairs for every group of responses, with verdict rates and score stats."""
    pairs, verdicts, all_scores = [], [], []
    for prompt, responses, meta in groups:
        pair, verdict, scores = best_vs_worst(judge, prompt, responses, source, meta)
        verdicts.append(verdict)
        all_scores.extend(scores)
        if pair is not None:
            pairs.append(pair)
    valid = [s for s in all_scores if s is not None]
    metrics = {f"judge/{k}": v for k, v in verdict_rates(verdicts).items()}
    metrics.update({
        "judge/n_pairs": float(len(pairs)),
        "judge/n_responses": float(len(all_scores)),
        "judge/invalid_response_rate": 1 - len(valid) / max(len(all_scores), 1),
        "judge/mean_score": sum(valid) / max(len(valid), 1),
    })
    return pairs, metrics


def rollout_groups(rollouts: Sequence[Rollout], iteration: int
                   ) -> list[tuple[Prompt, list[str], dict[str, object]]]:
    """Group consecutive rollouts of one prompt: (prompt, responses, meta) per prompt."""
    return [(rs[0].prompt, [r.text for r in rs],
             {"prompt_id": pid, "policy": rs[0].policy, "iteration": iteration})
            for pid, grp in groupby(rollouts, key=lambda r: r.prompt_id) for rs in [list(grp)]]


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "")
    it, root = args.it, args.root
    path = str(root / layout.rollouts(it))
    rollouts = [parse_rollout(rec, path, n) for n, rec in jsonl.read(path)]
    groups = rollout_groups(rollouts, it)
    pairs, metrics = judge_groups(make_judge(args.params.judge), groups, f"iter_{it}")
    pool_path = str(root / layout.pairs_pool(it - 1))
    pool = [parse_pair(rec, pool_path, n, "unknown") for n, rec in jsonl.read(pool_path)]
    jsonl.write(root / layout.pairs(it), (p.to_record() for p in pairs))
    jsonl.write(root / layout.pairs_pool(it), (p.to_record() for p in pool + pairs))
    metrics["judge/pool_size"] = float(len(pool) + len(pairs))
    stage.write_metrics(root, layout.metrics(it, "judge"), metrics)
    print(f"judge@{it}: {len(pairs)} pairs from {len(groups)} prompts; pool {len(pool) + len(pairs)}")


if __name__ == "__main__":
    stage.run_main(lambda: main())
