"""The single-round reducer: the mean over a process group of compressed tensors.

Aggregatable payloads are divided by world_size and ``all_reduce``-d (dividing first keeps fp16
sums from overflowing, and is the order of PyTorch's ``allreduce_hook`` and
``fp16_compress_hook``). Other payloads are packed into one byte buffer and ``all_gather``-ed;
every rank then decodes all of them in rank order, sums and divides, so all ranks end with
bit-identical results.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip import wire
from gradzip.comm.queue import CollectiveQueue, completed
from gradzip.compressors import Compressor, Payload
from gradzip.feedback import ErrorFeedback
from gradzip.metrics import StepMetrics, quality_figures

COLLECTIVES = ("auto", "allreduce", "allgather")


def predivide(payload: Payload, world_size: int) -> tuple[Tensor, ...]:
    """Floating payload tensors divided by ``world_size`` (new tensors; integer parts as they are)."""
    return tuple(t.div(world_size) if t.is_floating_point() else t for t in payload.tensors)


def decode_gathered(compressor: Compressor, payloads: Sequence[Payload], like: Tensor) -> Tensor:
    """Mean of the decoded payloads of every rank, summed in rank order.

    Args:
        payloads: one per rank, rank 0 first.
        like: gives the output shape, dtype and device.
    """
    total = compressor.decompress(payloads[0], like=like).clone()
    for payload in payloads[1:]:
        total += compressor.decompress(payload, like=like)
    return total.div_(len(payloads))


class CompressedReducer:
    """Averages tensors over ``group`` through ``compressor``, one collective per call.

    Args:
        compressor: a single-round codec.
        group: the process group (None: the default group).
        error_feedback: keep a residual per key; None uses the codec's default.
        collective: ``auto`` (all_reduce for aggregatable codecs, else all_gather),
            ``allreduce`` or ``allgather``.
        queue: the ordered launch queue shared by every reducer of ``group``.
        metrics: where bytes and times go.

    Raises:
        ValueError: for an unknown ``collective``, or ``allreduce`` with a codec that is not
            aggregatable.
    """

    def __init__(
        self,
        compressor: Compressor,
        *,
        group: dist.ProcessGroup | None = None,
        error_feedback: bool | None = None,
        collective: str = "auto",
        queue: CollectiveQueue | None = None,
        metrics: StepMetrics | None = None,
    ) -> None:
        assert not compressor.multi_round, "multi-round codecs bring their own reducer"
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}; got {collective!r}")
        if collective == "allreduce" and not compressor.aggregatable:
            raise ValueError(
                f"collective='allreduce' needs an aggregatable codec; {compressor.name} is not "
                "(use allgather or auto)"
            )
        self.compressor = compressor
        self.group = group
        self.collective = collective
        use_feedback = compressor.error_feedback if error_feedback is None else error_feedback
        self.feedback = ErrorFeedback() if use_feedback else None
        self.queue = queue or CollectiveQueue()
        self.metrics = metrics or StepMetrics()

    def uses_allreduce(self) -> bool:
        """Whether payloads are summed by all_reduce (else gathered)."""
        if self.collective == "auto":
            return self.compressor.aggregatable
        return self.collective == "allreduce"

    def reduce(self, key: Hashable, grad: Tensor, *, step: int, shapes: Sequence[torch.Size] | None = None) -> Future:
        """Start averaging ``grad`` over the group.

        Args:
            key: names the tensor across steps (a bucket index); keys the residual.
            grad: any shape, floating dtype; not modified.
            step: the training step (seeds and schedules).
            shapes: ignored (single-round codecs see the flat tensor).

        Returns:
            a future whose value is the mean, with ``grad``'s shape and dtype.
        """
        world_size = dist.get_world_size(self.group)
        dense_bytes = grad.numel() * grad.element_size()
        if grad.numel() == 0:
            return completed(grad.clone())
        if self.compressor.payload_nbytes(grad.numel(), grad.dtype) > dense_bytes:
            return self._reduce_dense(key, grad, world_size, step=step)

        monitored = self.metrics.wants_quality(step)
        decoded = None
        with self.metrics.timed("compress_s", key):
            compensated = grad if self.feedback is None else self.feedback.compensate(key, grad, step=step)
            payload = self.compressor.compress(compensated, step=step, key=key)
            if self.feedback is not None:
                decoded = self.compressor.decompress(payload, like=compensated)
                self.feedback.update(key, compensated, decoded, step=step)
        assert payload.nbytes == self.compressor.payload_nbytes(grad.numel(), grad.dtype), (
            f"{self.compressor.name}: payload of {payload.nbytes} bytes, formula says "
            f"{self.compressor.payload_nbytes(grad.numel(), grad.dtype)}"
        )
        if monitored:
            # Codecs without feedback decode only here, on monitored steps, outside the timings.
            if decoded is None:
                decoded = self.compressor.decompress(payload, like=compensated)
            residual = None if self.feedback is None else self.feedback.residuals.get(key)
            self.metrics.add_quality(key, quality_figures(compensated, decoded, grad=grad, residual=residual))
        if self.uses_allreduce():
            return self._all_reduce(key, payload, grad, world_size, dense_bytes)
        return self._all_gather(key, payload, grad, world_size, dense_bytes)

    def probe(self, key: Hashable, grad: Tensor, *, step: int, shapes: Sequence[torch.Size] | None = None) -> dict[str, Any]:
        """Compress and decode ``grad`` locally, with no collective and no state change.

        Used by controllers to price a codec on a real bucket.

        Returns:
            ``compress_s`` and ``decompress_s`` (seconds; decoding counted once per rank for
            gathered payloads, as the reducer decodes every rank's payload), ``payload_bytes``,
            ``collectives`` (1), ``collective`` and ``decoded`` (the local decode, ``grad``'s shape).
        """
        world_size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        dense_bytes = grad.numel() * grad.element_size()
        if grad.numel() == 0 or self.compressor.payload_nbytes(grad.numel(), grad.dtype) > dense_bytes:
            return {"compress_s": 0.0, "decompress_s": 0.0, "payload_bytes": dense_bytes, "collectives": 1,
                    "collective": "allreduce", "decoded": grad}
        start = time.perf_counter()
        payload = self.compressor.compress(grad, step=step, key=key)
        middle = time.perf_counter()
        decoded = self.compressor.decompress(payload, like=grad)
        end = time.perf_counter()
        gathered = not self.uses_allreduce()
        return {
            "compress_s": middle - start,
            "decompress_s": (end - middle) * (world_size if gathered else 1),
            "payload_bytes": payload.nbytes,
            "collectives": 1,
            "collective": "allgather" if gathered else "allreduce",
            "decoded": decoded,
        }

    def take_residual(self, key: Hashable, shapes: Sequence[torch.Size] | None = None) -> Tensor | None:
        """Remove and return the residual of ``key`` (flat), or None; used when a bucket changes codec."""
        if self.feedback is None:
            return None
        residual = self.feedback.residuals.pop(key, None)
        return None if residual is None else residual.reshape(-1)

    def _launch(self, key: Hashable, issue) -> Future:
        """Issue one collective with its in-flight time recorded (globally and for ``key``)."""
        start = self.metrics.collective_started(key)
        fut = issue()
        fut.add_done_callback(lambda _f: self.metrics.collective_finished(key, start))
        return fut

    def _reduce_dense(self, key: Hashable, grad: Tensor, world_size: int, *, step: int = 0) -> Future:
        tensor = grad.div(world_size)
        self.metrics.add_bucket(
            key, payload_bytes=wire.nbytes([tensor]), dense_bytes=wire.nbytes([grad]),
            collective="allreduce", compressed=False, codec="none",
        )
        if self.metrics.wants_quality(step):
            self.metrics.add_quality(key, quality_figures(grad, grad))

        def launch() -> Future:
            return self._launch(key, lambda: dist.all_reduce(tensor, group=self.group, async_op=True).get_future())

        return self.queue.submit(launch).then(lambda _f: tensor)

    def _all_reduce(self, key, payload: Payload, grad: Tensor, world_size: int, dense_bytes: int) -> Future:
        tensors = predivide(payload, world_size)
        self.metrics.add_bucket(
            key, payload_bytes=wire.nbytes(tensors), dense_bytes=dense_bytes, collective="allreduce",
            codec=self.compressor.spec,
        )

        def launch() -> Future:
            def issue() -> Future:
                works = [dist.all_reduce(t, group=self.group, async_op=True).get_future() for t in tensors]
                return works[0] if len(works) == 1 else torch.futures.collect_all(works)

            return self._launch(key, issue)

        def decode(_fut: Future) -> Tensor:
            with self.metrics.timed("decompress_s", key):
                return self.compressor.decompress(Payload(tensors, payload.ctx), like=grad)

        return self.queue.submit(launch).then(decode)

    def _all_gather(self, key, payload: Payload, grad: Tensor, world_size: int, dense_bytes: int) -> Future:
        send = wire.to_bytes(payload.tensors)
        recv = torch.empty(world_size * send.numel(), dtype=torch.uint8, device=send.device)
        self.metrics.add_bucket(
            key, payload_bytes=send.numel(), dense_bytes=dense_bytes, collective="allgather", codec=self.compressor.spec
        )

        def launch() -> Future:
            return self._launch(
                key, lambda: dist.all_gather_single(recv, send, group=self.group, async_op=True).get_future()
            )

        def decode(_fut: Future) -> Tensor:
            with self.metrics.timed("decompress_s", key):
                chunks = recv.view(world_size, -1)
                payloads = [Payload(wire.from_bytes(chunks[r], payload.tensors), payload.ctx) for r in range(world_size)]
                return decode_gathered(self.compressor, payloads, grad)

        return self.queue.submit(launch).then(decode)

    def state_dict(self) -> dict[str, Any]:
        """Codec and error-feedback state."""
        return {
            "compressor": self.compressor.state_dict(),
            "feedback": None if self.feedback is None else self.feedback.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.compressor.load_state_dict(state["compressor"])
        if self.feedback is not None and state["feedback"] is not None:
            self.feedback.load_state_dict(state["feedback"])
