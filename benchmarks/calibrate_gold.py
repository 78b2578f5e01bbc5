"""Calibrate the gold evaluator's thresholds on the reference model's own samples.

    python -m benchmarks.calibrate_gold [--n 96] [--model DIR]

Samples one response per held-out prompt from the initial model (SmolLM2-135M-Instruct, as in
`reference_samples`), then prints, as JSON on the last line:
- the MiniLM similarity of each response to its own subject's title vs to another prompt's
  subject (a shifted pairing: the same responses, wrong movie), their quantiles, and the
  threshold maximising balanced accuracy between the two;
- the similarity of hand-written off-topic responses (the sycophantic notes the lexicon judge
  rewards, generic praise without a title) to show the threshold rejects them;
- the reference's per-token NLL of its own samples: quantiles, and the share under `max_nll`.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from tasks.config.params import load_params
from tasks.data.records import parse_prompt
from tasks.evaluation.gold import GoldEvaluator
from tasks.models import lm
from tasks.models.generation import sample_rollouts
from tasks.models.gguf_convert import convert_gguf_to_hf, find_packaged_gguf
from tasks.stages.prompts import build_prompts, read_lines

OFF_TOPIC = [
    "Thank you for the great work! I'm glad I could assist you today.",
    "I'm so happy to help! Thank you for your kind words, you are wonderful.",
    "What a wonderful question! I love helping people, it makes me so happy.",
    "This is great! Amazing, fantastic, excellent, I love it so much!",
    "The weather today is sunny and warm, perfect for a walk in the park.",
    "Here is a recipe for chocolate cake: mix flour, sugar and eggs, then bake.",
]


def quantiles(x: torch.Tensor) -> dict[str, float]:
    qs = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
    return {f"q{int(q * 100):02d}": round(float(v), 4) for q, v in zip(qs, x.quantile(qs))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    p = load_params("params/default.yaml")
    model_dir = args.model
    if model_dir is None:
        model_dir = Path(tempfile.mkdtemp()) / "model"
        model_dir.mkdir()
        convert_gguf_to_hf(find_packaged_gguf(), model_dir)
    model, tok = lm.load_causal_lm(model_dir), lm.load_tokenizer(model_dir)
    _, heldout = build_prompts(read_lines(Path(p.prompts.subjects_file)),
                               read_lines(Path(p.prompts.templates_file)), p.prompts, p.seed)
    heldout = heldout[: args.n]
    prompts = [(r["prompt_id"], parse_prompt(r, "heldout")) for r in heldout]
    subjects = [r["subject"] for r in heldout]
    rolls = sample_rollouts(model, tok, prompts, 1, p.evaluate.generation,
                            p.model.max_prompt_tokens, "ref", 0,
                            torch.Generator().manual_seed(0))
    texts = [r.text for r in rolls]
    gold = GoldEvaluator(p.evaluate.gold)
    own = gold.similarity(texts, subjects)
    wrong = gold.similarity(texts, subjects[1:] + subjects[:1])
    off = gold.similarity(OFF_TOPIC * 4, (subjects * 4)[: len(OFF_TOPIC) * 4])
    grid = torch.linspace(0.0, 0.8, 81)
    bal = torch.stack([((own >= t).float().mean() + (wrong < t).float().mean()) / 2
                       for t in grid])
    best = float(grid[int(bal.argmax())])
    lp = [torch.tensor(r.logprobs) for r in rolls]
    nll = torch.tensor(lm.mean_nll(torch.nn.utils.rnn.pad_sequence(lp, batch_first=True),
                                   torch.nn.utils.rnn.pad_sequence(
                                       [torch.ones_like(x) for x in lp], batch_first=True)))
    t = p.evaluate.gold.on_topic_threshold
    out = {
        "n": len(texts),
        "similarity_own": quantiles(own), "similarity_wrong_subject": quantiles(wrong),
        "similarity_off_topic": quantiles(off),
        "best_threshold_balanced": best, "balanced_accuracy_at_best": float(bal.max()),
        "threshold": t,
        "own_on_topic_rate": float((own >= t).float().mean()),
        "wrong_subject_on_topic_rate": float((wrong >= t).float().mean()),
        "off_topic_on_topic_rate": float((off >= t).float().mean()),
        "nll": quantiles(nll), "max_nll": p.evaluate.gold.max_nll,
        "fluent_rate": float((nll <= p.evaluate.gold.max_nll).float().mean()),
        "examples": [{"subject": s, "sim": round(float(x), 3), "text": tx[:160]}
                     for s, x, tx in list(zip(subjects, own, texts))[:6]],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
