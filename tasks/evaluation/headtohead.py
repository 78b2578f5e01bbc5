"""A candidate against the champion it would replace, by the gold evaluator, on the *select*
prompts: held-out subjects used for no other measurement.

Why a split of its own: promotion picks the better of two noisy measurements, and the figure
that picked the winner overstates it (the winner's curse). Decisions read the select prompts;
the gold win rate the report and the targets show is measured on the held-out prompts, which
no decision reads, so it stays an unbiased estimate of the promoted policy.

Each iteration's evaluation keeps its policy's responses to the select prompts with the gold
inputs (`data/iter_k/select_samples.jsonl`: prompt id, subject, text, NLL under the
reference; tasks/models/generation.py's `select_responses`); iteration 0's are the reference's
(stage reference_samples). The champion is the
iteration a candidate starts from (`prev`: a tick appends the champion's), so the comparison is
a declared input of the candidate's evaluation, not a lookup in the registry.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tasks.core import jsonl
from tasks.core.jsonl import DataError
from tasks.evaluation.winrate import win_rate


def read(path: str, prompt_ids: Sequence[str]) -> list[dict[str, Any]]:
    """A policy's select responses, for exactly these prompts (in their order)."""
    out = []
    for n, rec in jsonl.read(path):
        for key, kind in (("prompt_id", str), ("subject", str), ("text", str),
                          ("nll", (int, float))):
            if not isinstance(rec.get(key), kind):
                raise DataError(f"{path}:{n}: field {key!r} missing or not a "
                                f"{'number' if key == 'nll' else 'string'}")
        out.append(rec)
    if [r["prompt_id"] for r in out] != list(prompt_ids):
        raise DataError(f"{path}: responses to other prompts than the select prompts "
                        f"({len(out)} rows, {len(prompt_ids)} prompts); rerun the stage that "
                        "wrote it")
    return out


def compare(gold: Any, verdict: Any, candidate: Sequence[dict[str, Any]],
            champion: Sequence[dict[str, Any]], n_boot: int, seed: int,
            prefix: str = "eval/champion_gold_") -> dict[str, float]:
    """Gold win rate of the candidate over the champion (ties half, 95% bootstrap interval);
    with prefix "eval/select_gold_", over the reference (iteration 0's select responses).
    `gold` scores (tasks/evaluation/gold.py's GoldEvaluator), `verdict` compares two scores."""
    g_new, g_old = (gold.score([r["text"] for r in side], [r["subject"] for r in side],
                               [float(r["nll"]) for r in side])
                    for side in (candidate, champion))
    wr = win_rate([verdict(a, b) for a, b in zip(g_new, g_old)], n_boot, seed)
    return {f"{prefix}win_rate": wr["win_rate"], f"{prefix}win_rate_ci_low": wr["ci_low"],
            f"{prefix}win_rate_ci_high": wr["ci_high"], f"{prefix}n_win": wr["n_A"],
            f"{prefix}n_loss": wr["n_B"], f"{prefix}n_tie": wr["n_tie"],
            f"{prefix}valid_rate": sum(g.valid for g in g_new) / max(len(g_new), 1),
            f"{prefix}opponent_valid_rate": sum(g.valid for g in g_old) / max(len(g_old), 1)}
