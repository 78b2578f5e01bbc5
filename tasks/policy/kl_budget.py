"""A KL budget the update keeps: KL(policy || initial model) per response, measured while the
policy trains, and training stopped before it would leave the budget.

The reward model and the judge are trusted only near the data they were fitted on; the KL to
the initial model is how far the policy has gone from it. The gate refuses a candidate past
`gate.max_kl`, but a refusal after the fact wastes the iteration (and a loop that starts each
tick from the champion would keep overshooting from the same place). So the update measures
the same quantity the evaluation does (the Monte-Carlo k1 estimate: mean over the policy's own
samples of sum_t log pi - log pi_ref, sampled with `evaluate.generation`) on a few of this
iteration's training prompts every `check_every` optimiser steps, and stops at the last state
that was within the target (its weights restored): early stopping at a target KL, as in PPO's
`target_kl` (Schulman et al. 2017; OpenAI Spinning Up), applied to the distance from the
reference rather than from the previous step.

A check that finds the policy past the target would throw away every step since the last one
within it, however little it overshot. With `backtrack: n` the guard first tries the weights
half way back from the state past the target to that last state within it, then a quarter of
the way, ... (n measurements at most), and keeps the first within the target: the backtracking
line search of TRPO (Schulman et al. 2015) on the straight line between the two states, whose
KL to the reference grows with the distance along it.

Sampled untempered (`evaluate.generation` at temperature 1 without a nucleus), the policy's
log-probs are the sampler's own, stored with each sample (as evaluate reads them): a
measurement runs the reference's forward pass alone. Sampled otherwise, the policy's are
computed by a forward pass at temperature 1.

The target of iteration k: the KL of the policy it starts from (measured the same way before
the first step; 0 without measuring when it starts from the initial model itself, `start_known`)
plus `per_iteration`, and never more than `total`. With `total` set under
`gate.max_kl`, every candidate is within what the gate accepts, whatever its start; near the
total, the loop moves in smaller steps rather than overshooting and being refused.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tasks.models import lm, sampling
from tasks.schemas.generation import GenerationParams
from tasks.schemas.update import KLBudgetParams


@dataclass
class KLGuard:
    """Measures KL(policy || ref) on fixed prompts; `within()` after each chunk of steps."""
    policy: torch.nn.Module
    ref: torch.nn.Module
    prompts: Sequence[Sequence[int]]      # token ids, distinct training prompts
    gen: GenerationParams
    budget: KLBudgetParams
    eos_id: int
    pad_id: int
    rng: torch.Generator
    start_known: float | None = None      # the start's KL, not measured (0: the initial model)
    start: float = float("nan")
    target: float = float("nan")
    measured: list[tuple[float, float]] = field(default_factory=list)  # (step, KL)

    def measure(self) -> float:
        """The k1 estimate on the guard's prompts, the policy sampled as it is now."""
        was_training = self.policy.training
        self.policy.eval()
        with torch.no_grad():
            samples = sampling.sample(self.policy, self.prompts, batch_size=self.gen.batch_size,
                                      max_new_tokens=self.gen.max_new_tokens, eos_id=self.eos_id,
                                      pad_id=self.pad_id, temperature=self.gen.temperature,
                                      top_p=self.gen.top_p, generator=self.rng)
            total = 0.0
            for s in range(0, len(samples), 32):
                chunk = samples[s: s + 32]
                prompts = [self.prompts[s + i] for i in range(len(chunk))]
                responses = [x.response_ids for x in chunk]
                ref, mask = lm.response_logprobs(self.ref, prompts, responses, self.pad_id)
                pi = (lm.padded([x.logprobs for x in chunk])[0].to(ref.device)
                      if self.gen.untempered else
                      lm.response_logprobs(self.policy, prompts, responses, self.pad_id)[0])
                total += float(((pi.float() - ref.float()) * mask).sum())
        if was_training:
            self.policy.train()
        return total / max(len(samples), 1)

    def begin(self) -> None:
        """The start's KL (measured unless known) and the iteration's target."""
        self.start = self.measure() if self.start_known is None else self.start_known
        self.measured.append((0, self.start))
        b = self.budget
        self.target = min(self.start + b.per_iteration if b.per_iteration > 0 else b.total,
                          b.total)

    def within(self, step: float) -> bool:
        kl = self.measure()
        self.measured.append((step, kl))
        return kl <= self.target

    def metrics(self, stopped_at: int | None) -> dict[str, float]:
        """The budget's record: start, target, the last measurement, the kept state's KL and
        step (the last measurement within the target; a state part of the way between two
        steps counts that part of the steps), whether training was stopped, how many
        measurements were taken (a known start is not one) and how many of them backtracked."""
        step, kl = next(((s, k) for s, k in reversed(self.measured)
                         if k <= self.target and (stopped_at is None or s < stopped_at)),
                        (0, self.start))
        return {"update/kl_start": self.start, "update/kl_target": self.target,
                "update/kl_last": self.measured[-1][1], "update/kl_kept": kl,
                "update/steps_kept": float(step),
                "update/kl_stopped": float(stopped_at is not None),
                "update/kl_checks": float(len(self.measured) - (self.start_known is not None)),
                "update/kl_backtracks": float(sum(b[0] <= a[0] for a, b in   # back, not on
                                                  zip(self.measured, self.measured[1:])))}


def guard_prompts(prompt_ids: Sequence[Sequence[int]], n: int) -> list[tuple[int, ...]]:
    """The first n distinct prompts (in the pairs' order): a fixed set for every measurement."""
    seen: dict[tuple[int, ...], None] = {}
    for ids in prompt_ids:
        seen.setdefault(tuple(ids), None)
        if len(seen) == n:
            break
    return list(seen)


class Snapshot:
    """The policy's trained weights (those that require grad: every weight of a full
    fine-tune, a LoRA policy's adapter alone) at the last measurement within the target and
    its step, restored on a stop."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy = policy
        self.state = {k: q.detach().clone() for k, q in policy.named_parameters()
                      if q.requires_grad}
        self.step: float = 0

    def take(self, step: float) -> None:
        """Keep the weights as they are, copied into the snapshot's own tensors (a fresh clone
        beside the old one would hold a full policy's weights three times for a moment)."""
        with torch.no_grad():
            for k, q in self.policy.named_parameters():
                if k in self.state:
                    self.state[k].copy_(q)
        self.step = step

    def restore(self) -> None:
        with torch.no_grad():
            for k, q in self.policy.named_parameters():
                if k in self.state:
                    q.copy_(self.state[k])

    def halve(self) -> None:
        """The weights half way from where they are back to the kept ones, in place (no copy
        of the state past the target: a 7B policy's weights are not held three times)."""
        with torch.no_grad():
            for k, q in self.policy.named_parameters():
                if k in self.state:
                    q.lerp_(self.state[k], 0.5)


def check(guard: KLGuard, snapshot: Snapshot, step: int) -> bool:
    """The guard's check after `step` optimiser steps: True when training must stop. Within
    the target, the weights are kept; past it, `backtrack` states between them and the kept
    ones are measured in turn (1/2, 1/4, ... of the way from the kept ones), the first within
    the target stays, and with none the kept weights are restored."""
    if guard.within(step):
        snapshot.take(step)
        return False
    fraction = 1.0
    for _ in range(guard.budget.backtrack):
        fraction /= 2
        snapshot.halve()
        if guard.within(snapshot.step + fraction * (step - snapshot.step)):
            return True
    snapshot.restore()
    return True
