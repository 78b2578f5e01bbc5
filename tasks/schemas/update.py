"""The policy update (`update:`): DPO / IPO / cDPO or PPO, with off-policy reuse."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class DPOParams:
    loss: Literal["sigmoid", "ipo", "cdpo"] = "sigmoid"  # sigmoid (DPO) | ipo (per-token mean log-
                                    #   ratios) | cdpo (conservative: label_smoothing)
    beta: float = 0.1               # KL strength of the implicit reward
    lr: float = 1e-4                # AdamW learning rate
    epochs: int = 1                 # passes over the pairs
    batch_size: int = 8             # pairs per step
    label_smoothing: float = 0.0    # cdpo only: the assumed judge label-flip rate eps, in [0, 0.5)
    sft_weight: float = 0.0         # SFT anchor (RPO): + w * per-token NLL of the chosen response
    pair_source: Literal["judge", "rm"] = "judge"  # who picks best vs worst of the K rollouts:
                                    #   judge (judge@k's pairs) | rm (this iteration's RM)
    offpolicy_mix: float = 0.0      # fraction of DPO pairs drawn from the previous pair pool;
                                    #   auto: 0.5 with offpolicy.source: import (imported pairs
                                    #   train the policy too), else 0
    offpolicy_weight: float = 1.0   # loss weight of those off-policy pairs (on-policy pairs: 1);
                                    #   with offpolicy_weighting: is, of those without sampler
                                    #   log-probs (imported pairs)
    offpolicy_weighting: Literal["fixed", "is"] = "fixed"  # fixed (every off-policy pair at
                                    #   offpolicy_weight) | is (min(is_truncate, the pair's
                                    #   length-normalised pi/mu), pi the policy the update starts
                                    #   from, mu the sampler that drew the pair; detached)
    is_truncate: float = 2.0        # is only: the truncation c of the importance weights, >= 1
    max_staleness: int = 0          # drop pool pairs drawn more than this many policy versions
                                    #   before the policy the update starts from (0 = keep all)
    offline_pairs: int = 0          # an offline iteration (rollout.offline): pool pairs it trains
                                    #   on (0 = all fresh ones): the pairs the loop's DPO trained
                                    #   on first (meta.pair_rank >= 0), then others by the seed
    precision: Literal["auto", "fp32", "bf16"] = "fp32"  # auto | fp32 | bf16 (autocast matmuls of
                                    #   the policy and reference passes); auto: bf16 only where the
                                    #   CPU runs bf16 matmuls natively


@dataclass(frozen=True)
class KLBudgetParams:
    """KL(policy || initial model) per response, kept while the update trains
    (tasks/policy/kl_budget.py: measured every check_every steps, training stopped at the last state
    within the target, or part of the way from it to the first past it)."""
    total: float = 0.0              # never more than this (0 = no budget); under gate.max_kl, so
                                    #   no candidate is refused for its KL
    per_iteration: float = 0.0      # at most this much more than the policy the iteration starts
                                    #   from (0 = only the total)
    check_every: int = 4            # optimiser steps between measurements
    n_prompts: int = 32             # distinct training prompts sampled per measurement (the
                                    #   estimate's noise falls as 1/sqrt(n))
    backtrack: int = 0              # past the target: this many more measurements, halving the
                                    #   way back from there to the last state within it (1/2, 1/4
                                    #   ...; 0 = that state itself)


@dataclass(frozen=True)
class ReuseParams:
    """Off-policy reuse of earlier iterations' rollouts, reweighted by truncated pi/mu."""
    iterations_back: int = 0        # 0 = on-policy only | N = also the rollouts of the N policy
                                    #   versions before (kept in each policy directory's replay)
    truncate: tuple[float, ...] = (0.0, 2.0)  # [lo, hi]: importance weights pi/mu are clipped to
                                    #   it
    level: Literal["token", "sequence"] = "sequence"  # sequence (one ratio per response) | token
                                    #   (one per token)
    max_staleness: int = 1          # drop reused samples drawn more than this many iterations ago


@dataclass(frozen=True)
class PPOParams:
    lr: float = 1e-4                # AdamW learning rate of the policy
    clip: float = 0.2               # ratio clip epsilon
    kl_coef: float = 0.05           # per-token KL penalty to the reference (in the reward or the
                                    #   loss: kl_mode)
    epochs: int = 2                 # passes over the rollouts (few: the data is on-policy only
                                    #   once)
    minibatch_size: int = 8         # rollouts per step
    gamma: float = 1.0              # GAE discount over response tokens
    lam: float = 0.95               # GAE lambda (1 = Monte Carlo returns, 0 = one-step TD)
    value_lr: float = 1e-3          # AdamW learning rate of the value head (a probe on the
                                    #   policy's states)
    value_clip: float = 0.2         # value clipping: V may move at most this far from the rollout-
                                    #   time V
    whiten_advantages: bool = True  # normalise advantages to mean 0, std 1 over the batch
    target_kl: float = 0.0          # early stop of the epochs once approx KL(pi_old || pi) per
                                    #   token exceeds it; 0 = off
    kl_mode: Literal["reward", "loss"] = "reward"  # KL to the reference: reward (a per-token
                                    #   penalty) | loss (a loss term)
    kl_estimator: Literal["k1", "k3"] = "k1"  # k1 (log pi/ref) | k3 ((r - 1) - log r, r = ref/pi;
                                    #   >= 0)
    no_eos: Literal["penalty", "drop", "keep"] = "keep"  # responses cut at max_new_tokens (no
                                    #   EOS): keep | penalty | drop
    no_eos_penalty: float = 1.0     # penalty only: subtracted from their normalised score
    reward_clip: float = 0.0        # clip normalised RM scores to [-c, c]; 0 = off
    value_reuse: bool = True        # the critic starts from the previous iteration's value head
    reuse: ReuseParams = field(default_factory=ReuseParams)


@dataclass(frozen=True)
class LoraParams:
    """LoRA adapters (PEFT, tasks/models/adapters.py): the policy trains low-rank updates of the
    named linear layers while its base weights stay frozen, and each iteration's policy
    directory holds the adapter alone, naming its base. r = 0 (the default, or the section left
    out) trains every weight. docs/algorithms.md#lora-adapters."""
    r: int = 0                      # adapter rank (0 = off: every weight of the policy trains)
    alpha: float = 16.0             # LoRA's alpha: the adapter's update B A is scaled by alpha / r
    dropout: float = 0.0            # dropout on the adapter's input while training, in [0, 1)
    gradient_checkpointing: bool = True  # recompute each block's activations in the backward
                                    #   instead of keeping them: the update holds the frozen base
                                    #   and about one block's activations (its peak memory, not
                                    #   its result; benchmarks/lora_cost.py measures both sides)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj",
                                       "gate_proj", "up_proj", "down_proj")  # the linear
                                    #   layers that get an adapter, by module name (default:
                                    #   the attention and MLP projections of Llama and Qwen2)


@dataclass(frozen=True)
class UpdateParams:
    algo: Literal["dpo", "ppo"] = "dpo"  # dpo (on this iteration's pairs) | ppo (the RM's reward)
    reference: Literal["initial", "previous"] = "initial"  # initial (iteration 0's model) |
                                    #   previous (the last iteration's policy)
    max_length: int = 96            # prompt + response tokens (DPO pairs, PPO's scoring)
    processes: int = 1              # > 1: DPO or PPO on N ranks under torchrun (DDP, the same
                                    #   global batch)
    dpo: DPOParams = field(default_factory=DPOParams)
    ppo: PPOParams = field(default_factory=PPOParams)
    kl_budget: KLBudgetParams = field(default_factory=KLBudgetParams)  # DPO: early stop at a KL
                                    #   target (PPO keeps its kl_coef and target_kl)
    lora: LoraParams = field(default_factory=LoraParams)  # LoRA adapters instead of a full
                                    #   fine-tune (r > 0)
