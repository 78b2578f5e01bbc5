"""The reward model (`train_rm:`): Bradley-Terry fine-tuning or the probe."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TrainRMParams:
    lr: float = 1e-3                # AdamW learning rate (fine-tuning)
    epochs: int = 2                 # fine-tuning passes over the pair pool (after the probe, with
                                    #   head_init: probe; 0 = the probe alone)
    batch_size: int = 16            # pairs per step (fine-tuning), about: whole prompts, as many
                                    #   as come nearest (reward_model.prompt_batches)
    heldout_fraction: float = 0.2   # share of prompts held out for pairwise accuracy
    max_length: int = 96            # prompt + response tokens
    weight_decay: float = 0.0       # AdamW weight decay
    margin: float = 0.0             # Bradley-Terry margin m: -log sigmoid(r_c - r_r - m)
    ensemble: int = 1               # K reward models differing by seed (head init, data order);
                                    #   K > 1: their disagreement feeds the audit queue and the
                                    #   monitors
    audit_top_n: int = 8            # audit queue: the new pairs the ensemble disagrees on most
                                    #   (K > 1)
    audit_random_n: int = 8         # audit queue: plus a seeded random sample of new judge labels
    precision: Literal["auto", "fp32", "bf16"] = "fp32"  # auto | fp32 | bf16 (autocast matmuls,
                                    #   training and scoring); auto: bf16 only where the CPU runs
                                    #   bf16 matmuls natively
    num_layers: int = 0             # backbone blocks the RM keeps, the first N (0 = all)
    num_layers_grid: tuple[int, ...] = ()  # head_init probe: N chosen from these with the probe's
                                    #   L2 by 5-fold CV over the training prompts, before any
                                    #   fine-tuning epochs (empty, or fewer than 5 training
                                    #   prompts: num_layers as is)
    freeze_layers: int = 0          # fine-tuning keeps the embeddings and the backbone's first N
                                    #   blocks as loaded (partial fine-tuning: no backward pass
                                    #   through them, no optimiser state for them); 0 = every weight
                                    #   trains. At most num_layers - 1 (the last block trains)
    freeze_embeddings: bool = False  # fine-tuning keeps the token embeddings as loaded (with
                                    #   freeze_layers > 0 they are kept anyway): no optimiser
                                    #   state for the vocabulary's rows, most of which no batch
                                    #   reads
    pooling: Literal["last", "mean"] = "last"  # what the head reads: last (HF's last token) | mean
                                    #   (the mean state over the response)
    head_init: Literal["random", "probe"] = "random"  # random | probe (the head fitted first on
                                    #   frozen features by logistic regression)
    probe_l2: float = 0.1           # probe: L2 strength on standardised features (no grid, or
                                    #   fewer than 5 prompts)
    probe_l2_grid: tuple[float, ...] = ()  # probe: the L2 chosen from these by 5-fold CV over the
                                    #   training prompts (log-loss; held-out pairs unread; empty:
                                    #   probe_l2 as is)
    window: int = 0                 # on-policy pairs of the newest N iterations the pool holds
                                    #   (along the chain of prev) train the RM; older ones age
                                    #   out, off-policy (cold-start, imported) and audited pairs
                                    #   stay; 0 = every pair. Bounds train_rm's time over ticks
                                    #   and keeps it on where the policy is
    stats_pairs: int = 256          # training pairs scored once training ends, evenly spaced over
                                    #   the pool's order (its sources in proportion): the reward's
                                    #   normalisation stats (mean, std over their responses; PPO
                                    #   reads them) and rm/train_accuracy; 0 = every training pair
    processes: int = 1              # > 1: fine-tuning epochs on N ranks under torchrun (DDP, the
                                    #   same global batch)
