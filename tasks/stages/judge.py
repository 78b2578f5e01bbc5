"""Stage `judge`: the AI judge labels this iteration's rollouts (RLAIF).

The judge's verdicts become DPO's pairs (best vs worst of each prompt's K samples) and the reward
model's new pool pairs; how, in tasks/judging/labelling.py. Each pair keeps its sides' tokens
and the sampler's per-token log-probs, which off-policy DPO weighs a reused pair by. The pool
of the previous iteration is carried forward with the new pairs appended (off-policy cold
start, on-policy iteration), and the judge's agreement with the person's audit labels is
measured on it.
"""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

from collections.abc import Sequence

from tasks.core import jsonl, layout
from tasks.core.errors import InputError
from tasks.data import audit
from tasks.data.records import (
    PreferencePair,
    parse_pair,
    parse_rollout,
    with_sampler_logprobs,
)
from tasks.judging.judge_factory import make_judge
from tasks.judging.labelling import (
    Group,
    audit_agreement,
    audited_pairs,
    judge_all,
    requests_needed,
    rollout_groups,
)
from tasks.judging.pairwise import PairwiseLLMJudge
from tasks.schemas.judge import JudgeParams

CONTRACT = stage.Contract(
    "judge", params=("device", "judge"),
    deps=lambda it, prev: (layout.JUDGE_TEMPLATES, layout.rollouts(it), layout.pairs_pool(prev),
                           layout.AUDIT_LABELS),
    outs=lambda it, prev: (layout.pairs(it), layout.pairs_pool(it)),
    metrics=lambda it, prev: (layout.metrics(it, "judge"),))


def check_budget(judge: PairwiseLLMJudge, groups: Sequence[Group], jp: JudgeParams,
                 audited: Sequence[PreferencePair], it: int) -> None:
    """Refuse, before judging, a run that would send more than judge.max_requests_per_tick."""
    need, orders = requests_needed(judge, groups, jp, audited)
    if need > jp.max_requests_per_tick:
        raise InputError(f"judge@{it}: judging needs {need} requests to the http judge ({orders}"
                         f" comparisons in both orders, {orders - need} answered by the verdict"
                         f" cache or repeated), over judge.max_requests_per_tick = "
                         f"{jp.max_requests_per_tick}; nothing was sent")
    stage.say(f"judge@{it}: {need} requests, within judge.max_requests_per_tick = "
              f"{jp.max_requests_per_tick}")


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "", CONTRACT)
    it, root = args.it, args.root
    path = str(root / layout.rollouts(it))
    rollouts = [parse_rollout(rec, path, n) for n, rec in jsonl.read(path)]
    groups = rollout_groups(rollouts, it)
    jp = args.params.judge
    pool_path = str(root / layout.pairs_pool(args.prev))
    pool = [parse_pair(rec, pool_path, n, "unknown") for n, rec in jsonl.read(pool_path)]
    labels_path = root / layout.AUDIT_LABELS
    audit.ensure_labels_file(labels_path)
    labels = audit.parse_labels(labels_path)
    judge = make_judge(jp, root, args.device)
    if jp.kind == "http" and jp.max_requests_per_tick > 0:      # before any request is sent
        check_budget(judge, groups, jp, [p for p, _ in audited_pairs(pool, labels)], it)
    pairs, new, metrics = judge_all(judge, groups, f"iter_{it}", jp, root)
    pairs, new = with_sampler_logprobs(pairs, rollouts), with_sampler_logprobs(new, rollouts)
    metrics.update(audit_agreement(judge, pool, labels, "judge/"))
    jsonl.write(root / layout.pairs(it), (p.to_record() for p in pairs))
    jsonl.write(root / layout.pairs_pool(it), (p.to_record() for p in pool + new))
    metrics["judge/pool_size"] = float(len(pool) + len(new))
    stage.write_metrics(root, layout.metrics(it, "judge"), metrics)
    stage.say(f"judge@{it}: {len(pairs)} pairs from {len(groups)} prompts, {len(new)} for the "
              f"reward model; pool {len(pool) + len(new)}")


if __name__ == "__main__":
    stage.run_main(lambda: main())
