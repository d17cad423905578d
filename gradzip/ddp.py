"""The DDP communication hook: ``hook(state, bucket) -> Future[Tensor]``, PyTorch's signature.

    ddp_model.register_comm_hook(gradzip.CompressionState("topk:ratio=0.01"), gradzip.compression_hook)

Buckets are keyed by ``bucket.index()``; the step counter advances after the last bucket of each
backward pass, as in PyTorch's ``powerSGD_hook``. Buckets below ``min_compress_bytes`` are held
back and sent fused, uncompressed, with the last bucket of the pass (see
:mod:`gradzip.comm.reducer`).
"""


from typing import Any

import torch
import torch.distributed as dist

from gradzip.comm import Reducer, make_reducer
from gradzip.comm.queue import CollectiveQueue
from gradzip.compressors import Compressor, build
from gradzip.metrics import StepMetrics


class CompressionState:
    """State of :func:`compression_hook`: the codec, its reducer, the step and the metrics.

    Args:
        compressor: a spec such as ``"powersgd:approx_rank=4"`` or a built codec.
        process_group: None for the default group.
        error_feedback: override the codec's default.
        collective: ``auto`` (by bytes), ``allreduce``, ``allgather`` or ``twophase``
            (single-round codecs; see :mod:`gradzip.comm.traffic`).
        min_compress_bytes: buckets with fewer raw bytes travel uncompressed, fused into one
            all_reduce per backward pass (single-round codecs); an integer >= 0.

    Raises:
        ValueError: for a bad spec, collective or threshold (at construction, before training
            starts).

    Pickles without its process group (it uses the default group after unpickling), and
    carries its reducer's residuals in :meth:`state_dict`.
    """

    def __init__(
        self,
        compressor: str | Compressor = "powersgd:approx_rank=4",
        *,
        process_group: dist.ProcessGroup | None = None,
        error_feedback: bool | None = None,
        collective: str = "auto",
        min_compress_bytes: int = 0,
    ) -> None:
        self.compressor = build(compressor)
        self.process_group = process_group
        self.error_feedback = error_feedback
        self.collective = collective
        self.min_compress_bytes = min_compress_bytes
        self.step = 0
        self.metrics = StepMetrics()
        self.reducer: Reducer = self._make_reducer()

    def _make_reducer(self) -> Reducer:
        return make_reducer(
            self.compressor,
            group=self.process_group,
            error_feedback=self.error_feedback,
            collective=self.collective,
            min_compress_bytes=self.min_compress_bytes,
            queue=CollectiveQueue(),
            metrics=self.metrics,
        )

    def state_dict(self) -> dict[str, Any]:
        """Spec, step and reducer state (residuals, factors); tensors cloned."""
        return {"compressor": self.compressor.spec, "step": self.step, "reducer": self.reducer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: if the checkpoint was made with another codec spec.
        """
        if state["compressor"] != self.compressor.spec:
            raise ValueError(
                f"checkpoint holds compressor state for {state['compressor']!r}, not {self.compressor.spec!r}"
            )
        self.step = state["step"]
        self.reducer.load_state_dict(state["reducer"])

    def __getstate__(self) -> dict[str, Any]:
        return {
            "compressor": self.compressor.spec,
            "error_feedback": self.error_feedback,
            "collective": self.collective,
            "min_compress_bytes": self.min_compress_bytes,
            "state": self.state_dict(),
        }

    def __setstate__(self, data: dict[str, Any]) -> None:
        self.__init__(
            data["compressor"], error_feedback=data["error_feedback"], collective=data["collective"],
            min_compress_bytes=data.get("min_compress_bytes", 0),
        )
        self.load_state_dict(data["state"])


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the group through ``state``'s codec.

    Args:
        state: a :class:`CompressionState`.
        bucket: DDP's ``GradBucket``; its flat buffer (any floating dtype) holds the gradients.

    Returns:
        a future whose value is the averaged flat bucket (same shape and dtype).
    """
    shapes = [g.shape for g in bucket.gradients()]
    last = bucket.is_last()
    fut = state.reducer.reduce(bucket.index(), bucket.buffer(), step=state.step, shapes=shapes, flush=last)
    if last:
        state.step += 1
    return fut
