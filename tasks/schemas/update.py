"""The policy update (`update:`): DPO / IPO / cDPO or PPO, with off-policy reuse."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class DPOParams:
    loss: Literal["sigmoid", "ipo", "cdpo"] = "sigmoid"
    beta: float = 0.1
    lr: float = 1e-4
    epochs: int = 1
    batch_size: int = 8
    label_smoothing: float = 0.0    # cdpo only: assumed label-flip rate eps, in [0, 0.5)
    sft_weight: float = 0.0         # + w * per-token NLL of the chosen response (an SFT anchor)
    pair_source: Literal["judge", "rm"] = "judge"   # who picks best vs worst of the K rollouts
    offpolicy_mix: float = 0.0      # fraction of training pairs drawn from the previous pool
    offpolicy_weight: float = 1.0   # loss weight of those off-policy pairs
    precision: Literal["auto", "fp32", "bf16"] = "fp32"  # bf16: autocast matmuls (policy and
                                    # reference); auto: bf16 where the CPU has native bf16 matmuls


@dataclass(frozen=True)
class ReuseParams:
    """Off-policy reuse of earlier iterations' rollouts, reweighted by truncated pi/mu."""
    iterations_back: int = 0        # 0: on-policy only; 1: also the previous iteration's rollouts
    truncate: tuple[float, ...] = (0.0, 2.0)   # [lo, hi] the importance weights are clipped to
    level: Literal["token", "sequence"] = "sequence"   # per-token ratios or one per response
    max_staleness: int = 1          # drop reused samples drawn more iterations ago than this


@dataclass(frozen=True)
class PPOParams:
    lr: float = 1e-4
    clip: float = 0.2
    kl_coef: float = 0.05
    epochs: int = 2
    minibatch_size: int = 8
    gamma: float = 1.0              # GAE discount over response tokens
    lam: float = 0.95               # GAE lambda
    value_lr: float = 1e-3          # AdamW learning rate of the value head
    value_clip: float = 0.2         # value clipping range around the rollout-time values
    whiten_advantages: bool = True  # normalise advantages over the batch
    target_kl: float = 0.0          # stop the epochs once approx KL(pi_old || pi) exceeds it; 0 = off
    kl_mode: Literal["reward", "loss"] = "reward"   # KL to the reference: in the reward or the loss
    kl_estimator: Literal["k1", "k3"] = "k1"        # the per-token KL estimator used for it
    no_eos: Literal["penalty", "drop", "keep"] = "keep"   # responses truncated without EOS
    no_eos_penalty: float = 1.0     # penalty only: subtracted from their normalised score
    reward_clip: float = 0.0        # clip normalised scores to [-c, c]; 0 = off
    value_reuse: bool = True        # start the value head from the previous iteration's
    reuse: ReuseParams = field(default_factory=ReuseParams)


@dataclass(frozen=True)
class UpdateParams:
    algo: Literal["dpo", "ppo"] = "dpo"
    reference: Literal["initial", "previous"] = "initial"
    max_length: int = 96
    processes: int = 1              # > 1: the update (DPO, PPO) on N ranks under torchrun (DDP)
    dpo: DPOParams = field(default_factory=DPOParams)
    ppo: PPOParams = field(default_factory=PPOParams)
