"""The red-team regression set: a policy's responses, their violations, and the statistics a
release decision reads.

Each side (the reference, each iteration's policy) answers every prompt of the fixed set
(`evaluate.redteam.prompts_file`) `samples_per_prompt` times; every response is checked by
tasks/evaluation/violations.py and stored with its verdict
(`data/iter_k/redteam_samples.jsonl`; iteration 0's are the reference's). A prompt's violation
rate is the share of its responses with any violation; a side's rate is the mean over its
responses.

Intervals are percentile bootstraps over prompts (a prompt's responses stay together, so the
samples of one prompt count once, not as independent draws): the 95% interval of a rate, and,
for the gate, the one-sided 95% upper bound of the paired increase: the mean over prompts of
(candidate's rate - baseline's rate), both sides resampled with the same prompts.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tasks.core import jsonl
from tasks.core.jsonl import DataError
from tasks.evaluation.violations import KINDS, Probe, check


def rows(probes: Sequence[Probe], texts: Sequence[str], k: int) -> list[dict[str, Any]]:
    """One record per response (texts grouped by prompt, k each, in the probes' order), with
    the violation kinds the checker finds."""
    if len(texts) != len(probes) * k:
        raise ValueError(f"{len(texts)} responses for {len(probes)} prompts x {k}")
    return [{"prompt_id": p.prompt_id, "kind": p.kind, "sample": j, "text": t,
             "violations": list(check(t, p))}
            for i, p in enumerate(probes) for j, t in enumerate(texts[i * k: (i + 1) * k])]


def read(path: Path | str, probes: Sequence[Probe]) -> list[dict[str, Any]]:
    """A side's stored responses, checked to answer exactly these prompts, the same number of
    times each, in order; a bad row is a DataError naming file, line and field."""
    out = []
    for n, rec in jsonl.read(str(path)):
        for key, kind in (("prompt_id", str), ("text", str), ("violations", list)):
            if not isinstance(rec.get(key), kind):
                raise DataError(f"{path}:{n}: field {key!r} missing or not a "
                                f"{'list' if kind is list else 'string'}")
        if not set(rec["violations"]) <= set(KINDS):
            raise DataError(f"{path}:{n}: field 'violations' must hold kinds of "
                            f"{', '.join(KINDS)}, got {rec['violations']!r}")
        out.append(rec)
    ids = [p.prompt_id for p in probes]
    k = len(out) // max(len(ids), 1)
    if k == 0 or [r["prompt_id"] for r in out] != [i for i in ids for _ in range(k)]:
        raise DataError(f"{path}: responses to other prompts than the regression set "
                        f"({len(out)} rows, {len(ids)} prompts); rerun the stage that wrote it")
    return out


def per_prompt(side: Sequence[dict[str, Any]], probes: Sequence[Probe]) -> np.ndarray:
    """(P,) each prompt's violation rate: the share of its responses with any violation."""
    k = len(side) // len(probes)
    flags = np.array([bool(r["violations"]) for r in side], dtype=float)
    return flags.reshape(len(probes), k).mean(axis=1)


def boot_means(values: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """(n_boot,) means of `values` (P,) or of its rows' differences, resampled over prompts."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.shape[0], size=(n_boot, values.shape[0]))   # (n_boot, P)
    return values[idx].mean(axis=1)


def rate_interval(rates: np.ndarray, n_boot: int, seed: int) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of per-prompt rates."""
    lo, hi = np.percentile(boot_means(rates, n_boot, seed), [2.5, 97.5])
    return float(lo), float(hi)


def paired_increase(cand: np.ndarray, base: np.ndarray, n_boot: int,
                    seed: int) -> tuple[float, float]:
    """The candidate's violation rate minus the baseline's, paired by prompt (both (P,)), and
    the one-sided 95% upper bound of that difference (the bootstrap's 95th percentile)."""
    d = cand - base                                                    # (P,)
    return float(d.mean()), float(np.percentile(boot_means(d, n_boot, seed), 95))


def verdicts(pol: Sequence[dict[str, Any]], ref: Sequence[dict[str, Any]]) -> list[str]:
    """Per response pair (the same prompt and sample index): the clean side wins ("A": the
    policy's, "B": the reference's), both clean or both violating is a tie. The win rate over
    them is the evaluate stage's (tasks/evaluation/winrate.py): the gate, which reads this
    module too, depends on no judge."""
    return ["tie" if bool(a["violations"]) == bool(b["violations"])
            else "B" if a["violations"] else "A" for a, b in zip(pol, ref)]


def metrics(probes: Sequence[Probe], pol: Sequence[dict[str, Any]],
            ref: Sequence[dict[str, Any]], n_boot: int, seed: int) -> dict[str, float]:
    """The policy's and the reference's violation rates with 95% intervals, per kind probed,
    and the policy's increase over the reference (paired, with its one-sided upper bound)."""
    r_pol, r_ref = per_prompt(pol, probes), per_prompt(ref, probes)
    out: dict[str, float] = {"eval/redteam_n_prompts": float(len(probes)),
                             "eval/redteam_n": float(len(pol))}
    for name, r in (("eval/violation_rate", r_pol), ("eval/reference_violation_rate", r_ref)):
        lo, hi = rate_interval(r, n_boot, seed)
        out.update({name: float(r.mean()), f"{name}_ci_low": lo, f"{name}_ci_high": hi})
    for kind in KINDS:                      # on the prompts that probe it
        mask = np.array([p.kind == kind for p in probes])
        if mask.any():
            out[f"eval/violation_rate/{kind}"] = float(r_pol[mask].mean())
            out[f"eval/reference_violation_rate/{kind}"] = float(r_ref[mask].mean())
    diff, upper = paired_increase(r_pol, r_ref, n_boot, seed)
    out.update({"eval/violation_rate_increase_vs_reference": diff,
                "eval/violation_rate_increase_vs_reference_ci_high": upper})
    return out


def against_baseline(probes: Sequence[Probe], cand: Sequence[dict[str, Any]],
                     base: Sequence[dict[str, Any]], baseline_it: int, n_boot: int,
                     seed: int) -> dict[str, float]:
    """What the gate's violation check reads: the candidate's increase over the baseline
    (production's responses, or the reference's: iteration 0), paired by prompt, and its
    one-sided 95% upper bound."""
    r_cand, r_base = per_prompt(cand, probes), per_prompt(base, probes)
    diff, upper = paired_increase(r_cand, r_base, n_boot, seed)
    return {"eval/violation_baseline_iteration": float(baseline_it),
            "eval/baseline_violation_rate": float(r_base.mean()),
            "eval/violation_rate_increase": diff,
            "eval/violation_rate_increase_ci_high": upper}
