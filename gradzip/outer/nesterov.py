"""The outer optimizer: SGD with Nesterov momentum on the global parameters.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105) steps the global parameters with the averaged pseudo-gradient
``delta = theta_global - theta_local`` as if it were a gradient, with Nesterov momentum (the
paper: learning rate 0.7, momentum 0.9). The arithmetic is ``torch.optim.SGD``'s, operation for
operation, so both give the same bits:

    buf = delta                      (first step of a tensor)
    buf = momentum * buf + delta     (later steps)
    theta = theta - lr * (delta + momentum * buf)      (Nesterov)
    theta = theta - lr * delta                          (momentum 0)

Only the tensors handed to :meth:`OuterNesterov.step` move, so fragments step independently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


class OuterNesterov:
    """Nesterov SGD over a fixed list of tensors, stepped a subset at a time.

    Args:
        params: the global parameters (updated in place).
        lr: outer learning rate (> 0; checked by the caller).
        momentum: in [0, 1); 0 is plain SGD (no buffer kept).
    """

    def __init__(self, params: Sequence[Tensor], *, lr: float, momentum: float) -> None:
        self.params = list(params)
        self.lr = lr
        self.momentum = momentum
        self.buffers: dict[int, Tensor] = {}

    @torch.no_grad()
    def step(self, indices: Sequence[int], grads: Sequence[Tensor]) -> None:
        """Step the tensors at ``indices`` with ``grads`` (same shapes and dtypes)."""
        for i, grad in zip(indices, grads):
            if self.momentum != 0:
                buf = self.buffers.get(i)
                if buf is None:
                    buf = self.buffers[i] = grad.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(grad)
                grad = grad.add(buf, alpha=self.momentum)
            self.params[i].add_(grad, alpha=-self.lr)

    def state_dict(self) -> dict[str, Any]:
        """The momentum buffers (cloned), keyed by tensor index."""
        return {"buffers": {i: b.clone() for i, b in self.buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, onto the parameters' devices."""
        self.buffers = {int(i): b.to(self.params[int(i)].device).clone() for i, b in state["buffers"].items()}
