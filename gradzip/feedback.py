"""Error-feedback memories: remember what compression dropped and add it back next step.

``compensated = grad + residual``; after encoding, ``residual = compensated - decoded``, so that
``compensated == decoded + residual`` holds exactly in the residual's dtype. Source: Seide et al.,
"1-Bit Stochastic Gradient Descent" (Interspeech 2014); Karimireddy et al., "Error Feedback Fixes
SignSGD" (2019, arXiv 1901.09847); Stich et al. (2018, arXiv 1809.07599).
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor

from gradzip.compressors.values import check_flag, check_number
from gradzip.keys import holders, regroup


def check_decay(decay: float) -> float:
    """Validate an error-feedback decay, a number in (0, 1].

    Raises:
        ValueError: naming ``feedback_decay`` and the allowed range.
    """
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
        raise ValueError(f"feedback_decay must be a number in (0, 1]; got {decay!r}")
    return float(decay)


def _locked(method):
    """Run ``method`` holding its ErrorFeedback's lock."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def check_error_feedback(value: object) -> bool | None:
    """``error_feedback`` as the reducers take it: True, False or None (the codec's default).

    Raises:
        ValueError: for anything else (a string such as ``"no"`` would read as true).
    """
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"error_feedback must be True, False or None (the codec's default); got {value!r}")
    return value


def check_own_feedback(codec, value: bool | None) -> None:
    """Refuse an ``error_feedback`` that a codec bringing its own rounds (``multi_round``) cannot
    follow: its reducer keeps its own error feedback, always on or always off.

    Raises:
        ValueError: naming ``error_feedback`` and the codec.
    """
    if codec.multi_round and value is not None and value != codec.error_feedback:
        raise ValueError(f"error_feedback={value}: {codec.name} brings its own rounds and keeps its own error "
                         f"feedback, always {'on' if codec.error_feedback else 'off'}")


class ErrorFeedback:
    """One residual per key (a bucket, a parameter, a parameter name).

    Args:
        start_step: first step at which residuals are kept (before it, nothing is remembered);
            an integer >= 0.
        dtype: dtype of the residuals; None keeps each gradient's own dtype. fp32 residuals for
            half-precision gradients keep small dropped values from flushing to zero.
        deferred: keep the residual each :meth:`update` replaces until :meth:`commit`, so that
            :meth:`discard` can put it back: a step skipped for a non-finite gradient then
            leaves the residuals exactly as they were. Costs one extra residual per key during
            a step (the old one, not a copy).
        decay: the residual is multiplied by this in (0, 1] before it is added back
            (``compensated = grad + decay * residual``): SparseLoCo's decayed error-feedback
            accumulator (Sarfi et al., arXiv 2508.15706), which takes the place of outer
            momentum there. 1 (the default) is plain error feedback.
        follow: residuals under the parameter-named keys of :mod:`gradzip.keys` follow their
            parameters when DDP lays them into other buckets (True: each residual is laid out
            as its key says); False for residuals of part of a bucket (the two-phase exchange's
            server side), which restart at zero in a new layout.

    Raises:
        ValueError: if ``start_step`` is not an integer >= 0 or ``decay`` is not in (0, 1].

    Thread-safe: a reducer compensates a bucket in DDP's hook (the autograd thread) while the
    residuals of buckets whose collectives finished are stored from future callbacks (the
    process group's threads); every method holds the memory's lock.

    A parameter-named key absent from the memory takes the residuals of its parameters from the
    keys that held them (:func:`gradzip.keys.regroup`), so a residual never lands on another
    tensor. Any other key whose gradient changes shape restarts at zeros of the new shape, with
    a warning, so memory stays one residual per key.
    """

    def __init__(
        self, *, start_step: int = 0, dtype: torch.dtype | None = None, deferred: bool = False, decay: float = 1.0,
        follow: bool = True,
    ) -> None:
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an integer >= 0; got {start_step!r}")
        self.decay = check_decay(decay)
        self.start_step = start_step
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None (the gradient's); got {dtype!r}")
        self.dtype = dtype
        self.deferred = deferred
        self.follow = follow
        self.residuals: dict[Hashable, Tensor] = {}
        self.replaced: dict[Hashable, Tensor | None] = {}  # deferred mode: key -> residual before the step
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    @_locked
    def compensate(self, key: Hashable, grad: Tensor, *, step: int) -> Tensor:
        """Return ``grad + residual[key]`` as a new tensor (``grad`` is never modified).

        Args:
            key: which residual.
            grad: any shape, floating dtype.
            step: the training step; before ``start_step`` the residual is ignored.

        Returns:
            a tensor of ``grad``'s shape, in the residual dtype (``dtype`` or ``grad.dtype``).
        """
        dtype = self.dtype or grad.dtype
        residual = self.residuals.get(key)
        if residual is None:
            residual = self._regroup(key, grad)
        if residual is not None and residual.shape != grad.shape:
            warnings.warn(
                f"error feedback: key {key!r} changed shape {tuple(residual.shape)} -> "
                f"{tuple(grad.shape)}; its residual restarts at zero",
                stacklevel=2,
            )
            del self.residuals[key]
            residual = None
        if residual is None or step < self.start_step:
            return grad.to(dtype, copy=True)
        if residual.device != grad.device:  # loaded from a checkpoint onto the CPU
            residual = self.residuals[key] = residual.to(grad.device)
        if self.decay == 1.0:
            return grad.to(dtype) + residual
        return torch.add(grad.to(dtype), residual, alpha=self.decay)

    def _regroup(self, key: Hashable, grad: Tensor) -> Tensor | None:
        """The residual of ``key`` laid out from the keys that held its parameters (None if
        none did); kept under ``key`` as the residual from before this step."""
        before = set(self.residuals)
        residual = regroup(self.residuals, key, follow=self.follow)
        # DDP changes its layout between steps, so no key of the new layout moves a residual
        # that this step has already replaced (discard could not put it back). A key this step
        # dropped (a layer sent dense) is not in the memory and is not taken.
        taken = before - set(self.residuals)
        assert not taken & set(self.replaced), f"{key!r} took a residual replaced in this step"
        if residual is not None and residual.numel() == grad.numel():
            residual = self.residuals[key] = residual.view(grad.shape)
        return residual

    @_locked
    def update(self, key: Hashable, compensated: Tensor, decoded: Tensor, *, step: int) -> None:
        """Store ``compensated - decoded`` as the residual of ``key`` (nothing before ``start_step``)."""
        if step < self.start_step:
            return
        if self.deferred:
            if key not in self.replaced:
                self.replaced[key] = self.residuals.get(key)
            self.residuals[key] = compensated - decoded.to(compensated.dtype)
            return
        residual = self.residuals.get(key)
        if residual is not None and residual.shape == compensated.shape:
            torch.sub(compensated, decoded.to(compensated.dtype), out=residual)
        else:
            self.residuals[key] = compensated - decoded.to(compensated.dtype)

    @_locked
    def store(self, key: Hashable, residual: Tensor, *, step: int) -> None:
        """Keep ``residual`` itself (not a copy) as the residual of ``key``: for a caller that
        computed ``compensated - decoded`` in place. Nothing is kept before ``start_step``; in
        ``deferred`` mode the replaced residual is kept for :meth:`discard`."""
        if step < self.start_step:
            return
        if self.deferred and key not in self.replaced:
            self.replaced[key] = self.residuals.get(key)
        self.residuals[key] = residual if self.dtype is None else residual.to(self.dtype)

    @_locked
    def drop(self, key: Hashable, *, step: int) -> None:
        """Forget the residual of ``key`` (what it held was just sent whole); in ``deferred``
        mode it is kept for :meth:`discard`. Nothing changes before ``start_step``."""
        if step < self.start_step or key not in self.residuals:
            return
        if self.deferred and key not in self.replaced:
            self.replaced[key] = self.residuals[key]
        del self.residuals[key]

    @_locked
    def holders(self, key: Hashable) -> list[Hashable]:
        """The keys other than ``key`` whose residuals hold some of its parameters (parameter-named
        keys of :mod:`gradzip.keys`; none for other keys)."""
        return holders(self.residuals, key)

    @_locked
    def gather(self, key: Hashable) -> Tensor | None:
        """Lay out the residual of ``key`` (absent) from every entry that holds its parameters,
        zeros for a parameter none holds (:func:`gradzip.keys.regroup`), and keep it under ``key``;
        None if no entry holds any. For a reducer that keeps a bucket's residual flat under its key
        at some steps and per parameter at others."""
        assert key not in self.residuals, f"{key!r} already holds a residual"
        return regroup(self.residuals, key, follow=self.follow)

    @_locked
    def take(self, key: Hashable) -> Tensor | None:
        """Remove and return the residual of ``key`` as it is (None if there is none): for a
        bucket that changes codec, whose new reducer takes the residual over with :meth:`put`."""
        return self.residuals.pop(key, None)

    @_locked
    def put(self, key: Hashable, residual: Tensor) -> None:
        """Keep ``residual`` (in this memory's dtype) as the residual of ``key``, taken over from
        another memory by :meth:`take`."""
        self.residuals[key] = residual if self.dtype is None else residual.to(self.dtype)

    @_locked
    def commit(self) -> None:
        """Keep the updates since the last commit (``deferred`` mode): forget the old residuals."""
        self.replaced = {}

    @_locked
    def discard(self) -> None:
        """Undo the updates since the last commit (``deferred`` mode): the residuals are again
        what they were before the step."""
        for key, old in self.replaced.items():
            if old is None:
                self.residuals.pop(key, None)
            else:
                self.residuals[key] = old
        self.replaced = {}

    @_locked
    def residual_norm(self, key: Hashable) -> float:
        """L2 norm of the residual of ``key`` (0.0 if none)."""
        residual = self.residuals.get(key)
        return 0.0 if residual is None else float(residual.float().norm())

    @_locked
    def state_dict(self) -> dict[str, Any]:
        """Residuals (cloned) and settings, for checkpoints."""
        return {
            "start_step": self.start_step,
            "residuals": {k: v.detach().clone() for k, v in self.residuals.items()},
        }

    @_locked
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.start_step = state["start_step"]
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.replaced = {}


def check_clip_norm(clip_norm: Any) -> float | None:
    """Validate a clipping threshold: None, or a finite number > 0.

    Raises:
        ValueError: naming ``clip_norm``.
    """
    if clip_norm is None:
        return None
    return check_number(clip_norm, name="clip_norm", low=0, low_open=True)


def clip_local(grad: Tensor, clip_norm: float | None, world_size: int) -> Tensor:
    """``grad`` scaled to L2 norm at most ``clip_norm / sqrt(world_size)`` (DGC's local gradient
    clipping: the global threshold divided among the ranks' sum of squares); a new tensor."""
    if clip_norm is None:
        return grad.clone()
    limit = clip_norm / math.sqrt(world_size)
    # at least fp32 for half-precision gradients, the gradient's own precision above it
    norm = float(torch.linalg.vector_norm(grad, dtype=torch.promote_types(grad.dtype, torch.float32)))
    return grad * (limit / norm) if norm > limit else grad.clone()


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
        clip_norm = check_clip_norm(clip_norm)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1; got {world_size!r}")
        self.momentum = float(momentum)
        self.clip_norm = clip_norm
        self.world_size = world_size
        self.masking = check_flag(masking, name="masking")
        self.velocities: dict[Hashable, Tensor] = {}

    def compensate(self, key: Hashable, grad: Tensor, *, step: int) -> Tensor:
        """Steps 1-2: the accumulation ``v + (momentum * u + clip(g))`` to compress (a new tensor).

        Args:
            key: which memory.
            grad: any shape, floating dtype; not modified.
            step: the training step; before ``start_step`` nothing is remembered.
        """
        g = clip_local(grad, self.clip_norm, self.world_size).to(self.dtype or grad.dtype)
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
