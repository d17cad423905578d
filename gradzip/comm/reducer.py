"""The single-round reducer: the mean over a process group of compressed tensors.

Aggregatable payloads are divided by world_size and ``all_reduce``-d (dividing first keeps fp16
sums from overflowing, and is the order of PyTorch's ``allreduce_hook`` and
``fp16_compress_hook``). Other payloads are packed into one byte buffer and ``all_gather``-ed;
every rank then decodes all of them in rank order, divides each by world_size and sums, so all
ranks end with bit-identical results and finite values near the dtype's maximum do not overflow.

Non-finite gradients follow :mod:`gradzip.comm.guard`: a rank whose input holds inf or NaN sends
a NaN-marked payload in the same collective, every rank returns all NaN for that bucket, and the
step's error-feedback and codec updates are dropped.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip import wire
from gradzip.comm import guard
from gradzip.comm.queue import CollectiveQueue, completed
from gradzip.compressors import Compressor, Payload
from gradzip.feedback import ErrorFeedback
from gradzip.metrics import StepMetrics

COLLECTIVES = ("auto", "allreduce", "allgather")


def predivide(payload: Payload, world_size: int) -> tuple[Tensor, ...]:
    """Floating payload tensors divided by ``world_size`` (new tensors; integer parts as they are)."""
    return tuple(t.div(world_size) if t.is_floating_point() else t for t in payload.tensors)


def decode_gathered(compressor: Compressor, payloads: Sequence[Payload], like: Tensor) -> Tensor:
    """Mean of the decoded payloads of every rank, each divided by their number, summed in rank order.

    Dividing before summing keeps values near the dtype's maximum from overflowing.

    Args:
        payloads: one per rank, rank 0 first.
        like: gives the output shape, dtype and device.
    """
    world_size = len(payloads)
    total = compressor.decompress(payloads[0], like=like).div(world_size)
    for payload in payloads[1:]:
        total += compressor.decompress(payload, like=like).div(world_size)
    if not guard.is_finite(total):
        guard.saturate_(total)  # the summands are finite: only rounding past the maximum gets here
    return total


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
        # Residual updates are staged until the step is known to be finite on every rank.
        self.feedback = ErrorFeedback(deferred=True) if use_feedback else None
        self.queue = queue or CollectiveQueue()
        self.metrics = metrics or StepMetrics()
        self.ledger = guard.StepLedger()
        self._codec_snapshot: dict[str, Any] | None = None

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
            a future whose value is the mean, with ``grad``'s shape and dtype; all NaN on every
            rank if ``grad`` held inf or NaN on any rank (see :mod:`gradzip.comm.guard`). The
            future carries the collective's error if the collective failed.
        """
        self._begin(key, step)
        world_size = dist.get_world_size(self.group)
        dense_bytes = grad.numel() * grad.element_size()
        if grad.numel() == 0:
            return completed(grad.clone())
        if self.compressor.payload_nbytes(grad.numel(), grad.dtype) > dense_bytes:
            return self._reduce_dense(key, grad, world_size)

        with self.metrics.timed("compress_s"):
            payload, sendable = self._encode(key, grad, step)
        assert payload.nbytes == self.compressor.payload_nbytes(grad.numel(), grad.dtype), (
            f"{self.compressor.name}: payload of {payload.nbytes} bytes, formula says "
            f"{self.compressor.payload_nbytes(grad.numel(), grad.dtype)}"
        )
        wire_tensors = payload.tensors
        if not guard.has_float(wire_tensors):
            wire_tensors = wire_tensors + (guard.flag(not sendable, grad.device),)
        if self.uses_allreduce():
            return self._all_reduce(key, payload, wire_tensors, grad, world_size, dense_bytes)
        return self._all_gather(key, payload, wire_tensors, grad, world_size, dense_bytes)

    def _encode(self, key: Hashable, grad: Tensor, step: int) -> tuple[Payload, bool]:
        """The payload to send and whether it is real (False: NaN-marked, the input was not finite)."""
        compensated = grad if self.feedback is None else self.feedback.compensate(key, grad, step=step)
        compensated, sendable = guard.checked_input(grad, compensated)
        if not sendable:
            # Codecs need not accept inf or NaN: encode zeros for the payload's shapes, then mark it.
            blank = self.compressor.compress(torch.zeros_like(compensated), step=step, key=key)
            return Payload(guard.poison(blank.tensors), blank.ctx), False
        payload = self.compressor.compress(compensated, step=step, key=key)
        if self.feedback is not None:
            decoded = self.compressor.decompress(payload, like=compensated)
            self.feedback.update(key, compensated, decoded, step=step)
        return payload, True

    def _begin(self, key: Hashable, step: int) -> None:
        """Settle the previous step when a new one starts, and snapshot a stateful codec."""
        self._settle(self.ledger.begin(key, step))
        if len(self.ledger.keys) == 1:
            state = self.compressor.state_dict()
            self._codec_snapshot = guard.clone_state(state) if state else None

    def _settle(self, verdict: bool | None) -> None:
        if verdict is None:
            return
        if verdict and self.feedback is not None:
            self.feedback.commit()
        elif not verdict:
            if self.feedback is not None:
                self.feedback.discard()
            if self._codec_snapshot is not None:
                self.compressor.load_state_dict(self._codec_snapshot)
        self._codec_snapshot = None

    def settle(self) -> None:
        """End the current step now: commit its staged updates, or drop them if any bucket of
        the step was non-finite on some rank. ``reduce`` does this by itself when the next step
        starts, and :meth:`state_dict` before it reads the state."""
        self._settle(self.ledger.finish())

    def _launch(self, issue) -> Future:
        """Issue one collective with its in-flight time recorded."""
        self.metrics.collective_started()
        fut = issue()
        fut.add_done_callback(lambda _f: self.metrics.collective_finished())
        return fut

    def _reduce_dense(self, key: Hashable, grad: Tensor, world_size: int) -> Future:
        tensor = grad.div(world_size)
        if not guard.is_finite(grad):
            tensor.fill_(float("nan"))  # the marker; an inf alone could pass for an overflow
        self.metrics.add_bucket(
            key, payload_bytes=wire.nbytes([tensor]), dense_bytes=wire.nbytes([grad]),
            collective="allreduce", compressed=False,
        )

        def launch() -> Future:
            return self._launch(lambda: dist.all_reduce(tensor, group=self.group, async_op=True).get_future())

        def finish(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            return self._marker(tensor) if guard.received_marker([tensor]) else tensor

        return self.queue.submit(launch).then(finish)

    def _marker(self, like: Tensor) -> Tensor:
        self.ledger.mark_nonfinite()
        return guard.marker_like(like)

    def _all_reduce(self, key, payload: Payload, wire_tensors, grad: Tensor, world_size: int, dense_bytes: int) -> Future:
        tensors = predivide(Payload(wire_tensors), world_size)
        self.metrics.add_bucket(key, payload_bytes=wire.nbytes(tensors), dense_bytes=dense_bytes, collective="allreduce")

        def launch() -> Future:
            def issue() -> Future:
                works = [dist.all_reduce(t, group=self.group, async_op=True).get_future() for t in tensors]
                return works[0] if len(works) == 1 else torch.futures.collect_all(works)

            return self._launch(issue)

        def decode(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            with self.metrics.timed("decompress_s"):
                if guard.received_marker(tensors):
                    return self._marker(grad)
                summed = Payload(tensors[: len(payload.tensors)], payload.ctx)
                return self.compressor.decompress(summed, like=grad)

        return self.queue.submit(launch).then(decode)

    def _all_gather(self, key, payload: Payload, wire_tensors, grad: Tensor, world_size: int, dense_bytes: int) -> Future:
        send = wire.to_bytes(wire_tensors)
        recv = torch.empty(world_size * send.numel(), dtype=torch.uint8, device=send.device)
        self.metrics.add_bucket(key, payload_bytes=send.numel(), dense_bytes=dense_bytes, collective="allgather")

        def launch() -> Future:
            return self._launch(
                lambda: dist.all_gather_single(recv, send, group=self.group, async_op=True).get_future()
            )

        def decode(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            with self.metrics.timed("decompress_s"):
                chunks = recv.view(world_size, -1)
                received = [wire.from_bytes(chunks[r], wire_tensors) for r in range(world_size)]
                if any(guard.received_marker(tensors) for tensors in received):
                    return self._marker(grad)
                payloads = [Payload(tensors[: len(payload.tensors)], payload.ctx) for tensors in received]
                return decode_gathered(self.compressor, payloads, grad)

        return self.queue.submit(launch).then(decode)

    def state_dict(self) -> dict[str, Any]:
        """Codec and error-feedback state, after settling the step in progress."""
        self.settle()
        return {
            "compressor": self.compressor.state_dict(),
            "feedback": None if self.feedback is None else self.feedback.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (anything staged is dropped)."""
        self.ledger = guard.StepLedger()
        self._codec_snapshot = None
        self.compressor.load_state_dict(state["compressor"])
        if self.feedback is not None:
            self.feedback.discard()
            if state["feedback"] is not None:
                self.feedback.load_state_dict(state["feedback"])
