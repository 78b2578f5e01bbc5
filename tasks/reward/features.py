"""What a reward model's head reads: the backbone's states of each (prompt, response), pooled
(`features`), the backbone cut to its first blocks (`truncate`, `depth`), the encoded pairs,
and `FrozenFeatures`, the features computed once while the backbone no longer changes. The
reward model (tasks/reward/reward_model.py) and its probe head (tasks/reward/probe.py) both read
them; neither imports the other for them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import transformers
from torch import Tensor

from tasks.models import lm
from tasks.runtime.device import device_of


@dataclass(frozen=True)
class EncodedPair:
    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]


def truncate(model: transformers.PreTrainedModel, num_layers: int) -> None:
    """Keep the backbone's first `num_layers` blocks (0, or at least its depth: all of them)."""
    backbone = getattr(model, model.base_model_prefix)
    if 0 < num_layers < len(backbone.layers):
        backbone.layers = backbone.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:num_layers]


def depth(model: transformers.PreTrainedModel) -> int:
    """The backbone's number of transformer blocks."""
    return len(getattr(model, model.base_model_prefix).layers)


def features(model: transformers.PreTrainedModel, prompts: Sequence[Sequence[int]],
             responses: Sequence[Sequence[int]], pad_id: int, pooling: str = "last") -> Tensor:
    """The (B, H) states the head reads: at each response's last token, or the mean over its
    tokens (an empty response: its prompt's last). Responses to the same prompt share one
    packed row, the prompt computed once (`lm.pack`)."""
    pk = lm.pack(prompts, responses, pad_id, device_of(model))
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=pk.ids, attention_mask=lm.attention_mask(model, pk.attention),
                      position_ids=pk.positions).last_hidden_state           # (G, T, H)
    return pool_states(hidden, pk, pooling)


def pool_states(hidden: Tensor, pk: lm.Packed, pooling: str) -> Tensor:
    """(B, H) read-out of packed states (G, T, H): each response's last token, or its mean."""
    if pooling == "last":
        return hidden[pk.rows, pk.last_positions()]                         # (B, H)
    _, at, mask = pk.predictors()                                           # (B, R) each
    mask = mask.to(hidden.dtype)[..., None]
    total = (hidden[pk.rows[:, None], at] * mask).sum(1)                    # (B, H)
    empty = mask.sum(1) == 0
    return torch.where(empty, hidden[pk.rows, pk.last_positions()],
                       total / mask.sum(1).clamp(min=1))


Key = tuple[tuple[int, ...], tuple[int, ...]]      # (prompt ids, response ids)


class FrozenFeatures:
    """The head's input features of each (prompt, response), computed once by a backbone that
    no longer changes (`train_rm.epochs: 0`: the probe alone), so that fitting the probe,
    scoring the train and held-out pairs and the audit queue's margins share one forward per
    response instead of three. Missing keys are computed in batches of `batch_size` in the
    order asked, as fit_probe_head batches them without a cache (the same probe, bit for bit,
    for one member); the members of an ensemble share the backbone and so the features."""

    def __init__(self, model: transformers.PreTrainedModel, pad_id: int, pooling: str,
                 precision: str, batch_size: int = 32):
        self.model, self.pad_id, self.pooling = model, pad_id, pooling
        self.precision, self.batch_size = precision, batch_size
        self.rows: dict[Key, Tensor] = {}

    @torch.no_grad()
    def get(self, keys: Sequence[Key]) -> Tensor:
        """(U, H) fp32 features of `keys`."""
        missing = list(dict.fromkeys(k for k in keys if k not in self.rows))
        with lm.autocast(self.precision, device_of(self.model)):
            for s in range(0, len(missing), self.batch_size):
                chunk = missing[s: s + self.batch_size]
                f = features(self.model, [k[0] for k in chunk], [k[1] for k in chunk],
                             self.pad_id, self.pooling).float()                   # (b, H)
                self.rows.update(zip(chunk, f))
        return (torch.stack([self.rows[k] for k in keys]) if keys
                else torch.zeros(0, 0, device=device_of(self.model)))

    @torch.no_grad()
    def pair_rewards(self, heads: Sequence[torch.nn.Module], data: Sequence[EncodedPair]
                     ) -> tuple[Tensor, Tensor]:
        """Every head's (K, N) rewards of the pairs' chosen and rejected responses; a head is
        a member's `score` layer."""
        if not data:
            dev = device_of(self.model)
            return torch.zeros(len(heads), 0, device=dev), torch.zeros(len(heads), 0, device=dev)
        chosen = self.get([(e.prompt_ids, e.chosen_ids) for e in data])            # (N, H)
        rejected = self.get([(e.prompt_ids, e.rejected_ids) for e in data])
        return tuple(torch.stack([h(x).squeeze(-1).float() for h in heads])          # (K, N)
                     for x in (chosen, rejected))  # type: ignore[return-value]

    @torch.no_grad()
    def margins(self, heads: Sequence[torch.nn.Module], data: Sequence[EncodedPair]) -> Tensor:
        """Every head's margin on every pair, (K, N): pair_margins from the cache."""
        return torch.sub(*self.pair_rewards(heads, data))
