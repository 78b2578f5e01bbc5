"""Stage `collect_offpolicy`: the off-policy preference pairs the first reward model learns from.

Two real sources:
- `import`: the user's pairs, `offpolicy.import_path` inside the workspace's data/import/ (a
  declared dep; `alignloop import FILE` puts them there): JSONL, JSON, Parquet or a directory
  saved by HF `datasets`, in any TRL preference format (see tasks/data/pair_import.py), or
  another workspace's pools (`alignloop import --from-workspace`, tasks/data/pair_book.py);
- `cold_start`: K samples per prompt from the behaviour policy (the initial model), labelled
  by the judge, best vs worst.
The result is iteration 0's pair pool; each iteration's judged on-policy pairs are added to it.
"""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

from pathlib import Path

from tasks.config.params import Params
from tasks.core import jsonl, layout
from tasks.core.jsonl import DataError
from tasks.data import pair_book
from tasks.data.pair_import import read_pairs
from tasks.data.records import PreferencePair, with_sampler_logprobs
from tasks.judging.judge_factory import make_judge
from tasks.judging.labelling import judge_all, rollout_groups
from tasks.models import lm
from tasks.models.generation import load_prompts, sample_rollouts
from tasks.runtime.device import Device

CONTRACT = stage.Contract(
    "collect_offpolicy",
    params=("device", "seed", "model.max_prompt_tokens", "offpolicy", "judge"),
    deps=lambda it, prev: (layout.JUDGE_TEMPLATES, layout.IMPORT_DIR, layout.PROMPTS_TRAIN,
                           layout.policy(0)),
    outs=lambda it, prev: (layout.pairs_pool(0),),
    metrics=lambda it, prev: (layout.OFFPOLICY_METRICS,))


def import_pairs(path: Path, root: Path | None = None) -> list[PreferencePair]:
    """The user's pairs from `path`, which must lie inside `root`/data/import when a workspace
    root is given; every row is checked first: the first bad one is named, the rest counted.
    Rows carried from another workspace's pools (`alignloop import --from-workspace`) keep
    their token ids and sampler log-probs when they name the tokenizer of `root`'s initial
    model; every other row is text."""
    tokenizer = None
    if root is not None:
        inside_import_dir(path, root)
        tokenizer = pair_book.tokenizer_md5_of_dir(root / layout.policy(0))
    res = read_pairs(path, tokenizer=tokenizer)
    if res.errors:                  # one line, as every stage error; the command lists them all
        more = len(res.errors) - 1
        raise DataError(res.errors[0] + (f" (and {more} more bad rows: `alignloop import "
                                          f"{path}` lists them)" if more else ""))
    if res.identical:               # no preference: `alignloop import` leaves such rows out
        more = len(res.identical) - 1
        raise DataError(f"{res.identical[0]}: fields 'chosen' and 'rejected' are the same "
                        "response (no preference)" + (f"; and {more} more rows" if more else "")
                        + f": `alignloop import {path}` writes the file without them")
    if not res.pairs:
        raise DataError(f"{path}: no preference pairs")
    tokens = sum(1 for x in res.pairs if x.source == pair_book.BOOK_SOURCE and x.sampled)
    stage.say(f"collect_offpolicy: {res.rows} rows, {len(res.pairs)} pairs, {res.duplicates} "
              "duplicates dropped" + (f", {tokens} book pairs with their token ids" if tokens
                                      else ""))
    return res.pairs


def inside_import_dir(path: Path, root: Path) -> None:
    """Refuse an import path that leaves the workspace's data/import/ (after symlinks), which is
    the only import location dvc.yaml declares as a dep."""
    base = (root / layout.IMPORT_DIR).resolve()
    if not path.resolve().is_relative_to(base) or path.resolve() == base:
        raise DataError(f"{path}: imports are read only from inside {base}; bring the file in "
                        "with `alignloop import FILE --workspace WORKSPACE`")


def cold_start(p: Params, root: Path, device: Device = "cpu"
               ) -> tuple[list[PreferencePair], dict[str, float]]:
    policy_dir = root / layout.policy(0)
    model, tok = lm.load_causal_lm(policy_dir, device), lm.load_tokenizer(policy_dir)
    prompts = load_prompts(str(root / layout.PROMPTS_TRAIN), p.offpolicy.n_prompts)
    rollouts = sample_rollouts(model, tok, prompts, p.offpolicy.samples_per_prompt,
                               p.offpolicy.generation, p.model.max_prompt_tokens,
                               lm.weights_md5(policy_dir), 0, stage.generator(p.seed, 0))
    _, pool, metrics = judge_all(make_judge(p.judge, root, device), rollout_groups(rollouts, 0),
                                 "cold_start", p.judge)
    return with_sampler_logprobs(pool, rollouts), metrics


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "", CONTRACT)
    p, root = args.params, args.root
    if p.offpolicy.source == "import":
        pairs = import_pairs(root / p.offpolicy.import_path, root)
        metrics = {"offpolicy/n_pairs": float(len(pairs))}
    else:
        pairs, metrics = cold_start(p, root, args.device)
        metrics["offpolicy/n_pairs"] = float(len(pairs))
    jsonl.write(root / layout.pairs_pool(0), (x.to_record() for x in pairs))
    stage.write_metrics(root, layout.OFFPOLICY_METRICS, metrics)
    stage.say(f"collect_offpolicy: {len(pairs)} pairs ({p.offpolicy.source})")


if __name__ == "__main__":
    stage.run_main(lambda: main())
