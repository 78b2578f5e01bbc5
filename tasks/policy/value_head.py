"""The PPO critic: a linear value head V(s_t) = w . h_t + b on the policy's last hidden states.

The head reads the hidden states detached, so the critic is a probe on the policy's features
and its loss never moves the policy. It is saved as `value_head.safetensors` inside the policy
directory it was trained with; the next iteration starts from it (value reuse).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from tasks.core import layout
from tasks.core.errors import InputError
from tasks.models import lm
from tasks.runtime.device import Device, device_of

VALUE_HEAD_FILE = layout.VALUE_HEAD


class ValueHead(torch.nn.Module):
    """Linear head (H,) -> scalar, zero-initialised so that a fresh critic predicts V = 0."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden (B, T, H) -> values (B, T)."""
        return self.linear(hidden).squeeze(-1)


def save(head: ValueHead, model_dir: Path) -> None:
    save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()},
              str(model_dir / VALUE_HEAD_FILE))


def load_or_init(model_dir: Path, hidden_size: int, reuse: bool,
                 device: Device = "cpu") -> tuple[ValueHead, bool]:
    """The head saved in model_dir when reuse is on and it exists, else a fresh one, on
    `device`. Returns the head and whether it was loaded. A stored head of another width is an
    error."""
    head, path = ValueHead(hidden_size), model_dir / VALUE_HEAD_FILE
    if not (reuse and path.is_file()):
        return head.to(device), False
    state = load_file(str(path))
    weight = state.get("linear.weight")
    if weight is None or weight.shape != (1, hidden_size):
        raise InputError(f"{path}: value head does not fit hidden size {hidden_size}")
    head.load_state_dict(state)
    return head.to(device), True


class _HiddenTap:
    """Calls the model with output_hidden_states and keeps the last layer's states."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.hidden = model, torch.empty(0)   # cpu: a placeholder, set per call
        self.config = lm.model_config(model)              # lm.attention_mask reads it

    def __call__(self, **kwargs: Tensor) -> object:
        out = self.model(**kwargs, output_hidden_states=True)
        self.hidden = out.hidden_states[-1]                              # (B, T, H)
        return out


def logprobs_and_values(policy: torch.nn.Module, head: ValueHead,
                        prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                        pad_id: int, temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """One forward pass: per-token log-probs (B, R), values (B, R) and response mask (B, R).

    values[:, t] = V(s_t), s_t = prompt + response[:t], read at the position whose logits
    predict response token t (the same position the log-prob is read at). Responses to the same
    prompt share one packed row (`lm.pack`), the prompt computed once.
    """
    tap = _HiddenTap(policy)
    pk = lm.pack(prompts, responses, pad_id, device_of(policy))
    logprobs, mask = lm.packed_logprobs(tap, pk, temperature)  # type: ignore[arg-type]
    hidden = tap.hidden.detach()                                         # critic: a probe
    pred, _, _ = pk.predictors()                                         # (B, R)
    values = head(hidden[pk.rows[:, None], pred]) * mask                 # (B, R)
    return logprobs, values, mask
