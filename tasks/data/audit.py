"""Human audit of the judge's labels: the queue a person reviews, and their verdicts applied.

After each reward model is trained, `train_rm@k` exports `audit/iter_k/queue.jsonl` (a DVC out,
replaced on every rerun): this iteration's new judge pairs on which the ensemble members
disagree most (the top `audit_top_n` by the std of their margins; K > 1 only) and a seeded
random sample of `audit_random_n` other new pairs. Pairs already audited are not queued again.

The person writes verdicts to a SEPARATE, git-tracked file, `audit/labels.jsonl` (never an out,
so DVC never deletes it), one JSON object per line:

    {"pair_id": "<md5 of prompt+chosen+rejected>", "verdict": "chosen_ok" | "swap" | "drop",
     "source": "iter_3", "note": "optional free text"}

`chosen_ok`: the judge was right; `swap`: the rejected response is the better one; `drop`: no
usable preference (both bad, a tie, garbage). Other keys are allowed and ignored, so a queue
line with a `verdict` added is a valid label; its `reason` ("random" or "disagreement") is
kept, so the judge error rate can also be reported on the unbiased random sample alone.
Every later `train_rm` applies the verdicts to its pool before training.

A label's `source` ("iter_j", "cold_start", "import", "book": the queue line carries it) names
where its pair joined a pool. A pool holds every pair of each source it holds any of (pools only
grow along the chain of `prev`), so a label whose source the pool holds but whose pair_id
matches nothing is wrong (mistyped, or left from data that has since changed): an error naming
the labels file and line. A label whose source the pool does not hold (a later iteration's pair,
or one of a refused iteration that nothing builds on) is counted (rm/audit_n_unmatched). A label
without `source` must match a pair: otherwise nothing tells a later pair from a mistyped id, and
it is refused the same way. The stage that reads the labels refuses; nothing is written.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.core import atomic, jsonl
from tasks.core.jsonl import DataError
from tasks.data.records import PreferencePair, prompt_to_record

# torch is imported by build_queue alone: the CLI reads labels and pairs through this module
# without paying for torch's import (1.2 s of every command's start-up)
if TYPE_CHECKING:
    import torch
    from torch import Tensor

VERDICTS = ("chosen_ok", "swap", "drop")


@dataclass(frozen=True)
class AuditLabel:
    pair_id: str
    verdict: str          # one of VERDICTS
    note: str = ""
    reason: str = ""      # why it was queued ("random", "disagreement"), when copied from a queue
    source: str = ""      # the pair's source, when copied from a queue ("iter_2", "import", ...)
    where: str = field(default="", compare=False)   # "labels.jsonl:LINE", for errors


def pair_id(pair: PreferencePair) -> str:
    """Stable identity of a judged pair: md5 of its prompt, chosen and rejected texts."""
    key = json.dumps([prompt_to_record(pair.prompt), pair.chosen, pair.rejected],
                     ensure_ascii=False, sort_keys=True)
    return hashlib.md5(key.encode("utf-8")).hexdigest()


def parse_label(rec: dict[str, Any], where: str) -> AuditLabel:
    for key in ("pair_id", "verdict"):
        if not isinstance(rec.get(key), str) or not rec[key]:
            raise DataError(f"{where}: field '{key}' must be a non-empty string")
    if rec["verdict"] not in VERDICTS:
        raise DataError(f"{where}: field 'verdict' must be one of {VERDICTS}, "
                        f"got {rec['verdict']!r}")
    note, reason, source = rec.get("note", ""), rec.get("reason", ""), rec.get("source", "")
    if not all(isinstance(x, str) for x in (note, reason, source)):
        raise DataError(f"{where}: fields 'note', 'reason' and 'source' must be strings")
    return AuditLabel(rec["pair_id"], rec["verdict"], note, reason, source, where)


def source_iteration(source: str) -> int | None:
    """The iteration a pair joined the pool at: "iter_j" -> j, the off-policy sources -> 0
    (a "book" pair, carried from another workspace, joins at 0: tasks/data/pair_book.py)."""
    if source in ("cold_start", "import", "book"):
        return 0
    if source.startswith("iter_") and source[5:].isdigit():
        return int(source[5:])
    return None


def check_unknown(pairs: Sequence[PreferencePair], labels: dict[str, AuditLabel],
                  matched: set[str]) -> None:
    """Refuse an unmatched label whose `source` the pool holds, or that names none."""
    held = {p.source for p in pairs}
    for pid, label in labels.items():
        if pid in matched:
            continue
        where = label.where or "audit labels"
        if not label.source:
            raise DataError(f"{where}: pair_id {pid} matches no pair of the pool, and the label "
                            "has no 'source' to tell a later iteration's pair from a mistyped "
                            "id: copy its line from the queue (audit/iter_k/queue.jsonl), which "
                            "carries it, or fix or remove it")
        if source_iteration(label.source) is None:
            raise DataError(f"{where}: field 'source' must be iter_N, cold_start, import or "
                            f"book, got {label.source!r}")
        if label.source in held:
            raise DataError(f"{where}: pair_id {pid} matches no pair of the pool, which holds "
                            f"every {label.source} pair (a mistyped id, or a label left from "
                            "data that has since changed: fix or remove it)")


def parse_labels(path: str | Path) -> dict[str, AuditLabel]:
    """{pair_id: label}; a pair labelled twice is an error naming both lines."""
    return labels_from(jsonl.read(path), str(path))


def labels_from(records: Iterable[tuple[int, dict[str, Any]]], path: str
                ) -> dict[str, AuditLabel]:
    """`parse_labels` of (line, record) pairs read elsewhere (a labels file at a git commit);
    errors name `path` and the line."""
    labels: dict[str, AuditLabel] = {}
    lines: dict[str, int] = {}
    for n, rec in records:
        label = parse_label(rec, f"{path}:{n}")
        if label.pair_id in labels:
            raise DataError(f"{path}:{n}: pair_id {label.pair_id} already labelled at line "
                            f"{lines[label.pair_id]}; keep one verdict per pair")
        labels[label.pair_id], lines[label.pair_id] = label, n
    return labels


def ensure_labels_file(path: Path) -> None:
    """Create an empty labels file when the workspace has none (a declared dep must exist)."""
    if not path.exists():
        atomic.write_text(path, "")


def apply_audit(pairs: Sequence[PreferencePair], labels: dict[str, AuditLabel]
                ) -> tuple[list[PreferencePair], dict[str, float]]:
    """The pairs with the person's verdicts applied (swap flips, drop removes), and metrics.

    Judge error = a `swap` or `drop` verdict. rm/audit_judge_error_rate is over every matched
    label (biased upwards: disagreement-queued pairs are the suspicious ones);
    rm/audit_judge_error_rate_random only over labels queued as the random sample.
    """
    out, matched = [], {}
    for pair in pairs:
        pid = pair_id(pair)
        label = labels.get(pid)
        if label is not None:
            matched[pid] = label
        if label is None or label.verdict == "chosen_ok":
            out.append(pair)
        elif label.verdict == "swap":
            out.append(replace(pair, chosen=pair.rejected, rejected=pair.chosen,
                               meta={**pair.meta, "audit": "swap", "audit_of": pid}))
    check_unknown(pairs, labels, set(matched))
    return out, audit_metrics(list(matched.values()), n_unmatched=len(labels) - len(matched))


def audit_metrics(labels: Sequence[AuditLabel], n_unmatched: int) -> dict[str, float]:
    """Rates are nan when nothing was audited (rm/audit_n = 0)."""
    def rate(ls: Sequence[AuditLabel], verdicts: tuple[str, ...]) -> float:
        return sum(x.verdict in verdicts for x in ls) / len(ls) if ls else float("nan")
    rand = [x for x in labels if x.reason == "random"]
    return {"rm/audit_n": float(len(labels)),
            "rm/audit_judge_error_rate": rate(labels, ("swap", "drop")),
            "rm/audit_swap_rate": rate(labels, ("swap",)),
            "rm/audit_drop_rate": rate(labels, ("drop",)),
            "rm/audit_n_random": float(len(rand)),
            "rm/audit_judge_error_rate_random": rate(rand, ("swap", "drop")),
            "rm/audit_n_unmatched": float(n_unmatched)}


def build_queue(pairs: Sequence[PreferencePair],
                margins: Tensor | Callable[[Sequence[int]], Tensor],
                labels: dict[str, AuditLabel], top_n: int, random_n: int,
                rng: torch.Generator, members: int | None = None) -> list[dict[str, Any]]:
    """Queue records: the top_n pairs by std of the K members' margins (K > 1), then random_n
    others drawn with `rng`. Audited pairs are skipped. margins: (K, N), one column per pair, or
    a function of pair indices that gives their (K, n) margins, with `members` = K: it is called
    for the unaudited pairs when K > 1 (to rank them) and for the queued pairs alone at K = 1,
    where nothing is ranked: scoring every new pair costs a forward per response."""
    import torch

    ids = [pair_id(p) for p in pairs]
    todo = [i for i, pid in enumerate(ids) if pid not in labels]
    if isinstance(margins, torch.Tensor):
        table, k = margins, margins.shape[0]
        score: Callable[[Sequence[int]], Tensor] = lambda idx: table[:, list(idx)]
    else:
        score, k = margins, members or 1
    column: dict[int, Tensor] = {}                              # pair index -> its (K,) margins
    top: list[int] = []
    if k > 1 and todo:
        column.update(zip(todo, score(todo).cpu().T))
        spread = {i: float(column[i].std(unbiased=False)) for i in todo}
        top = sorted(todo, key=lambda i: (-spread[i], i))[:top_n]
    rest = [i for i in todo if i not in set(top)]
    pick = torch.randperm(len(rest), generator=rng)[:random_n].tolist()   # cpu: its generator
    chosen = [(i, "disagreement") for i in top] + [(rest[j], "random") for j in sorted(pick)]
    unscored = [i for i, _ in chosen if i not in column]
    if unscored:
        column.update(zip(unscored, score(unscored).cpu().T))
    queued = (torch.stack([column[i] for i, _ in chosen], 1) if chosen
              else torch.zeros(k, 0))                                              # (K, Q)
    std, mean = queued.std(0, unbiased=False), queued.mean(0)                       # (Q,)
    return [{"pair_id": ids[i], "reason": reason, "rank": rank,
             "prompt": prompt_to_record(pairs[i].prompt), "chosen": pairs[i].chosen,
             "rejected": pairs[i].rejected, "source": pairs[i].source,
             "judge": pairs[i].meta.get("judge"), "score_chosen": pairs[i].meta.get("score_chosen"),
             "score_rejected": pairs[i].meta.get("score_rejected"),
             "rm_margin_mean": float(mean[rank]), "rm_margin_std": float(std[rank])}
            for rank, (i, reason) in enumerate(chosen)]
