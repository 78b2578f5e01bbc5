"""Stage `prompts`: build the train, held-out and select prompt sets from versioned text files.

Each subject (a movie) is paired with one instruction template; train and held-out prompts are
about disjoint subjects, so evaluation asks about movies the policy was never trained on. The
select prompts (promotion decisions only) are about the subjects left over, each asked with
several templates when there are fewer subjects than prompts.
"""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tasks.core import jsonl, layout
from tasks.core.jsonl import DataError
from tasks.schemas.prompts import PromptParams

CONTRACT = stage.Contract(
    "prompts", params=("seed", "prompts"),
    deps=lambda it, prev: ("${prompts.subjects_file}", "${prompts.templates_file}"),
    outs=lambda it, prev: (layout.PROMPTS_TRAIN, layout.PROMPTS_HELDOUT, layout.PROMPTS_SELECT))


def read_lines(path: Path) -> list[str]:
    """Non-comment, non-blank lines of a UTF-8 text file; errors name file and line."""
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    out = []
    for n, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{n}: not valid UTF-8 (byte {e.start} of the line)") from None
        if line and not line.startswith("#"):
            out.append(line)
    return out


def build_prompts(subjects: Sequence[str], templates: Sequence[str], p: PromptParams,
                  seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Deterministic (train, heldout) prompt records over disjoint subjects."""
    if len(set(subjects)) < p.n_train + p.n_heldout:
        raise DataError(f"{p.subjects_file}: {len(set(subjects))} distinct subjects, "
                        f"need n_train + n_heldout = {p.n_train + p.n_heldout}")
    rng = random.Random(seed)
    order = sorted(set(subjects))
    rng.shuffle(order)
    records = []
    for i, subject in enumerate(order[: p.n_train + p.n_heldout]):
        template = templates[rng.randrange(len(templates))]
        records.append({"prompt_id": f"p{i:05d}", "subject": subject,
                        "prompt": [{"role": "user", "content": template.format(movie=subject)}]})
    return records[: p.n_train], records[p.n_train:]


def build_select(subjects: Sequence[str], templates: Sequence[str], p: PromptParams,
                 seed: int) -> list[dict[str, Any]]:
    """The select prompts: the subjects neither train nor held-out uses (the same shuffle),
    each with distinct templates, round-robin; their own RNG, so train and held-out are the
    same with or without them."""
    if p.n_select == 0:
        return []
    rng = random.Random(seed)
    order = sorted(set(subjects))
    rng.shuffle(order)
    left = order[p.n_train + p.n_heldout:]
    if len(left) * len(templates) < p.n_select:
        raise DataError(f"{p.subjects_file}: {len(left)} subjects left after train and "
                        f"held-out, with {len(templates)} templates at most "
                        f"{len(left) * len(templates)} select prompts; n_select is {p.n_select}")
    pick = random.Random(f"{seed}/select")
    per_subject = {s: pick.sample(range(len(templates)), len(templates)) for s in left}
    out = []
    for i in range(p.n_select):
        subject = left[i % len(left)]
        template = templates[per_subject[subject][i // len(left)]]
        out.append({"prompt_id": f"s{i:05d}", "subject": subject,
                    "prompt": [{"role": "user", "content": template.format(movie=subject)}]})
    return out


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "", CONTRACT)
    p = args.params.prompts
    subjects = read_lines(args.root / p.subjects_file)
    templates = read_lines(args.root / p.templates_file)
    for n, t in enumerate(templates, start=1):
        if t.count("{movie}") != 1:
            raise DataError(f"{p.templates_file}: template {n} must contain {{movie}} once: {t!r}")
    train, heldout = build_prompts(subjects, templates, p, args.params.seed)
    jsonl.write(args.root / layout.PROMPTS_TRAIN, train)
    jsonl.write(args.root / layout.PROMPTS_HELDOUT, heldout)
    select = build_select(subjects, templates, p, args.params.seed)
    jsonl.write(args.root / layout.PROMPTS_SELECT, select)
    stage.say(f"prompts: {len(train)} train, {len(heldout)} held-out, {len(select)} select")


if __name__ == "__main__":
    stage.run_main(lambda: main())
