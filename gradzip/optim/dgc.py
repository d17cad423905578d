"""Deep Gradient Compression's local accumulation: momentum correction, local gradient clipping
and momentum factor masking.

Source: Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training" (ICLR 2018, arXiv 1712.01887), Section 3 and Algorithm 1 ("DGC on node
k"). The selection itself (sampled threshold) is the ``dgc`` codec's; the sparsity warm-up is
:func:`gradzip.control.sparsity.warmup_ratio`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor

from gradzip.feedback import ErrorFeedback


class DGCMemory(ErrorFeedback):
    """The error-feedback memory of DGC, for momentum SGD whose momentum moves into it.

    Per key, with ``u`` the velocity and ``v`` the accumulation (:attr:`residuals`):

    1. local gradient clipping: ``g *= min(1, clip_norm / sqrt(world_size) / ||g||)`` (the
       global threshold scaled by ``world_size ** -0.5``, as the paper says, per key);
    2. momentum correction: ``u = momentum * u + g``; ``v = v + u``; send ``C(v)``;
    3. ``v = v - D(C(v))`` (zero where sent, for a sparsifier: the paper's ``v * ~mask``);
    4. momentum factor masking: ``u = 0`` where ``C(v)`` sent something (``D(C(v)) != 0``).

    The optimizer then steps with the averaged ``D(C(v))`` as it is: SGD *without* momentum
    (the momentum is here). ``momentum=0`` and no clipping is plain error feedback. Use as a
    reducer's error feedback (same ``compensate`` / ``update`` / ``state_dict`` interface).

    Args:
        momentum: the SGD momentum moved into the memory, in [0, 1).
        clip_norm: the global gradient-clipping threshold (L2 norm); None for no clipping.
        world_size: ranks that each clip locally (the threshold is divided by its square root).
        masking: zero the velocity where values were sent (the paper's momentum factor masking).
        start_step, dtype: as :class:`~gradzip.feedback.ErrorFeedback`.

    Raises:
        ValueError: naming an argument out of its range.
    """

    def __init__(
        self,
        *,
        momentum: float = 0.9,
        clip_norm: float | None = None,
        world_size: int = 1,
        masking: bool = True,
        start_step: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(start_step=start_step, dtype=dtype)
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"momentum must be a number in [0, 1); got {momentum!r}")
        if clip_norm is not None and (
            isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float))
            or not math.isfinite(clip_norm) or clip_norm <= 0
        ):
            raise ValueError(f"clip_norm must be a number > 0 or None; got {clip_norm!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1; got {world_size!r}")
        self.momentum = float(momentum)
        self.clip_norm = clip_norm
        self.world_size = world_size
        self.masking = bool(masking)
        self.velocities: dict[Hashable, Tensor] = {}

    def clip(self, grad: Tensor) -> Tensor:
        """``grad`` scaled to L2 norm at most ``clip_norm / sqrt(world_size)`` (a new tensor)."""
        if self.clip_norm is None:
            return grad.clone()
        limit = self.clip_norm / math.sqrt(self.world_size)
        # at least fp32 for half-precision gradients, the gradient's own precision above it
        norm = float(torch.linalg.vector_norm(grad, dtype=torch.promote_types(grad.dtype, torch.float32)))
        return grad * (limit / norm) if norm > limit else grad.clone()

    def compensate(self, key: Hashable, grad: Tensor, *, step: int) -> Tensor:
        """Steps 1-2: the accumulation ``v + (momentum * u + clip(g))`` to compress (a new tensor).

        Args:
            key: which memory.
            grad: any shape, floating dtype; not modified.
            step: the training step; before ``start_step`` nothing is remembered.
        """
        g = self.clip(grad).to(self.dtype or grad.dtype)
        velocity = self.velocities.get(key)
        if velocity is not None and velocity.shape == g.shape and step >= self.start_step and self.momentum:
            velocity.mul_(self.momentum).add_(g)
            g = velocity.clone()
        elif step >= self.start_step and self.momentum:
            self.velocities[key] = g.clone()
        return super().compensate(key, g, step=step)

    def update(self, key: Hashable, compensated: Tensor, decoded: Tensor, *, step: int) -> None:
        """Steps 3-4: keep what was not sent; stop the velocity where something was."""
        super().update(key, compensated, decoded, step=step)
        velocity = self.velocities.get(key)
        if self.masking and velocity is not None and step >= self.start_step:
            velocity.masked_fill_(decoded.reshape(velocity.shape) != 0, 0)

    def state_dict(self) -> dict[str, Any]:
        """Accumulations, velocities (cloned) and settings."""
        out = super().state_dict()
        out["velocities"] = {k: v.detach().clone() for k, v in self.velocities.items()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        super().load_state_dict(state)
        self.velocities = {k: v.clone() for k, v in state["velocities"].items()}
