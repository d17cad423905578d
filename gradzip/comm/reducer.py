"""The single-round reducer: the mean over a process group of compressed tensors.

Each bucket takes one route of :data:`gradzip.comm.routes.REGISTRY` (family ``mean``), chosen
by :func:`gradzip.comm.routes.choose_collective` from the bytes each would send for the codec, the
bucket and the world size, identical on every rank: ``allreduce`` (aggregatable payloads),
``allgather``, ``twophase`` (:mod:`gradzip.comm.twophase`), or ``dense`` where compressing would
not send fewer bytes. Each route's module holds its collective calls; this reducer holds the
state they share (codec, residuals, queue, metrics, the non-finite ledger).

Buckets smaller than ``min_compress_bytes`` are held back and sent uncompressed, concatenated
into one ``all_reduce`` (one per dtype): a DDP hook sees one bucket at a time, so the reducer
keeps them until the caller says no more are coming this step (``flush=True``, which the DDP
hook passes with the last bucket of the backward pass) or until they add up to
``min_compress_bytes``. Their futures complete when that collective does. DDP hooks every
bucket before it waits on any future, and does so in the same order on every rank, so holding
buckets back cannot deadlock and the fused collective is issued at the same point everywhere.

Every collective goes through the group's :class:`~gradzip.comm.queue.CollectiveQueue`, and
each round's compression runs inside its launch, so ``reduce`` returns a future at once.

Non-finite gradients follow :mod:`gradzip.comm.nonfinite` on every route: a rank whose input holds
inf or NaN sends a NaN-marked payload in the same collective, every rank returns all NaN for
that bucket, and the step's error-feedback and codec updates are dropped.

On the steps :meth:`gradzip.metrics.StepMetrics.wants_quality` names, the ``allreduce`` and
``allgather`` routes record quality figures of the bucket (its local decode against what was
handed to the codec; codecs without error feedback decode once more for it, outside the timed
compression); the ``dense`` and ``fused`` routes record the exact figures; the ``twophase``
route records none.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import devices, nonfinite
from gradzip.comm.queue import CollectiveQueue, completed
from gradzip.comm.routes import COLLECTIVES, REGISTRY, check_collective, choose_collective, explain_collective
from gradzip.comm.traffic import dense_probe
from gradzip.comm.twophase import TwoPhaseAllReduce
from gradzip.compressors import Compressor, Payload, check_int
from gradzip.compressors.kernels import wire
from gradzip.feedback import ErrorFeedback, check_decay, check_error_feedback
from gradzip.keys import label
from gradzip.metrics import StepMetrics, quality_figures

__all__ = ["COLLECTIVES", "CompressedReducer", "Held"]


@dataclass
class Held:
    """A small bucket waiting for the fused all_reduce (route ``fused``)."""

    key: Hashable
    grad: Tensor
    step: int
    future: Future


class CompressedReducer:
    """Averages tensors over ``group`` through ``compressor``.

    Args:
        compressor: a single-round codec.
        group: the process group (None: the default group).
        error_feedback: keep residuals per key (worker-side, and server-side for the two-phase
            route); None uses the codec's default.
        collective: ``auto`` (the route sending the fewest bytes), ``allreduce``, ``allgather``
            or ``twophase``; a forced route still sends a bucket ``dense`` where the codec's
            payload would exceed its raw bytes.
        min_compress_bytes: buckets with fewer raw bytes travel uncompressed, fused into one
            all_reduce (see the module docstring); an integer >= 0, 0 compresses everything.
        queue: the ordered launch queue shared by every reducer of ``group``.
        metrics: where bytes and times go.
        ledger: the steps whose gradient was not finite, shared by every reducer of one hook
            (:class:`gradzip.comm.nonfinite.StepLedger`); None for a ledger of this reducer's own.
        feedback_decay: the worker-side residual is multiplied by this in (0, 1] before it is
            added back (:class:`gradzip.feedback.ErrorFeedback`'s ``decay``); 1 is plain error
            feedback. Needs error feedback on.

    Raises:
        ValueError: for an unknown ``collective``, ``allreduce`` with a codec that is not
            aggregatable, a negative ``min_compress_bytes``, or a ``feedback_decay`` out of
            (0, 1] or other than 1 without error feedback.
    """

    def __init__(
        self,
        compressor: Compressor,
        *,
        group: dist.ProcessGroup | None = None,
        error_feedback: bool | None = None,
        collective: str = "auto",
        min_compress_bytes: int = 0,
        queue: CollectiveQueue | None = None,
        metrics: StepMetrics | None = None,
        ledger: nonfinite.StepLedger | None = None,
        feedback_decay: float = 1.0,
    ) -> None:
        assert not compressor.multi_round, "multi-round codecs bring their own reducer"
        self.compressor = nonfinite.with_marker_slot(compressor)
        self.group = group
        self.collective = check_collective(collective, compressor)
        self.min_compress_bytes = check_int(min_compress_bytes, name="min_compress_bytes", low=0)
        use_feedback = compressor.error_feedback if check_error_feedback(error_feedback) is None else error_feedback
        feedback_decay = check_decay(feedback_decay)
        if feedback_decay != 1.0 and not use_feedback:
            raise ValueError(f"feedback_decay needs error feedback on; got feedback_decay={feedback_decay} without it")
        # Residual updates stay undoable until the step is known to be finite on every rank.
        self.feedback = ErrorFeedback(deferred=True, decay=feedback_decay) if use_feedback else None
        self.queue = queue or CollectiveQueue()
        self.metrics = metrics or StepMetrics()
        self.ledger = ledger or nonfinite.StepLedger()
        self.open_step = nonfinite.OpenStep()
        self._codec_snapshot: dict[str, Any] | None = None
        self.twophase = TwoPhaseAllReduce(
            self.compressor, group=group, queue=self.queue, metrics=self.metrics, feedback=self.feedback,
            server_feedback=ErrorFeedback(deferred=True, follow=False) if use_feedback else None, ledger=self.ledger,
        )
        self._routes: dict[tuple[int, torch.dtype, int], str] = {}
        #: the route each bucket was last recorded taking (see :meth:`_note_route`)
        self._noted_routes: dict[Hashable, str] = {}
        self._held: list[Held] = []
        self._held_bytes = 0
        self._lock = threading.Lock()

    def route(self, numel: int, dtype: torch.dtype, *, step: int | None = None) -> str:
        """The route a tensor of ``numel`` elements of ``dtype`` takes (at ``step``, if given:
        ``dense`` before the codec's ``start_step``): ``fused`` below ``min_compress_bytes``,
        else one of :data:`gradzip.comm.routes.ROUTES`."""
        if step is not None and step < self.compressor.start_step:
            return "dense"
        if numel * wire.dtype_nbytes(dtype) < self.min_compress_bytes:
            return "fused"
        world_size = dist.get_world_size(self.group)
        cache_key = (numel, dtype, world_size)
        if cache_key not in self._routes:
            self._routes[cache_key] = choose_collective(self.collective, self.compressor, numel, dtype, world_size)
        return self._routes[cache_key]

    def reduce(
        self,
        key: Hashable,
        grad: Tensor,
        *,
        step: int,
        shapes: Sequence[torch.Size] | None = None,
        flush: bool = True,
    ) -> Future:
        """Start averaging ``grad`` over the group; returns at once.

        Args:
            key: names the tensor across steps (a bucket, see :mod:`gradzip.keys`); keys the residuals.
            grad: any shape, floating dtype; not modified, and must stay unchanged until the
                future completes (as DDP's bucket buffers do).
            step: the training step (seeds and schedules).
            shapes: ignored (single-round codecs see the flat tensor).
            flush: send every held-back small tensor now (see the module docstring); pass False
                only when more tensors of this step follow and a later call flushes.

        Returns:
            a future whose value is the mean, with ``grad``'s shape and dtype; all NaN on every
            rank if ``grad`` held inf or NaN on any rank (see :mod:`gradzip.comm.nonfinite`). The
            future carries the collective's error if the collective failed.
        """
        self._begin(key, step)
        if grad.numel() == 0:
            fut = completed(grad.clone())
        else:
            name = self.route(grad.numel(), grad.dtype, step=step)
            self._note_route(key, name, grad, step)
            fut = REGISTRY[name].launch(self, key, grad, step=step)
        if flush or self._held_bytes >= max(self.min_compress_bytes, 1):
            self.flush()
        return fut

    def _note_route(self, key: Hashable, name: str, grad: Tensor, step: int) -> None:
        """Record, as a ``route`` event of the step's metrics, the route bucket ``key`` takes and
        why, when it takes it first or takes another (at the codec's ``start_step``, say)."""
        if self._noted_routes.get(key) == name:
            return
        self._noted_routes[key] = name
        if step < self.compressor.start_step:
            why = f"before the codec's start_step ({self.compressor.start_step})"
        elif name == "fused":
            why = f"below min_compress_bytes ({self.min_compress_bytes:,} raw bytes): fused, uncompressed"
        else:
            why = explain_collective(self.collective, self.compressor, grad.numel(), grad.dtype, dist.get_world_size(self.group))
        self.metrics.add_event({"kind": "route", "step": step, "bucket": label(key), "route": name, "why": why})

    def flush(self) -> None:
        """Send the held-back small tensors: one uncompressed all_reduce per dtype."""
        with self._lock:
            held, self._held, self._held_bytes = self._held, [], 0
        by_dtype: dict[torch.dtype, list[Held]] = {}
        for item in held:
            by_dtype.setdefault(item.grad.dtype, []).append(item)
        for group in by_dtype.values():
            REGISTRY["fused"].send(self, group)

    def _begin(self, key: Hashable, step: int) -> None:
        """Settle the previous step when a new one starts, and snapshot a stateful codec."""
        closed = self.open_step.begin(key, step)
        if closed is not None:
            self._settle(self.ledger.finite(closed))
        if len(self.open_step.keys) == 1:
            state = self.compressor.state_dict()
            self._codec_snapshot = nonfinite.clone_state(state) if state else None

    def _settle(self, keep: bool) -> None:
        for feedback in (self.feedback, self.twophase.server_feedback):
            if feedback is not None and keep:
                feedback.commit()
            elif feedback is not None:
                feedback.discard()
        if not keep and self._codec_snapshot is not None:
            self.compressor.load_state_dict(self._codec_snapshot)
        self._codec_snapshot = None

    def settle(self) -> None:
        """End the current step now: keep what it changed, or put it back if any bucket of the
        step was non-finite on some rank. ``reduce`` does this by itself when the next step
        starts, and :meth:`state_dict` before it reads the state."""
        closed = self.open_step.finish()
        self._settle(closed is None or self.ledger.finite(closed))  # changes made outside a step stay

    # -- what the routes' launches use ---------------------------------------------------------

    def deliver(
        self, bad: bool | Tensor, step: int, like: Tensor, decode: Callable[[], Tensor], *, all_nan: bool = False
    ) -> Tensor:
        """A route's result from what :func:`gradzip.comm.nonfinite.received` found: on the host,
        the all-NaN result if some rank marked the bucket, else ``decode()``; on a device,
        ``decode()`` marked NaN where the 0-d flag ``bad`` is true, the flag noted for the step
        (:mod:`gradzip.comm.nonfinite`). ``decode()`` must return a tensor of the reducer's own;
        ``all_nan`` says it is all NaN already wherever some rank sent the marker (a dense sum
        of tensors the sender filled with NaN), which saves the marking pass."""
        if isinstance(bad, bool):
            return self.ledger.marked_result(step, like) if bad else decode()
        self.ledger.note(step, bad)
        return decode() if all_nan else nonfinite.poison_where(decode(), bad)

    def encode(self, key: Hashable, grad: Tensor, step: int, box: dict[str, Any]) -> Payload:
        """Compensate, compress, update the residual; returns the payload (its bytes checked),
        NaN-marked if ``grad`` holds inf or NaN (known on the host). On a device the payload is
        returned as encoded and ``box["ok"]`` holds the 0-d finiteness flag for the route to mark
        what it sends with (:func:`gradzip.comm.nonfinite.mark`). On monitored steps leaves what
        the quality check needs in ``box``."""
        compensated = grad if self.feedback is None else self.feedback.compensate(key, grad, step=step)
        compensated, sendable = nonfinite.input_check(grad, compensated)
        if sendable is False:
            # Codecs need not accept inf or NaN: encode zeros for the payload's shapes, then mark it.
            return nonfinite.marked(self.compressor.compress(torch.zeros_like(compensated), step=step, key=key))
        payload = self.compressor.compress(compensated, step=step, key=key)
        decoded = None
        if self.feedback is not None:
            decoded = self.compressor.decompress(payload, like=compensated)
            self.feedback.update(key, compensated, decoded, step=step)
        assert payload.nbytes == self.compressor.payload_nbytes(grad.numel(), grad.dtype), (
            f"{self.compressor.name}: payload of {payload.nbytes} bytes, formula says "
            f"{self.compressor.payload_nbytes(grad.numel(), grad.dtype)}"
        )
        if self.metrics.wants_quality(step):
            # After an update at this step the residual is exactly compensated - decoded.
            updated = self.feedback is not None and step >= self.feedback.start_step
            box["quality"] = (compensated, decoded, payload, updated)
        if sendable is not True:
            box["ok"] = sendable  # a device flag: the route marks the tensors it sends (nonfinite.mark)
        return payload

    def record_quality(self, key: Hashable, grad: Tensor, box: dict[str, Any]) -> None:
        """Quality figures of a monitored step, computed outside the timed compression."""
        if "quality" not in box:
            return
        compensated, decoded, payload, updated = box.pop("quality")
        if decoded is None:
            decoded = self.compressor.decompress(payload, like=compensated)
        residual = None if self.feedback is None else self.feedback.residuals.get(key)
        difference = residual if updated and residual is not None and residual.shape == compensated.shape else None
        self.metrics.add_quality(
            key, quality_figures(compensated, decoded, grad=grad, residual=residual, difference=difference)
        )

    def probe(
        self, key: Hashable, grad: Tensor, *, step: int, shapes: Sequence[torch.Size] | None = None
    ) -> dict[str, Any]:
        """Compress and decode ``grad`` locally, with no collective and no state change.

        Used by controllers to price a codec on a real bucket, as it would travel at ``step``
        (dense, with the exact figures, before the codec's ``start_step``).

        Returns:
            ``compress_s`` and ``decompress_s`` (seconds; for the ``allgather`` route decoding is
            counted once per rank, as every rank decodes every payload), ``payload_bytes``,
            ``sent_bytes`` (what this rank sends by the route the bucket takes), ``collectives``
            (1; 2 for ``twophase``) and ``decoded`` (the local decode, ``grad``'s shape).
        """
        world_size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        route = self.route(grad.numel(), grad.dtype, step=step)
        if grad.numel() == 0 or not REGISTRY[route].compressed:
            return dense_probe(grad, world_size)
        start = time.perf_counter()
        payload = self.compressor.compress(grad, step=step, key=key)
        middle = time.perf_counter()
        decoded = self.compressor.decompress(payload, like=grad)
        end = time.perf_counter()
        return {
            "compress_s": middle - start,
            "decompress_s": (end - middle) * (world_size if route == "allgather" else 1),
            "payload_bytes": payload.nbytes,
            "sent_bytes": REGISTRY[route].sent_nbytes(self.compressor, grad.numel(), grad.dtype, world_size, rank),
            "collectives": REGISTRY[route].rounds_per_bucket,
            "decoded": decoded,
        }

    def take_residual(self, key: Hashable, shapes: Sequence[torch.Size] | None = None) -> Tensor | None:
        """Remove and return the worker-side residual of ``key`` (flat), or None; used when a bucket
        changes codec. (The two-phase route's server-side residual stays where it is.)"""
        if self.feedback is None:
            return None
        residual = self.feedback.take(key)
        return None if residual is None else residual.reshape(-1)

    def hold(self, key: Hashable, grad: Tensor, step: int) -> Future:
        """Keep ``grad`` for the next fused all_reduce; its future completes when that one does."""
        item = Held(key, grad, step, devices.new_future(grad.device))
        with self._lock:
            self._held.append(item)
            self._held_bytes += wire.nbytes([grad])
        return item.future

    def state_dict(self) -> dict[str, Any]:
        """Codec state and both error-feedback memories (worker-side, and server-side for the
        two-phase route), after settling the step in progress; they differ across ranks."""
        self.settle()
        return {
            "compressor": self.compressor.state_dict(),
            "feedback": None if self.feedback is None else self.feedback.state_dict(),
            **self.twophase.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (anything staged is dropped, and so is the
        ledger's record of non-finite steps: step numbers restart from the loaded state)."""
        self.open_step.finish()
        self.ledger.clear()
        self._codec_snapshot = None
        for feedback in (self.feedback, self.twophase.server_feedback):
            if feedback is not None:
                feedback.discard()
        self.compressor.load_state_dict(state["compressor"])
        if self.feedback is not None and state["feedback"] is not None:
            self.feedback.load_state_dict(state["feedback"])
        self.twophase.load_state_dict(state)
