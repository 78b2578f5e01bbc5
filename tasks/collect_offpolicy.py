"""Stage `collect_offpolicy`: the off-policy preference pairs the first reward model learns from.

Two real sources:
- `import`: the user's pairs, a JSONL file or a directory saved by HF `datasets`
  (`save_to_disk`), in TRL's standard or conversational format (see tasks/records.py);
- `cold_start`: K samples per prompt from the behaviour policy (the initial model), labelled
  by the judge, best vs worst.
The result is iteration 0's pair pool; each iteration's judged on-policy pairs are added to it.
"""
from __future__ import annotations

from pathlib import Path

from tasks import jsonl, layout, lm, stage
from tasks.judge import judge_groups, rollout_groups
from tasks.judges import make_judge
from tasks.jsonl import DataError
from tasks.params import Params
from tasks.records import PreferencePair, parse_pair
from tasks.rollout import load_prompts, sample_rollouts


def import_pairs(path: Path) -> list[PreferencePair]:
    """Read user pairs from a JSONL file or a saved HF datasets directory."""
    if path.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # datasets raises several types for a bad directory
            raise DataError(f"{path}: not a saved HF datasets directory ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"{path}: DatasetDict without a 'train' split ({list(ds)})")
            ds = ds["train"]
        pairs = [parse_pair(dict(rec), str(path), n, "import", where=f"{path} (row {n + 1})")
                 for n, rec in enumerate(ds)]
    else:
        pairs = [parse_pair(rec, str(path), n, "import") for n, rec in jsonl.read(path)]
    if not pairs:
        raise DataError(f"{path}: no preference pairs")
    return pairs


def cold_start(p: Params, root: Path) -> tuple[list[PreferencePair], dict[str, float]]:
    policy_dir = root / layout.policy(0)
    model, tok = lm.load_causal_lm(policy_dir), lm.load_tokenizer(policy_dir)
    prompts = load_prompts(str(root / layout.PROMPTS_TRAIN), p.offpolicy.n_prompts)
    rollouts = sample_rollouts(model, tok, prompts, p.offpolicy.samples_per_prompt,
                               p.offpolicy.generation, p.model.max_prompt_tokens,
                               lm.weights_md5(policy_dir), 0, stage.generator(p.seed, 0))
    return judge_groups(make_judge(p.judge), rollout_groups(rollouts, 0), "cold_start",
                        p.judge.pairs_per_prompt)


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "")
    p, root = args.params, args.root
    if p.offpolicy.source == "import":
        pairs = import_pairs(root / p.offpolicy.import_path)
        metrics = {"offpolicy/n_pairs": float(len(pairs))}
    else:
        pairs, metrics = cold_start(p, root)
        metrics["offpolicy/n_pairs"] = float(len(pairs))
    jsonl.write(root / layout.pairs_pool(0), (x.to_record() for x in pairs))
    stage.write_metrics(root, layout.OFFPOLICY_METRICS, metrics)
    print(f"collect_offpolicy: {len(pairs)} pairs ({p.offpolicy.source})")


if __name__ == "__main__":
    stage.run_main(lambda: main())
