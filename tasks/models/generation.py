"""On-policy samples as rollout records: the prompts of a prompt file, K samples each from a
policy (tasks/models/sampling.py). Each rollout keeps what off-policy reuse needs later: prompt and
response token ids, the sampler's per-token log-probs, whether it ended with EOS or was
truncated, the sampling settings, and the version (weights md5) and iteration of the policy
that produced it. Shared by the stages that sample: rollout, reference_samples, evaluate and
collect_offpolicy.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from tasks.core import jsonl, layout
from tasks.data.records import Prompt, Rollout, parse_prompt
from tasks.models import lm, sampling
from tasks.schemas.generation import GenerationParams


def load_prompts(path: str, limit: int | None = None,
                 offset: int = 0) -> list[tuple[str, Prompt]]:
    """(prompt_id, prompt) pairs; with a limit, a window starting at offset (wrapping)."""
    rows = [(str(rec.get("prompt_id", f"line{n}")), parse_prompt(rec, f"{path}:{n}"))
            for n, rec in jsonl.read(path)]
    if limit is None or not rows:
        return rows
    return [rows[(offset + i) % len(rows)] for i in range(min(limit, len(rows)))]


def sample_rollouts(model: torch.nn.Module | None, tok: transformers.PreTrainedTokenizerBase,
                    prompts: Sequence[tuple[str, Prompt]], k: int, gen: GenerationParams,
                    max_prompt_tokens: int, policy_version: str, iteration: int,
                    rng: torch.Generator, workers: int = 1,
                    policy_dir: Path | None = None, root: Path | None = None) -> list[Rollout]:
    """K samples per prompt, grouped by prompt in input order. With workers > 1, sampled by
    that many Ray workers, each loading the model from policy_dir (the same samples; a LoRA
    adapter's base from the workspace `root`)."""
    ids = [lm.render_prompt(tok, prompt, max_prompt_tokens) for _, prompt in prompts]
    flat = [i for i in range(len(prompts)) for _ in range(k)]
    rows = [ids[i] for i in flat]
    kw = dict(batch_size=gen.batch_size, max_new_tokens=gen.max_new_tokens,
              eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=gen.temperature,
              top_p=gen.top_p, generator=rng)
    if workers > 1:
        if policy_dir is None:
            raise ValueError("sampling on Ray workers needs the policy's directory")
        samples = sampling.sample_on_workers(  # type: ignore[arg-type]
            policy_dir, rows, workers, root=root, **kw)
    else:
        samples = sampling.sample(model, rows, **kw)  # type: ignore[arg-type]
    out = []
    for i, s in zip(flat, samples):
        pid, prompt = prompts[i]
        text = tok.decode(s.response_ids, skip_special_tokens=True).strip()
        out.append(Rollout(pid, prompt, tuple(ids[i]), s.response_ids, s.logprobs, s.finished,
                           text, policy_version, iteration, gen))
    return out


def select_rows(samples: Sequence[Rollout], subjects: Sequence[str],
                nll: Sequence[float]) -> list[dict[str, Any]]:
    """One record per select prompt: what the gold evaluator reads of a response."""
    return [{"prompt_id": s.prompt_id, "subject": subj, "text": s.text, "nll": n}
            for s, subj, n in zip(samples, subjects, nll)]


def select_responses(policy: Any, ref: Any, tok: Any, root: Path, p: Any, it: int,
                     rng: Any) -> list[dict[str, Any]]:
    """Policy `it`'s responses to the select prompts (tasks/evaluation/headtohead.py) with what the
    gold evaluator reads of each: prompt id, subject, text, mean NLL under the reference `ref`."""
    path = str(root / layout.PROMPTS_SELECT)
    prompts = load_prompts(path)
    if not prompts:
        return []
    subject_of = {str(r.get("prompt_id")): str(r.get("subject", "")) for _, r in jsonl.read(path)}
    samples = sample_rollouts(policy, tok, prompts, 1, p.evaluate.generation,
                              p.model.max_prompt_tokens, "", it, rng)
    nll: list[float] = []
    with torch.no_grad():
        for s in range(0, len(samples), 32):
            chunk = samples[s: s + 32]
            lp, mask = lm.response_logprobs(ref, [x.prompt_ids for x in chunk],
                                            [x.response_ids for x in chunk], tok.pad_token_id)
            nll.extend(lm.mean_nll(lp.float(), mask.float()))
    return select_rows(samples, [subject_of[s.prompt_id] for s in samples], nll)



def redteam_texts(model: Any, tok: Any, probes: Sequence[Any], p: Any,
                  rng: torch.Generator) -> list[str]:
    """The model's responses to the red-team regression set (each probe's `prompt_id` and
    `prompt`), `evaluate.redteam.samples_per_prompt` each, grouped by prompt, sampled as the
    evaluation samples (tasks/evaluation/redteam.py checks them)."""
    samples = sample_rollouts(model, tok, [(q.prompt_id, q.prompt) for q in probes],
                              p.evaluate.redteam.samples_per_prompt, p.evaluate.generation,
                              p.model.max_prompt_tokens, "", 0, rng)
    return [s.text for s in samples]
