"""Reusing the pair pool in DPO (the "mistake book"): which earlier pairs are fresh enough, and
the loss weight each reused pair carries.

A pool pair was drawn at iteration `meta.iteration` by that iteration's sampler (rollout@k
samples policy(prev of k); iteration 0, the cold start, the initial model). Its staleness is the
number of policy versions between that sampler and the policy the update starts from, along the
`prev` chain (tasks/functional/offpolicy.py, `versions_back`); `update.dpo.max_staleness: N`
drops pairs more than N versions old before the mix is drawn. Pairs that record no iteration
(imported ones) count as iteration 0's: they entered the pool there.

Weights (`update.dpo.offpolicy_weighting`): `fixed` gives every reused pair `offpolicy_weight`;
`is` gives it min(c, exp(lbar_w + lbar_l)), lbar the per-token mean log pi/mu of a side, pi the
policy the update starts from (one no-grad pass, so the weight is detached and fixed for the
update), mu the sampler's stored per-token log-probs; a pair without them (imported text) falls
back to `offpolicy_weight`. Weights are not normalised within a batch: on-policy pairs keep
weight 1 and the batch loss stays mean_i(w_i l_i), bounded by c.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tasks.core.jsonl import DataError
from tasks.data.records import PreferencePair
from tasks.functional import offpolicy
from tasks.models import lm
from tasks.reward.features import EncodedPair
from tasks.runtime.device import device_of
from tasks.schemas.update import DPOParams


def origin_of(pair: PreferencePair, where: str) -> int:
    """The iteration that drew a pool pair: `meta.iteration`, 0 when it records none."""
    origin = pair.meta.get("iteration", 0)
    if isinstance(origin, bool) or not isinstance(origin, int) or origin < 0:
        raise DataError(f"{where}: field 'meta.iteration' must be a non-negative integer, "
                        f"got {origin!r}")
    return origin


def origin_label(pair: PreferencePair, origin: int) -> int | str:
    """The group a reused pair's weight is reported under: its iteration of origin, or for a
    pair of another workspace's book (`alignloop import --from-workspace`: meta.book) the
    iteration that drew it there, `book_iter_<k>`."""
    book = pair.meta.get("book")
    k = book.get("iteration") if isinstance(book, dict) else None
    return f"book_iter_{k}" if isinstance(k, int) and not isinstance(k, bool) else origin


def fresh(ages: Sequence[int], max_staleness: int) -> list[bool]:
    """Which pairs may be reused: at most max_staleness versions old (0 = no bound)."""
    return [max_staleness == 0 or a <= max_staleness for a in ages]


def offline_indices(dpo_pair: Sequence[bool], n: int, rng: torch.Generator) -> list[int]:
    """The pool pairs an offline iteration trains on, in pool order: n of them (0 = all), the
    pairs the loop's own DPO trained on first (`dpo_pair`: a prompt's best against its worst,
    `meta.pair_rank` >= 0, the widest), then others drawn without replacement by the seed."""
    every = list(range(len(dpo_pair)))
    if n <= 0 or n >= len(every):
        return every
    first = [i for i in every if dpo_pair[i]]
    rest = [i for i in every if not dpo_pair[i]]
    draw = lambda xs, k: [xs[j] for j in torch.randperm(len(xs), generator=rng)[:k].tolist()]
    return sorted(draw(first, n) if n <= len(first) else first + draw(rest, n - len(first)))


def is_dpo_pair(pair: PreferencePair) -> bool:
    """Whether the judge made this pool pair for DPO (a prompt's rank-th best against its
    rank-th worst, `meta.pair_rank` >= 0) rather than only for the reward model (-1)."""
    rank = pair.meta.get("pair_rank")
    return isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0


def behaviour_logprobs(pair: PreferencePair, enc: EncodedPair
                       ) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The sampler's per-token log-probs of the encoded chosen and rejected ids (cut as the
    ids were), or None for a pair that stores none."""
    c, r = pair.tokens(pair.chosen), pair.tokens(pair.rejected)
    if c is None or r is None or not c.logprobs or not r.logprobs:
        return None
    return c.logprobs[: len(enc.chosen_ids)], r.logprobs[: len(enc.rejected_ids)]


def _pad(rows: Sequence[Sequence[float]], width: int, device: torch.device) -> Tensor:
    return torch.tensor([list(x) + [0.0] * (width - len(x)) for x in rows], device=device)


@torch.no_grad()
def start_log_ratios(policy: torch.nn.Module, encoded: Sequence[EncodedPair],
                     behaviour: Sequence[tuple[Sequence[float], Sequence[float]]], pad_id: int,
                     batch_size: int, precision: str) -> tuple[Tensor, Tensor]:
    """Per-token mean log pi/mu of the chosen and of the rejected side of each pair, (N,) each:
    pi the policy as it is (the update's start), mu the stored sampler log-probs."""
    device = device_of(policy)
    out_c, out_r = [], []
    for s in range(0, len(encoded), batch_size):
        chunk, beh = encoded[s: s + batch_size], behaviour[s: s + batch_size]
        n = len(chunk)
        with lm.autocast(precision, device):
            logp, mask = lm.response_logprobs(
                policy, [e.prompt_ids for e in chunk] * 2,
                [e.chosen_ids for e in chunk] + [e.rejected_ids for e in chunk], pad_id)  # (2n, R)
        mu = _pad([b[0] for b in beh] + [b[1] for b in beh], logp.shape[1], device)
        lbar = offpolicy.mean_log_ratio(logp.float(), mu, mask.float())                 # (2n,)
        out_c.append(lbar[:n])
        out_r.append(lbar[n:])
    empty = torch.zeros(0, device=device)
    return (torch.cat(out_c) if out_c else empty), (torch.cat(out_r) if out_r else empty)


def pair_weights(log_ratio_c: Tensor, log_ratio_r: Tensor, has_behaviour: Sequence[bool],
                 origins: Sequence[int | str], ages: Sequence[int], d: DPOParams
                 ) -> tuple[Tensor, dict[str, float]]:
    """Loss weights (N,) of the reused pairs and their `update/offpolicy_*` metrics.

    log_ratio_c, log_ratio_r: (N,) per-token mean log pi/mu (read where has_behaviour);
    origins, ages: each pair's origin (`origin_label`) and staleness. ESS, ESS / n and the
    truncated fraction are over the importance-weighted pairs, in all and per origin.
    """
    n = len(origins)
    w = torch.full((n,), d.offpolicy_weight, dtype=torch.float64)
    metrics = {"update/offpolicy_staleness_mean": sum(ages) / n if n else 0.0}
    if d.offpolicy_weighting != "is":
        return w, metrics
    has = torch.tensor(list(has_behaviour), dtype=torch.bool)
    truncated, raw = offpolicy.pair_is_weights(log_ratio_c.detach().double().cpu(),
                                               log_ratio_r.detach().double().cpu(),
                                               d.is_truncate)                    # (N,)
    w[has] = truncated[has]
    weighted = [o for o, h in zip(origins, has_behaviour) if h]
    metrics.update(offpolicy.weight_metrics(truncated[has], raw[has], weighted, 0.0,
                                            d.is_truncate, "update/offpolicy"))
    metrics["update/offpolicy_fallback_n"] = float(n - len(weighted))
    return w, metrics
