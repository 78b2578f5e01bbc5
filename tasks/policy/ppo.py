"""PPO with a critic: GAE over response tokens, clipped surrogate, clipped value loss, KL to the
reference in the reward or the loss, early stop on approximate KL, and off-policy reuse of
earlier rollouts reweighted by truncated importance ratios (tasks/functional/offpolicy.py).

pi_old is the sampler's stored per-token log-probs for this iteration's rollouts. For a reused
rollout (sampled by an older behaviour policy mu, up to `reuse.iterations_back` policy versions
before) pi_old is the policy at the start of this update, and the sample carries the truncated
weight clip(pi_old / mu, lo, hi) against its own sampler's stored log-probs on its advantage
(the decoupled form of PPO, Hilton et al. 2021).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tasks.core import layout, progress
from tasks.core.errors import InputError
from tasks.data.records import Rollout
from tasks.functional import offpolicy
from tasks.functional.losses import kl_k1, kl_k3, ppo_clip_loss, ppo_value_loss, whiten
from tasks.models import lm
from tasks.policy.value_head import ValueHead, logprobs_and_values
from tasks.runtime.distributed import SINGLE, Group, record_losses
from tasks.schemas.update import PPOParams

REPLAY_FILE = layout.REPLAY_ROLLOUTS
Staleness = Callable[[int], int]   # iteration of origin -> policy versions back (0: on-policy)
KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k3": kl_k3}


def _pad(rows: Sequence[Sequence[float]], device: torch.device | str = "cpu") -> Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [0.0] * (width - len(r)) for r in rows], device=device)


def shape_scores(scores: Tensor, finished: Sequence[bool], p: PPOParams) -> tuple[Tensor, Tensor]:
    """Normalised RM scores (B,) -> (clipped, no-EOS-handled scores (B,), keep mask (B,) bool).

    reward_clip c > 0 clips to [-c, c]; then responses without EOS are kept as they are
    (`keep`), lose `no_eos_penalty` (`penalty`) or are dropped from the batch (`drop`).
    """
    out = scores.clamp(-p.reward_clip, p.reward_clip) if p.reward_clip > 0 else scores.clone()
    no_eos = ~torch.tensor(list(finished), dtype=torch.bool, device=scores.device)
    if p.no_eos == "penalty":
        out[no_eos] -= p.no_eos_penalty
    keep = ~no_eos if p.no_eos == "drop" else torch.ones_like(no_eos)
    return out, keep


def token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """r_t = -kl_coef * kl_t, plus the score on the last response token.

    scores: (B,); kl, mask: (B, T). Returns (B, T), zero outside the mask.
    """
    rewards = -kl_coef * kl * mask                                         # (B, T)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(len(scores), device=scores.device), last] += scores   # score at EOS / cut
    return rewards


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
        ) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded responses (Schulman et al. 2016).

    rewards, values, mask: (B, T). The state after the last response token is terminal
    (V = 0). Returns advantages and returns = advantages + values, both (B, T), 0 off-mask.
    """
    adv = torch.zeros_like(rewards)
    next_adv = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]        # TD error delta_t
        adv[:, t] = (delta + gamma * lam * next_adv) * m                 # A_t = d_t + g l A_t+1
        next_adv, next_value = adv[:, t], values[:, t] * m
    return adv, (adv + values) * mask


@dataclass(frozen=True)
class Experience:
    """A batch fixed before the epochs; every tensor is (B, T) over response tokens."""
    prompts: list[tuple[int, ...]]
    responses: list[tuple[int, ...]]
    old_logprobs: Tensor          # pi_old
    ref_logprobs: Tensor
    mask: Tensor
    old_values: Tensor            # V at rollout time (value clipping anchor)
    advantages: Tensor            # whitened (if on) and multiplied by the IS weights
    returns: Tensor               # value targets


@torch.no_grad()
def _forward_all(model: torch.nn.Module, head: ValueHead | None, rollouts: Sequence[Rollout],
                 pad_id: int, temperature: float, chunk: int, group: Group = SINGLE
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """No-grad log-probs, values (zeros without a head) and mask for all rollouts, (B, T). On
    several ranks each computes every world-th chunk (the chunks of one process) and shares it."""
    width = max(len(r.response_ids) for r in rollouts)
    device = next(model.parameters()).device
    parts = []
    for j, s in enumerate(range(0, len(rollouts), chunk)):
        rs = rollouts[s: s + chunk]
        out: list[Tensor | None] = [None, None, None]
        if group.owns(j):
            args = ([r.prompt_ids for r in rs], [r.response_ids for r in rs], pad_id, temperature)
            if head is None:
                lp, m = lm.response_logprobs(model, *args)
                v = torch.zeros_like(lp)
            else:
                lp, v, m = logprobs_and_values(model, head, *args)
            out = [torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in (lp, v, m)]
        parts.append([group.share(x, (len(rs), width), j, device) for x in out])
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def sampled_temperature(rollouts: Sequence[Rollout]) -> float:
    """The one temperature a batch's rollouts were drawn at, from each one's stored sampling
    settings: pi_old, pi and the reference are all scored at it, so a batch that mixes
    temperatures (a reused iteration sampled at another one) is refused. An empty batch
    scores nothing: 1.0."""
    temps = sorted({r.sampling.temperature for r in rollouts})
    if len(temps) > 1:
        raise InputError(f"PPO's rollouts were sampled at different temperatures {temps}: "
                         "pi_old and pi are scored at one; reuse "
                         "(update.ppo.reuse.iterations_back: 1) needs the previous iteration "
                         "sampled at this one's rollout.generation.temperature")
    return temps[0] if temps else 1.0


def make_experience(policy: torch.nn.Module, head: ValueHead, ref: torch.nn.Module,
                    rollouts: Sequence[Rollout], scores: Tensor, n_reused: int,
                    p: PPOParams, pad_id: int, it: int, group: Group = SINGLE,
                    staleness: Staleness | None = None) -> tuple[Experience, dict[str, float]]:
    """Fix pi_old, values, rewards, advantages and returns for a batch whose last n_reused
    rollouts are reused off-policy samples; returns the batch and its metrics (the same on
    every rank: what one rank computed is shared). staleness: as train_ppo's."""
    temperature = sampled_temperature(rollouts)
    chunk = max(p.minibatch_size, 1)
    start_logprobs, values, mask = _forward_all(policy, head, rollouts, pad_id, temperature, chunk,
                                                group)
    ref_logprobs, _, _ = _forward_all(ref.eval(), None, rollouts, pad_id, temperature, chunk,
                                      group)
    stored = _pad([r.logprobs for r in rollouts], mask.device)             # (B, T) behaviour mu
    n_fresh = len(rollouts) - n_reused
    old_logprobs = torch.cat([stored[:n_fresh], start_logprobs[n_fresh:]])  # pi_old
    weights, metrics = torch.ones_like(mask), {}
    if n_reused:
        lo, hi = p.reuse.truncate
        w, raw = offpolicy.truncated_is_weights(start_logprobs[n_fresh:], stored[n_fresh:],
                                                mask[n_fresh:], lo, hi, p.reuse.level)
        weights[n_fresh:] = w                                              # w~ = clip(pi/mu)
        origins = [r.iteration for r in rollouts[n_fresh:]]
        ages = [(staleness or linear(it))(i) for i in origins]
        metrics.update(offpolicy.reuse_metrics(w, raw, mask[n_fresh:], ages, origins, lo, hi,
                                               p.reuse.level))
    kls = {name: est(old_logprobs, ref_logprobs) * mask for name, est in KL_ESTIMATORS.items()}
    in_reward = kls[p.kl_estimator] if p.kl_mode == "reward" else torch.zeros_like(mask)
    rewards = token_rewards(scores, in_reward, mask, p.kl_coef)            # (B, T)
    adv, returns = gae(rewards, values, mask, p.gamma, p.lam)
    adv = whiten(adv, mask) if p.whiten_advantages else adv
    n = mask.sum().clamp(min=1)
    metrics.update({f"update/kl_{k}_per_token": float(v.sum() / n) for k, v in kls.items()})
    metrics["update/kl_to_ref_per_token"] = metrics[f"update/kl_{p.kl_estimator}_per_token"]
    metrics["update/value_loss_step0"] = float(ppo_value_loss(values, values, returns, mask,
                                                              p.value_clip)[0])
    exp = Experience([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                     old_logprobs, ref_logprobs, mask, values, adv * weights, returns)
    return exp, metrics


STAT_KEYS = ("loss", "pg_loss", "value_loss", "clipfrac", "value_clipfrac", "approx_kl",
             "kl_k1", "kl_k3")


def minibatch_loss(policy: torch.nn.Module, head: ValueHead, exp: Experience, idx: Tensor,
                   p: PPOParams, pad_id: int, temperature: float, group: Group = SINGLE
                   ) -> tuple[Tensor | None, dict[str, float]]:
    """PPO loss of one minibatch: clipped surrogate + clipped value loss (+ KL if in the loss).

    Also returns the minibatch's approx KL(pi_old || pi) (k3, before the step) and stats.
    idx: (b,) on the CPU (drawn by the CPU generator), moved to the batch's device to index it.
    On several ranks each takes its shard of idx: its loss is its tokens' sum over the whole
    minibatch's token count, so the losses (and gradients) summed over ranks are the
    one-process token means; the stats are those means on every rank. A rank with an empty
    shard returns no loss.
    """
    shard = group.shard(idx)
    n_all = exp.mask[idx.to(exp.mask.device)].sum().clamp(min=1)   # the minibatch's tokens
    if len(shard) == 0:
        zero = torch.zeros((), device=exp.mask.device)
        return None, _global_stats(group, dict.fromkeys(STAT_KEYS, zero), 0.0, n_all)
    rows = shard.tolist()
    logprobs, values, m = logprobs_and_values(policy, head, [exp.prompts[i] for i in rows],
                                              [exp.responses[i] for i in rows], pad_id,
                                              temperature)
    w, at = m.shape[1], shard.to(exp.mask.device)
    old, n = exp.old_logprobs[at, :w], m.sum().clamp(min=1)
    pg_loss, clipfrac = ppo_clip_loss(logprobs, old, exp.advantages[at, :w], m, p.clip)
    v_loss, vclipfrac = ppo_value_loss(values, exp.old_values[at, :w], exp.returns[at, :w],
                                       m, p.value_clip)
    ref = exp.ref_logprobs[at, :w]
    kl_now = {k: (est(logprobs, ref) * m).sum() / n for k, est in KL_ESTIMATORS.items()}
    loss = pg_loss + v_loss
    if p.kl_mode == "loss":
        loss = loss + p.kl_coef * kl_now[p.kl_estimator]                  # + beta * KL(pi||ref)
    with torch.no_grad():
        approx_kl = (kl_k3(old, logprobs) * m).sum() / n                  # KL(pi_old || pi)
    local = {"loss": loss, "pg_loss": pg_loss, "value_loss": v_loss, "clipfrac": clipfrac,
             "value_clipfrac": vclipfrac, "approx_kl": approx_kl, "kl_k1": kl_now["k1"],
             "kl_k3": kl_now["k3"]}
    if group.world == 1:
        return loss, {k: float(v.detach()) for k, v in local.items()}
    return loss * (m.sum() / n_all), _global_stats(group, local, float(m.sum()), n_all)


def _global_stats(group: Group, local: dict[str, Tensor], n_local: float,
                  n_all: Tensor) -> dict[str, float]:
    """Token means over the whole minibatch (n_all tokens) from each rank's means over its
    n_local tokens."""
    return dict(zip(STAT_KEYS, group.means([local[k].detach() * n_local for k in STAT_KEYS],
                                           float(n_all))))


def train_ppo(policy: torch.nn.Module, head: ValueHead, ref: torch.nn.Module,
              rollouts: Sequence[Rollout], scores: Tensor, *, p: PPOParams, pad_id: int,
              rng: torch.Generator, it: int = 0, reused: Sequence[Rollout] = (),
              reused_scores: Tensor | None = None, group: Group = SINGLE,
              curve: list[dict[str, float]] | None = None,
              staleness: Staleness | None = None) -> dict[str, float]:
    """Optimise policy and value head in place on this iteration's rollouts (plus reused ones
    from earlier iterations, scores (B,) normalised like `scores`); returns `update/` metrics,
    and appends each minibatch step's statistics (with the learning rate) to `curve`.
    staleness: policy versions back of a rollout by its iteration of origin (default it - i, a
    linear lineage); reused rollouts beyond `reuse_window(p)` are dropped and counted.
    On several ranks (`group`) every rank draws the same minibatches, takes its shard of each
    and the gradients are summed (tasks/runtime/distributed.py): the one-process steps."""
    t0 = time.perf_counter()
    ages = staleness or linear(it)
    rs, sc, n_reused, n_stale = _select(list(rollouts), scores, list(reused), reused_scores, p,
                                        it, ages)
    exp, metrics = make_experience(policy, head, ref, rs, sc, n_reused, p, pad_id, it, group,
                                   ages)
    if reused:
        metrics["update/reuse_dropped_stale"] = float(n_stale)
    temperature = sampled_temperature(rs)
    opt = torch.optim.AdamW([{"params": list(policy.parameters()), "lr": p.lr},
                             {"params": list(head.parameters()), "lr": p.value_lr}],
                            weight_decay=0.0)
    stats: list[dict[str, float]] = []
    epochs_run, stopped = 0, False
    pg = progress.track(p.epochs, "epochs", "epochs")
    policy.train()
    for _ in range(p.epochs):
        epochs_run += 1
        for idx in prompt_minibatches(exp.prompts, p.minibatch_size, rng):
            loss, st = minibatch_loss(policy, head, exp, idx, p, pad_id, temperature, group)
            if p.target_kl > 0 and st["approx_kl"] > p.target_kl:
                stopped = True                                             # early stop
                break                                      # every rank: the same global stat
            opt.zero_grad()
            if loss is not None:
                loss.backward()
            group.sum_grads([*policy.parameters(), *head.parameters()])
            opt.step()
            stats.append(st)
            if curve is not None:
                curve.append({**st, "lr": opt.param_groups[0]["lr"]})
        pg.step(1)
        if stopped:
            break
    pg.close()
    policy.eval()
    record_losses(group, [st["loss"] for st in stats], time.perf_counter() - t0)
    metrics.update(_summary(stats, epochs_run, stopped, len(rs), n_reused, sc))
    return metrics


def prompt_minibatches(prompts: Sequence[Sequence[int]], size: int,
                       rng: torch.Generator) -> list[Tensor]:
    """A random partition of the batch into minibatches of whole prompt groups (the K
    rollouts of a prompt stay together, so a minibatch's forward computes each prompt once,
    `lm.pack`): groups in random order, cut once a minibatch holds at least `size` rollouts."""
    members = lm.prompt_groups(prompts)
    out: list[Tensor] = []
    current: list[int] = []
    for g in torch.randperm(len(members), generator=rng).tolist():   # cpu: its generator
        current += members[g]
        if len(current) >= size:
            out.append(torch.tensor(current))   # cpu: indices drawn by the CPU generator
            current = []
    if current:
        out.append(torch.tensor(current))       # cpu: indices drawn by the CPU generator
    return out


def linear(it: int) -> Staleness:
    """Staleness on a linear lineage (iteration k starts from k-1): it - origin."""
    return lambda origin: it - origin


def reuse_window(p: PPOParams) -> int:
    """How many policy versions back a rollout may be reused: min(iterations_back,
    max_staleness) (0 = none)."""
    return min(p.reuse.iterations_back, p.reuse.max_staleness)


def replay_for_next(rollouts: Sequence[Rollout], reused: Sequence[Rollout], p: PPOParams,
                    staleness: Staleness) -> list[Rollout]:
    """What this update keeps for the next one's reuse: its own rollouts (1 version back
    there) and the reused ones still within the window there (staleness + 1 <= window)."""
    return list(rollouts) + [r for r in reused if staleness(r.iteration) + 1 <= reuse_window(p)]


def _select(rollouts: list[Rollout], scores: Tensor, reused: list[Rollout],
            reused_scores: Tensor | None, p: PPOParams, it: int, staleness: Staleness
            ) -> tuple[list[Rollout], Tensor, int, int]:
    """This iteration's rollouts, then the reused ones young enough (1 to reuse_window(p)
    versions back); no_eos/reward shaping. Also returns how many reused were too stale."""
    ok = [r.iteration != it and 1 <= staleness(r.iteration) <= reuse_window(p) for r in reused]
    old_sc = reused_scores[torch.tensor(ok, dtype=torch.bool, device=reused_scores.device)] \
        if reused and reused_scores is not None else scores[:0]
    reused = [r for r, keep in zip(reused, ok) if keep]
    rs, raw = rollouts + reused, torch.cat([scores, old_sc])
    shaped, keep = shape_scores(raw, [r.finished for r in rs], p)
    kept = [r for r, k in zip(rs, keep.tolist()) if k]
    if not kept:
        raise InputError("no rollouts left to train on (every response lacked EOS and "
                         "no_eos is drop)")
    return kept, shaped[keep], int(keep[len(rollouts):].sum()), len(ok) - sum(ok)


def _summary(stats: list[dict[str, float]], epochs_run: int, stopped: bool, n: int,
             n_reused: int, scores: Tensor) -> dict[str, float]:
    out = {"update/steps": float(len(stats)), "update/epochs_run": float(epochs_run),
           "update/early_stopped": float(stopped), "update/n_rollouts": float(n - n_reused),
           "update/n_reused": float(n_reused), "update/score_mean": float(scores.mean())}
    keys = ("loss", "value_loss", "approx_kl", "kl_k1", "kl_k3", "clipfrac", "value_clipfrac")
    last = stats[-1] if stats else dict.fromkeys(keys, 0.0)
    mean = {k: sum(s[k] for s in stats) / len(stats) if stats else 0.0 for k in keys}
    out.update({"update/loss_last": last["loss"], "update/value_loss_last": last["value_loss"],
                "update/approx_kl_last": last["approx_kl"], "update/kl_k1_last": last["kl_k1"],
                "update/kl_k3_last": last["kl_k3"], "update/clipfrac_mean": mean["clipfrac"],
                "update/value_clipfrac_mean": mean["value_clipfrac"]})
    return out
