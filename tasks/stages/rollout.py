"""Stage `rollout`: K on-policy samples per prompt from the current policy.

Each rollout keeps what off-policy reuse needs later: prompt and response token ids, the
sampler's per-token log-probs, whether it ended with EOS or was truncated, the sampling
settings, and the version (weights md5) and iteration of the policy that produced it
(tasks/models/generation.py). An offline iteration (`rollout.offline`) samples nothing: its
rollouts file is empty, so judge@k adds no pairs and update@k trains on the pool alone.
"""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

from collections.abc import Sequence

from tasks.config import conditions
from tasks.core import jsonl, layout
from tasks.data.records import Rollout
from tasks.models import adapters, lm
from tasks.models.generation import load_prompts, sample_rollouts

CONTRACT = stage.Contract(
    "rollout", params=("device", "seed", "model.max_prompt_tokens", "rollout"),
    deps=lambda it, prev: (layout.PROMPTS_TRAIN, layout.policy(prev), layout.policy(0)),
    outs=lambda it, prev: (layout.rollouts(it),),
    metrics=lambda it, prev: (layout.metrics(it, "rollout"),),
    when={"policy_is_adapter": lambda it, prev: (layout.policy(0),)})


def rollout_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    n = max(len(rollouts), 1)
    return {
        "rollout/n": float(len(rollouts)),
        "rollout/mean_length": sum(len(r.response_ids) for r in rollouts) / n,
        "rollout/truncated_rate": sum(not r.finished for r in rollouts) / n,
        "rollout/mean_logprob": sum(sum(r.logprobs) for r in rollouts) / n,
    }


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "", CONTRACT)
    p, it = args.params, args.it
    if it in p.rollout.offline:
        jsonl.write(args.root / layout.rollouts(it), [])
        stage.write_metrics(args.root, layout.metrics(it, "rollout"),
                            {**rollout_metrics([]), "rollout/offline": 1.0})
        stage.say(f"rollout@{it}: offline (rollout.offline), no samples")
        return
    policy_dir = args.root / layout.policy(args.prev)
    conditions.check(CONTRACT, p, args.root,  # a LoRA policy's base is a declared dep
                     {"policy_is_adapter": adapters.is_adapter_dir(policy_dir)})
    tok = lm.load_tokenizer(policy_dir)
    # with Ray workers each loads its own replica: the stage process needs none
    model = adapters.load_for_inference(policy_dir, args.root, args.device) \
        if p.rollout.workers == 1 else None                      # merged, for a LoRA policy
    prompts = load_prompts(str(args.root / layout.PROMPTS_TRAIN), p.rollout.n_prompts,
                           offset=(it - 1) * p.rollout.n_prompts)
    rollouts = sample_rollouts(model, tok, prompts, p.rollout.samples_per_prompt,
                               p.rollout.generation, p.model.max_prompt_tokens,
                               lm.weights_md5(policy_dir), it, stage.generator(p.seed, 1, it),
                               p.rollout.workers, policy_dir, args.root)
    jsonl.write(args.root / layout.rollouts(it), (r.to_record() for r in rollouts))
    metrics = rollout_metrics(rollouts)
    stage.write_metrics(args.root, layout.metrics(it, "rollout"), metrics)
    stage.say(f"rollout@{it}: {len(rollouts)} samples from {layout.policy(args.prev)}")


if __name__ == "__main__":
    stage.run_main(lambda: main())
