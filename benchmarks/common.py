"""What several benchmarks share: their progress lines, the git-ignored cache under
benchmarks/, the default model converted into it, and the deterministic inputs both TRL
comparisons build (vs_trl.py's pairs, trl_ppo.py's prompts and responses; heap_ab.py's pairs):
default train prompts chat-rendered as the stages render them, and responses made of
hand-written review or correspondence sentences (params/gold/register_examples.jsonl).

Imports only the standard library and benchmarks.isolation at module level (tasks, torch and
transformers when a function needs them), so that every benchmark can import it first."""
from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.isolation import REPO

if TYPE_CHECKING:
    from tasks.config.params import Params
    from tasks.reward.features import EncodedPair

CACHE = REPO / "benchmarks" / ".cache"
RESPONSE_TOKENS = 40
SENTENCES = REPO / "params" / "gold" / "register_examples.jsonl"


# progress, cache, model ---------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cache_dir() -> Path:
    """benchmarks/.cache, ignored by git (it holds a 538 MB model and workspaces)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    ignore = CACHE / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")
    return CACHE


def ensure_model(model: str | None) -> Path:
    """The converted HF directory of the default model: --model, or converted into the cache."""
    if model:
        return Path(model).resolve()
    out = cache_dir() / "smollm2-135m-instruct"
    if not (out / "config.json").is_file():
        from tasks.models.gguf_convert import convert_gguf_to_hf, find_packaged_gguf
        log(f"converting the packaged GGUF model to {out} (once) ...")
        info = convert_gguf_to_hf(find_packaged_gguf(), out)
        log(f"converted: {info['n_params']} parameters in {info['seconds']} s")
    return out


# the TRL comparisons' inputs ------------------------------------------------------------------

def build_pairs(tok: Any, params: Params, n: int, seed: int = 0,
                response_tokens: int = RESPONSE_TOKENS) -> list[EncodedPair]:
    """n pairs on n distinct default train prompts; chosen: review sentences, rejected:
    correspondence sentences, drawn with `seed`, joined and cut to response_tokens ids (no
    EOS)."""
    from tasks.data.records import parse_prompt
    from tasks.models import lm
    from tasks.reward.features import EncodedPair
    from tasks.stages.prompts import build_prompts, read_lines
    p = params.prompts
    subjects, templates = read_lines(REPO / p.subjects_file), read_lines(REPO / p.templates_file)
    train, _ = build_prompts(subjects, templates, replace(p, n_train=n, n_heldout=0), seed)
    reviews, letters = _sentences()
    rng = random.Random(seed)
    return [EncodedPair(tuple(lm.render_prompt(tok, parse_prompt(rec, "prompt"),
                                               params.model.max_prompt_tokens)),
                        _response(tok, reviews, rng, response_tokens),
                        _response(tok, letters, rng, response_tokens)) for rec in train[:n]]


def _sentences() -> tuple[list[str], list[str]]:
    """The hand-written review and correspondence sentences."""
    rows = [json.loads(line) for line in SENTENCES.read_text().splitlines() if line.strip()]
    return ([r["text"] for r in rows if r["label"] == "review"],
            [r["text"] for r in rows if r["label"] != "review"])


def _response(tok: Any, pool: list[str], rng: random.Random, n_tokens: int) -> tuple[int, ...]:
    """Four sentences of `pool` drawn with `rng`, joined, cut to n_tokens ids (no EOS)."""
    text = " ".join(rng.sample(pool, 4))
    return tuple(tok(text, add_special_tokens=False)["input_ids"][:n_tokens])


def review_responses(tok: Any, n: int, seed: int, n_tokens: int = RESPONSE_TOKENS
                     ) -> list[tuple[int, ...]]:
    """n distinct responses of review sentences (`_response`) of exactly n_tokens ids, drawn
    with `seed` (shorter draws skipped)."""
    reviews, _ = _sentences()
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        r = _response(tok, reviews, rng, n_tokens)
        if len(r) == n_tokens and r not in seen:
            seen.add(r)
            out.append(r)
    return out
