"""Deep Gradient Compression's training tricks around a sparse codec.

Source: Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training" (ICLR 2018, arXiv 1712.01887), Section 3 and Algorithm 1 ("DGC on node
k"). The selection itself (sampled threshold) is the ``dgc`` codec's.

- :class:`DGCMemory`: momentum correction, local gradient clipping and momentum factor masking,
  as an error-feedback memory (for momentum SGD, whose momentum moves into it).
- :class:`WarmupReducer` and :class:`WarmupState`: local gradient clipping and the exponential
  sparsity warm-up (:func:`gradzip.control.sparsity.warmup_ratio`) around any codec with a
  ``ratio``, as a reducer and as a DDP hook state; the main job's
  ``--compressor dgc:ratio=0.001,warmup_steps=N[,clip_norm=C]``. With Adam the momentum stays
  in the optimizer, so these two tricks are the ones that apply there.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradzip.comm import Reducer, make_reducer
from gradzip.comm.queue import CollectiveQueue
from gradzip.compressors import SpecError, build, check_int, parse_spec
from gradzip.control.sparsity import warmup_ratio
from gradzip.ddp import CompressionState
from gradzip.feedback import ErrorFeedback
from gradzip.metrics import StepMetrics

#: spec options handled here rather than by the codec
TRAINING_OPTIONS = ("warmup_steps", "warmup_stages", "clip_norm")


def check_clip_norm(clip_norm: Any) -> float | None:
    """Validate a clipping threshold: None, or a finite number > 0.

    Raises:
        ValueError: naming ``clip_norm``.
    """
    if clip_norm is None:
        return None
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or not math.isfinite(clip_norm) or clip_norm <= 0:
        raise ValueError(f"clip_norm must be a number > 0 or None; got {clip_norm!r}")
    return float(clip_norm)


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
        self.masking = bool(masking)
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


class WarmupReducer:
    """A reducer around a codec with a ``ratio``: DGC's local gradient clipping, then the
    exponential sparsity warm-up.

    The kept ratio follows :func:`~gradzip.control.sparsity.warmup_ratio` by step, counted from
    the codec's ``start_step`` (the steps before it are exchanged dense, so the warm-up starts
    where compression does: ``dgc:ratio=0.001,start_step=20`` with ``warmup_steps=100`` is dense
    for 20 steps, then warms up over steps 20 to 119). A codec's
    payload size is fixed per tensor size (the collectives and the byte accounting rely on it),
    so each ratio gets its own codec and reducer; when the ratio changes (at most
    ``warmup_stages`` times, between steps) the new reducer takes over the old one's state,
    error-feedback residuals included, through ``state_dict``.

    Args:
        spec: the codec spec at its final ratio, e.g. ``"dgc:ratio=0.001"``.
        warmup_steps: steps of the warm-up (>= 0; 0: the final ratio from the start).
        warmup_stages: stages of the warm-up (>= 1; DGC uses 4).
        clip_norm: the global clipping threshold (L2, per tensor handed over), None for none.
        group, error_feedback, collective, min_compress_bytes, queue, metrics: as
            :func:`gradzip.comm.make_reducer`.

    Raises:
        ValueError: for a codec without ``ratio`` or a value out of its range, naming it.
    """

    def __init__(
        self,
        spec: str,
        *,
        warmup_steps: int = 0,
        warmup_stages: int = 4,
        clip_norm: float | None = None,
        group=None,
        error_feedback: bool | None = None,
        collective: str = "auto",
        min_compress_bytes: int = 0,
        queue: CollectiveQueue | None = None,
        metrics: StepMetrics | None = None,
    ) -> None:
        parts = parse_spec(spec)
        codec = build(spec)
        if len(parts) != 1 or not hasattr(codec, "ratio"):
            raise SpecError(f"warmup_steps and clip_norm need a codec with a ratio (topk, dgc, ...); got {spec!r}")
        self.name, self.params = parts[0]
        self.ratio = codec.ratio
        self.start_step = codec.start_step
        self.warmup_steps = check_int(warmup_steps, name="warmup_steps", low=0)
        self.warmup_stages = check_int(warmup_stages, name="warmup_stages", low=1)
        self.clip_norm = check_clip_norm(clip_norm)
        self.options = {
            "group": group, "error_feedback": error_feedback, "collective": collective,
            "min_compress_bytes": min_compress_bytes, "queue": queue or CollectiveQueue(),
            "metrics": metrics or StepMetrics(),
        }
        self.group = group
        self.current_ratio: float | None = None
        self.current: Reducer | None = None

    def ratio_at(self, step: int) -> float:
        """The kept ratio at ``step`` (the first stage's until ``start_step``, then the warm-up)."""
        return warmup_ratio(
            max(step - self.start_step, 0), ratio=self.ratio, warmup_steps=self.warmup_steps, stages=self.warmup_stages
        )

    def _reducer_at(self, step: int) -> Reducer:
        return self._reducer_for(self.ratio_at(step))

    def _reducer_for(self, ratio: float) -> Reducer:
        if ratio != self.current_ratio:
            fresh = make_reducer(format_spec(self.name, {**self.params, "ratio": ratio}), **self.options)
            if self.current is not None:
                self.current.flush()
                fresh.load_state_dict(self.current.state_dict())
            self.current, self.current_ratio = fresh, ratio
        return self.current

    def reduce(self, key, grad: Tensor, *, step: int, shapes=None, flush: bool = True):
        """Clip ``grad`` (a copy), then average it through the codec at ``ratio_at(step)``.

        Returns: a future of the mean, ``grad``'s shape and dtype.
        """
        world_size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        clipped = grad if self.clip_norm is None else clip_local(grad, self.clip_norm, world_size)
        return self._reducer_at(step).reduce(key, clipped, step=step, shapes=shapes, flush=flush)

    def flush(self) -> None:
        if self.current is not None:
            self.current.flush()

    def state_dict(self) -> dict[str, Any]:
        """The current ratio and its reducer's state (residuals)."""
        return {"ratio": self.current_ratio, "reducer": None if self.current is None else self.current.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.current_ratio, self.current = None, None
        if state["reducer"] is None:
            return
        self._reducer_for(state["ratio"]).load_state_dict(state["reducer"])


def split_training_options(spec: str) -> tuple[str, dict[str, Any]]:
    """``(codec spec, options)``: ``dgc:ratio=0.001,warmup_steps=100`` gives
    ``("dgc:ratio=0.001", {"warmup_steps": 100})``; options are :data:`TRAINING_OPTIONS`."""
    parts = parse_spec(spec)
    if len(parts) != 1:
        return spec, {}
    name, params = parts[0]
    options = {k: params.pop(k) for k in TRAINING_OPTIONS if k in params}
    if not options:
        return spec, {}
    return format_spec(name, params), options


def format_spec(name: str, params: dict[str, Any]) -> str:
    """``name:key=value,...`` that :func:`gradzip.compressors.parse_spec` reads back as ``params``
    (floats in their shortest exact form)."""
    if not params:
        return name
    return name + ":" + ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in params.items())


class WarmupState(CompressionState):
    """:class:`~gradzip.ddp.CompressionState` whose reducer is a :class:`WarmupReducer`, for
    ``compression_hook``: ``WarmupState("dgc:ratio=0.001", warmup_steps=200, clip_norm=1.0)``.
    Other keyword arguments as :class:`~gradzip.ddp.CompressionState`.

    Raises:
        ValueError: as :class:`WarmupReducer`.
    """

    def __init__(self, compressor: str, *, warmup_steps: int = 0, warmup_stages: int = 4,
                 clip_norm: float | None = None, **kwargs: Any) -> None:
        self.warmup = {"warmup_steps": warmup_steps, "warmup_stages": warmup_stages, "clip_norm": clip_norm}
        super().__init__(compressor, **kwargs)

    def _make_reducer(self) -> Reducer:
        return WarmupReducer(
            self.spec, **self.warmup, group=self.process_group, error_feedback=self.error_feedback,
            collective=self.collective, min_compress_bytes=self.min_compress_bytes, queue=self.queue,
            metrics=self.metrics,
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "warmup": self.warmup}

    def __setstate__(self, data: dict[str, Any]) -> None:
        warmup = data["warmup"]
        super().__setstate__(data)  # re-runs __init__ without the warm-up options: rebuild with them
        self.warmup = warmup
        self.reducer = self._make_reducer()
        self.load_state_dict(data["state"])
