"""Stage `reference_samples`: the reference policy's responses to the held-out prompts, sampled
once and shared by every iteration's evaluation (same prompts, same draws: comparable rounds).

With `evaluate.best_of_n.n` > 0 it also draws N more samples for the first `best_of_n.n_prompts`
prompts: the Best-of-N baseline, reranked by each iteration's RM. Its responses to the select
prompts are iteration 0's (tasks/evaluation/headtohead.py): what iteration 1's candidate meets
head-to-head. And its responses to the red-team regression set with their violations
(tasks/evaluation/redteam.py): the violation check's baseline before anything is in
production."""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

from tasks.core import jsonl, layout
from tasks.evaluation import redteam
from tasks.evaluation.violations import read_probes
from tasks.models import lm
from tasks.models.generation import (
    load_prompts,
    redteam_texts,
    sample_rollouts,
    select_responses,
)

CONTRACT = stage.Contract(
    "reference_samples",
    params=("device", "seed", "model.max_prompt_tokens", "evaluate.n_prompts",
            "evaluate.generation", "evaluate.best_of_n", "evaluate.redteam"),
    deps=lambda it, prev: (layout.PROMPTS_HELDOUT, layout.PROMPTS_SELECT, layout.policy(0),
                           "${evaluate.redteam.prompts_file}"),
    outs=lambda it, prev: (layout.REFERENCE_SAMPLES, layout.BEST_OF_N_SAMPLES,
                           layout.select_samples(0), layout.redteam_samples(0)))


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "", CONTRACT)
    p, root = args.params, args.root
    ref_dir = root / layout.policy(0)
    ref, tok = lm.load_causal_lm(ref_dir, args.device), lm.load_tokenizer(ref_dir)
    prompts = load_prompts(str(root / layout.PROMPTS_HELDOUT), p.evaluate.n_prompts)
    samples = sample_rollouts(ref, tok, prompts, 1, p.evaluate.generation,
                              p.model.max_prompt_tokens, lm.weights_md5(ref_dir), 0,
                              stage.generator(p.seed, 5))
    jsonl.write(root / layout.REFERENCE_SAMPLES, (s.to_record() for s in samples))
    bon = p.evaluate.best_of_n
    candidates = sample_rollouts(ref, tok, prompts[: bon.n_prompts], bon.n, p.evaluate.generation,
                                 p.model.max_prompt_tokens, lm.weights_md5(ref_dir), 0,
                                 stage.generator(p.seed, 6)) if bon.n > 0 else []
    jsonl.write(root / layout.BEST_OF_N_SAMPLES, (s.to_record() for s in candidates))
    select = select_responses(ref, ref, tok, root, p, 0, stage.generator(p.seed, 8))
    jsonl.write(root / layout.select_samples(0), select)
    probes = read_probes(root / p.evaluate.redteam.prompts_file)
    red = redteam.rows(probes, redteam_texts(ref, tok, probes, p, stage.generator(p.seed, 12, 0)),
                       p.evaluate.redteam.samples_per_prompt)
    jsonl.write(root / layout.redteam_samples(0), red)
    stage.say(f"reference_samples: {len(samples)} reference responses to held-out prompts, "
              f"{len(candidates)} Best-of-{bon.n} candidates, {len(select)} to select prompts, "
              f"{len(red)} to red-team prompts ({sum(bool(r['violations']) for r in red)} "
              "violating)")


if __name__ == "__main__":
    stage.run_main(lambda: main())
