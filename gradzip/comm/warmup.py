"""DGC's sparsity warm-up and local gradient clipping around any codec with a ``ratio``.

Source: Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training" (ICLR 2018, arXiv 1712.01887), Section 3. The main job's
``--compressor dgc:ratio=0.001,warmup_steps=N[,clip_norm=C]``. DGC's momentum correction is
:class:`gradzip.feedback.DGCMemory`; the selection (sampled threshold) is the ``dgc`` codec's.
With Adam the momentum stays in the optimizer, so warm-up and clipping are the tricks that apply.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from gradzip.comm.queue import CollectiveQueue
from gradzip.compressors import REGISTRY, Compressor, SpecError, check_int
from gradzip.control.sparsity import warmup_ratio
from gradzip.feedback import check_clip_norm, clip_local
from gradzip.metrics import StepMetrics


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
        codec: the codec at its final ratio, e.g. ``build("dgc:ratio=0.001")``.
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
        codec: Compressor,
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
        self.check_options(codec, warmup_steps=warmup_steps, warmup_stages=warmup_stages, clip_norm=clip_norm)
        self.codec = codec
        self.ratio = codec.ratio
        self.start_step = codec.start_step
        self.warmup_steps = warmup_steps
        self.warmup_stages = warmup_stages
        self.clip_norm = check_clip_norm(clip_norm)
        self.options = {
            "group": group, "error_feedback": error_feedback, "collective": collective,
            "min_compress_bytes": min_compress_bytes, "queue": queue or CollectiveQueue(),
            "metrics": metrics or StepMetrics(),
        }
        self.group = group
        self.current_ratio: float | None = None
        self.current: Any = None

    @staticmethod
    def check_options(codec: Compressor, *, warmup_steps: int = 0, warmup_stages: int = 4,
                      clip_norm: float | None = None) -> None:
        """Raise ``ValueError`` unless ``codec`` has a ``ratio`` and the options are in range."""
        if not hasattr(codec, "ratio") or codec.name not in REGISTRY:
            raise SpecError(
                f"warmup_steps and clip_norm need a codec with a ratio (topk, dgc, ...); got {codec.spec!r}"
            )
        check_int(warmup_steps, name="warmup_steps", low=0)
        check_int(warmup_stages, name="warmup_stages", low=1)
        check_clip_norm(clip_norm)

    def ratio_at(self, step: int) -> float:
        """The kept ratio at ``step`` (the first stage's until ``start_step``, then the warm-up)."""
        return warmup_ratio(
            max(step - self.start_step, 0), ratio=self.ratio, warmup_steps=self.warmup_steps, stages=self.warmup_stages
        )

    def _reducer_at(self, step: int) -> Any:
        return self._reducer_for(self.ratio_at(step))

    def _reducer_for(self, ratio: float) -> Any:
        if ratio != self.current_ratio:
            from gradzip.comm import make_reducer  # the registry imports this module

            fresh = make_reducer(self.codec.replace(ratio=ratio), **self.options)
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
