"""Bradley-Terry reward model: a scalar head on a transformer backbone.

The reward of (prompt, response) is the head's output at the last real token of the
chat-rendered sequence. Loading, scoring and training live here; `train_rm` is the stage edge.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import Tensor

from tasks import lm
from tasks.losses import bradley_terry_loss
from tasks.params import TrainRMParams
from tasks.records import PreferencePair, Prompt

STATS_FILE = "reward_stats.json"


@dataclass(frozen=True)
class EncodedPair:
    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]


def init_reward_model(backbone_dir: Path) -> transformers.PreTrainedModel:
    """A fresh scalar head (num_labels=1) on the backbone's pretrained weights."""
    return transformers.AutoModelForSequenceClassification.from_pretrained(
        lm.check_model_dir(backbone_dir), num_labels=1, dtype=torch.float32)


def load_reward_model(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForSequenceClassification.from_pretrained(
        lm.check_model_dir(path), dtype=torch.float32).eval()


def rewards(model: transformers.PreTrainedModel, prompts: Sequence[Sequence[int]],
            responses: Sequence[Sequence[int]], pad_id: int) -> Tensor:
    """r(x, y) for each pair of ids, shape (B,). Scored at the last real token (mask-based,
    so a pad id equal to EOS cannot move the read-out position)."""
    ids, mask = lm.pad_right([list(p) + list(r) for p, r in zip(prompts, responses)], pad_id)
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=ids, attention_mask=mask).last_hidden_state     # (B, T, H)
    last = mask.sum(-1) - 1                                                     # (B,)
    h_last = hidden[torch.arange(ids.shape[0]), last]                           # (B, H)
    return model.score(h_last).squeeze(-1)                                      # (B,)


def encode_pairs(tok: transformers.PreTrainedTokenizerBase, pairs: Sequence[PreferencePair],
                 max_prompt_tokens: int, max_length: int) -> list[EncodedPair]:
    out = []
    for p in pairs:
        prompt_ids = lm.render_prompt(tok, p.prompt, max_prompt_tokens)
        room = max(max_length - len(prompt_ids), 1)
        out.append(EncodedPair(tuple(prompt_ids), tuple(lm.encode_response(tok, p.chosen, room)),
                               tuple(lm.encode_response(tok, p.rejected, room))))
    return out


def heldout_split(pairs: Sequence[PreferencePair], fraction: float
                  ) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Deterministic split by prompt (a prompt's pairs stay on one side)."""
    def bucket(prompt: Prompt) -> float:
        key = json.dumps([[m.role, m.content] for m in prompt]).encode()
        return int(hashlib.md5(key).hexdigest()[:8], 16) / 0xFFFFFFFF
    train = [p for p in pairs if bucket(p.prompt) >= fraction]
    held = [p for p in pairs if bucket(p.prompt) < fraction]
    if not held and len(train) > 1:          # tiny pools: still measure on something unseen
        held, train = train[-1:], train[:-1]
    return train, held


def _margins(model: transformers.PreTrainedModel, batch: Sequence[EncodedPair],
             pad_id: int) -> Tensor:
    prompts = [e.prompt_ids for e in batch]
    r_c = rewards(model, prompts, [e.chosen_ids for e in batch], pad_id)
    r_r = rewards(model, prompts, [e.rejected_ids for e in batch], pad_id)
    return r_c - r_r


@torch.no_grad()
def pairwise_accuracy(model: transformers.PreTrainedModel, data: Sequence[EncodedPair],
                      pad_id: int, batch_size: int = 32) -> float:
    if not data:
        return float("nan")
    model.eval()
    correct = 0
    for s in range(0, len(data), batch_size):
        correct += int((_margins(model, data[s: s + batch_size], pad_id) > 0).sum())
    return correct / len(data)


def train_reward(model: transformers.PreTrainedModel, train: Sequence[EncodedPair],
                 heldout: Sequence[EncodedPair], p: TrainRMParams, pad_id: int,
                 rng: torch.Generator) -> dict[str, float]:
    """Fit the Bradley-Terry loss in place; returns metrics under the `rm/` namespace."""
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=p.weight_decay)
    losses: list[float] = []
    for _ in range(p.epochs):
        model.train()
        order = torch.randperm(len(train), generator=rng).tolist()
        for s in range(0, len(order), p.batch_size):
            batch = [train[i] for i in order[s: s + p.batch_size]]
            margins = _margins(model, batch, pad_id)
            loss = bradley_terry_loss(margins, torch.zeros_like(margins)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return {
        "rm/loss_first": losses[0] if losses else float("nan"),
        "rm/loss_last": losses[-1] if losses else float("nan"),
        "rm/train_accuracy": pairwise_accuracy(model, train, pad_id),
        "rm/accuracy": pairwise_accuracy(model, heldout, pad_id),
        "rm/n_train": float(len(train)), "rm/n_heldout": float(len(heldout)),
        "rm/steps": float(len(losses)),
    }


@torch.no_grad()
def reward_stats(model: transformers.PreTrainedModel, data: Sequence[EncodedPair],
                 pad_id: int) -> dict[str, float]:
    """Mean and std of rewards over the training responses (stored to normalise later)."""
    model.eval()
    rs = [rewards(model, [e.prompt_ids] * 2, [e.chosen_ids, e.rejected_ids], pad_id)
          for e in data]
    flat = torch.cat(rs) if rs else torch.zeros(1)
    return {"mean": float(flat.mean()), "std": float(flat.std()) if flat.numel() > 1 else 1.0}


def save_stats(path: Path, stats: dict[str, float]) -> None:
    (path / STATS_FILE).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")


def load_stats(path: Path) -> dict[str, float]:
    return json.loads((path / STATS_FILE).read_text())
