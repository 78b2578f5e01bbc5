"""L2-regularised logistic regression: the gold review check's sentence classifier
(tasks/evaluation/genre.py) and the reward model's probe head (tasks/reward/reward_model.py) are
fitted with it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def fit_logistic(x: Tensor, y: Tensor, l2: float) -> tuple[Tensor, Tensor]:
    """L2-regularised logistic regression by L-BFGS from zeros, on x's device: deterministic on
    CPU."""
    w = torch.zeros(x.shape[1], requires_grad=True, device=x.device)
    b = torch.zeros(1, requires_grad=True, device=x.device)
    opt = torch.optim.LBFGS([w, b], max_iter=500, tolerance_grad=1e-9,
                            line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()
