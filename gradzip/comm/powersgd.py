"""PowerSGD's two-round reducer (Vogels et al. 2019, arXiv 1905.13727).

For one bucket (a flat tensor holding several gradients) at a step past ``start_step``:

1. Split the bucket into gradients; those that compress (``(n + m) r < n m``) are viewed as
   ``n x m`` matrices ``M``, error-compensated in fp32.
2. Round 1: one all_reduce of ``[uncompressed / world_size, P_1 / world_size .. P_k / world_size]``
   with ``P = M Q``.
3. Orthogonalize each summed ``P`` in fp32 (reduced QR).
4. Round 2: one all_reduce of ``[Q_1 / world_size .. Q_k / world_size]`` with ``Q = M^T P``.
5. Output ``P Q^T``; residual ``M - P Q_local^T``; keep the averaged ``Q`` to warm-start the
   next step.

Non-finite gradients (:mod:`gradzip.comm.nonfinite`): a rank whose bucket holds inf or NaN sends a
round 1 of NaN; every rank then sees a non-finite round-1 sum, skips round 2 (all ranks agree,
as the sum is the same everywhere), returns all NaN, and the step's residual and warm-start
updates are dropped. Factors are divided by world_size before they are summed and saturated at
the wire dtype's range, and an overflowing product is recomputed in float64, so finite input
gives finite output whatever its magnitude.

Both rounds go through the group's :class:`~gradzip.comm.queue.CollectiveQueue`, queued when the
bucket is hooked, so every rank issues them in the same order however callbacks interleave. A
bucket with no matrix to compress takes round 1 only; an empty bucket takes no collective.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import nonfinite
from gradzip.comm.queue import CollectiveQueue, completed
from gradzip.comm.settling import SettlingReducer
from gradzip.comm.traffic import allreduce_bytes, dense_probe
from gradzip.compressors.base import seeded_generator
from gradzip.compressors.int8sum import from_codes, to_codes
from gradzip.compressors.int8sum import levels_for as int8_levels
from gradzip.compressors.kernels import wire
from gradzip.compressors.kernels.placement import to_device
from gradzip.compressors.lowrank import PowerSGD, matrix_view_shape
from gradzip.keys import tensor_key
from gradzip.metrics import QualityAccumulator, StepMetrics, quality_figures


def orthogonalize(p: Tensor) -> Tensor:
    """Orthonormal columns spanning ``p`` (``n x r``, computed in fp32 by reduced QR).

    Entries so large that QR's internal norms overflow are first scaled down (the span does not
    change with a common scale).
    """
    p = p.float()
    peak = float(p.abs().max()) if p.numel() else 0.0
    if peak > 2.0**60:
        p = p / peak
    return torch.linalg.qr(p, mode="reduced").Q


def product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of fp32 matrices, ``b`` narrow (``m x r``: ``M Q`` and ``M^T P``); where fp32
    overflows, recomputed in float64 and saturated at the fp32 range (finite inputs give a
    finite product).

    Computed as ``(b^T a^T)^T`` (a transposed view is returned): CPU GEMM with a narrow
    row-major right operand is about 10x slower than the same product with the narrow operand
    on the left, and these two products are most of PowerSGD's compute.
    """
    out = (b.T @ a.T).T
    if nonfinite.is_finite(out):
        return out
    return nonfinite.saturate(a.double() @ b.double(), torch.float32).float()


def to_wire(t: Tensor, world_size: int, dtype: torch.dtype) -> Tensor:
    """``t / world_size`` saturated at the range of ``dtype``, so the sum over ranks cannot overflow."""
    return nonfinite.saturate(t.div(world_size), dtype).to(dtype)


@dataclass
class _Layout:
    """Where each gradient of a bucket sits and whether it is compressed."""

    offsets: list[int]
    shapes: list[torch.Size]
    compressed: list[int]  # indices into shapes
    uncompressed: list[int]
    codecs: list[PowerSGD]  # the codec (rank) of each layer


class PowerSGDReducer(SettlingReducer):
    """Averages buckets over ``group`` with PowerSGD and error feedback.

    Args:
        compressor: the :class:`~gradzip.compressors.lowrank.PowerSGD` parameters.
        group: the process group (None: the default group).
        queue: the ordered launch queue shared by every reducer of ``group``.
        metrics: where bytes and times go.
        ledger: the steps whose gradient was not finite, shared by every reducer of one hook;
            None for a ledger of this reducer's own.
    """

    def __init__(
        self,
        compressor: PowerSGD,
        *,
        group: dist.ProcessGroup | None = None,
        queue: CollectiveQueue | None = None,
        metrics: StepMetrics | None = None,
        ledger: nonfinite.StepLedger | None = None,
    ) -> None:
        # Residual and warm-start updates stay undoable until the step is known to be finite.
        super().__init__(compressor, group=group, queue=queue, metrics=metrics, ledger=ledger)
        self.q_memory: dict[Hashable, Tensor] = {}
        self.q_replaced: dict[Hashable, Tensor | None] = {}  # key -> warm start before the step
        #: per bucket, a codec per layer (a rank per layer; None sends the layer dense), set by
        #: a per-layer plan (:mod:`gradzip.comm.layered`); buckets without one use ``compressor``
        self.layer_codecs: dict[Hashable, list[PowerSGD | None]] = {}

    def _codecs(self, key: Hashable, n_layers: int) -> list[PowerSGD | None]:
        codecs = self.layer_codecs.get(key)
        return codecs if codecs is not None and len(codecs) == n_layers else [self.compressor] * n_layers

    def _layout(self, grad: Tensor, shapes: Sequence[torch.Size] | None, key: Hashable = None) -> _Layout:
        shapes = [torch.Size(s) for s in shapes] if shapes is not None else [grad.shape]
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += shape.numel()
        if total != grad.numel():
            raise ValueError(f"shapes cover {total} elements but the bucket holds {grad.numel()}")
        codecs = self._codecs(key, len(shapes))
        compressed = [i for i, (s, c) in enumerate(zip(shapes, codecs)) if c is not None and c.compresses(s)]
        chosen = set(compressed)
        uncompressed = [i for i in range(len(shapes)) if i not in chosen]
        return _Layout(offsets, shapes, compressed, uncompressed, [c or self.compressor for c in codecs])

    def _initial_q(self, key: Hashable, m: int, r: int, step: int, device: torch.device) -> Tensor:
        # Drawn on the host on purpose (the same Q on every device), copied without blocking.
        gen = seeded_generator(self.compressor.seed, step, key)
        return to_device(torch.randn(m, r, generator=gen, dtype=torch.float32), device)

    def reduce(
        self,
        key: Hashable,
        grad: Tensor,
        *,
        step: int,
        shapes: Sequence[torch.Size] | None = None,
        flush: bool = True,
    ) -> Future:
        """Start averaging a bucket.

        Args:
            key: the bucket's name across steps (its index).
            grad: flat (or any shape, read flat) floating tensor holding the gradients.
            step: the training step.
            shapes: shapes of the gradients laid end to end in ``grad``; None treats ``grad``
                as one tensor of its own shape.
            flush: accepted for the :class:`~gradzip.comm.Reducer` interface; nothing is held
                back (small tensors already travel uncompressed in round 1).

        Returns:
            a future whose value is the approximate mean, ``grad``'s shape and dtype; all NaN on
            every rank if the bucket held inf or NaN on any rank. The future carries the
            collective's error if a collective failed.

        Raises:
            ValueError: if ``shapes`` do not add up to ``grad.numel()``.
        """
        self._begin(key, step)
        world_size = dist.get_world_size(self.group)
        if grad.numel() == 0:
            return completed(grad.clone())
        if step < self.compressor.start_step:
            return self._reduce_dense(key, grad, world_size, step=step)
        layout = self._layout(grad, shapes, key)
        flat = grad.reshape(-1)
        pieces = [flat[o : o + s.numel()] for o, s in zip(layout.offsets, layout.shapes)]
        wire_dtype = grad.dtype
        factor_dtype = self.compressor.factor_dtype(grad.dtype)
        low_bit = factor_dtype != wire_dtype
        int8 = factor_dtype == torch.int8
        levels = int8_levels(world_size) if int8 else 0
        out = torch.empty_like(flat)
        device = grad.device

        # Step 1: error-compensated matrices and their Q.
        with self.metrics.timed("compress_s", key):
            matrices, qs, sendable = [], [], True
            for i in layout.compressed:
                n, m = matrix_view_shape(layout.shapes[i])
                r = layout.codecs[i].effective_rank(n, m)
                name = tensor_key(key, i)
                piece = pieces[i].view(n, m)
                mat, finite = nonfinite.checked_input(piece, self.feedback.compensate(name, piece, step=step))
                matrices.append(mat)
                sendable = sendable and finite
                q = self.q_memory.get(name) if self.compressor.warm_start else None
                if q is not None and q.device != grad.device:  # loaded from a checkpoint onto the CPU
                    q = self.q_memory[name] = q.to(grad.device)
                if q is None or q.shape != (m, r):
                    q = self._initial_q(name, m, r, step if not self.compressor.warm_start else 0, grad.device)
                qs.append(q)
        uncompressed = [self._dense_piece(tensor_key(key, i), pieces[i], step) for i in layout.uncompressed]
        sendable = sendable and all(nonfinite.is_finite(pieces[i]) for i in layout.uncompressed)
        n_p = sum(mat.shape[0] * q.shape[1] for mat, q in zip(matrices, qs))
        round1 = torch.cat(
            [torch.cat(uncompressed).div(world_size) if uncompressed else flat.new_empty(0)]
            + [flat.new_empty(0 if low_bit else n_p)]
        ).to(wire_dtype)
        n_uncompressed = sum(p.numel() for p in uncompressed)
        # Round 1's P: the tail of round1, or its own tensor where the factors travel narrower.
        p_wire = torch.empty(n_p, dtype=factor_dtype, device=grad.device) if low_bit else round1[n_uncompressed:]
        round1_parts = [t for t in ((round1, p_wire) if low_bit else (round1,)) if t.numel()]
        round2 = torch.empty(sum(q.numel() for q in qs), dtype=factor_dtype, device=grad.device)
        # int8 factors: one fp32 scale per column of each factor, agreed by an all_reduce MAX
        # first; p_scales[j] and q_scales[j] are matrix j's columns of them (views).
        p_scale = torch.zeros(sum(q.shape[1] for q in qs) if int8 else 0, device=grad.device)
        q_scale = torch.zeros_like(p_scale)
        widths = [q.shape[1] for q in qs] if int8 else []
        p_scales, q_scales = p_scale.split(widths), q_scale.split(widths)
        sent = sum(allreduce_bytes(wire.nbytes([t]), world_size) for t in round1_parts)
        sent += allreduce_bytes(wire.nbytes([round2]), world_size)
        sent += 2 * allreduce_bytes(wire.nbytes([p_scale]), world_size)
        self.metrics.add_bucket(
            key, payload_bytes=wire.nbytes(round1_parts) + wire.nbytes([round2, p_scale, q_scale]),
            dense_bytes=grad.numel() * grad.element_size(), collective="allreduce",
            compressed=bool(matrices), sent_bytes=sent, received_bytes=sent, codec=self.compressor.spec,
        )
        if key in self.layer_codecs:
            chosen = set(layout.compressed)
            self.metrics.add_layers(key, [
                {"codec": c.spec if i in chosen else "none", "numel": shape.numel(),
                 "payload_bytes": c.matrix_payload_nbytes(shape, grad.dtype) if i in chosen else shape.numel() * grad.element_size()}
                for i, (shape, c) in enumerate(zip(layout.shapes, layout.codecs))
            ])
        monitored = self.metrics.wants_quality(step)
        p_hat: list[Tensor] = []
        q_local_list: list[Tensor] = []
        p_local: list[Tensor] = []  # int8: this rank's P, waiting for the shared scale
        q_raw: list[Tensor] = []  # int8: this rank's Q, waiting for the shared scale
        box = {"skip": False}  # int8: some rank's bucket was not finite (seen in a scale round)

        def scale_round(factors: list[Tensor], scale: Tensor, columns: tuple[Tensor, ...], finite: bool) -> Future:
            """All ranks agree on max|factor| per column of every factor (``columns``: views of
            ``scale``, one per factor); +inf marks a bucket that was not finite."""
            if finite:
                for f, column_scales in zip(factors, columns):
                    if f.numel():
                        column_scales.copy_(f.abs().amax(dim=0))
            else:
                scale.fill_(float("inf"))
            work = dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            return self.metrics.track(work.get_future(), (key,))

        def scale_marker(scale: Tensor) -> bool:
            if scale.numel() and not bool(torch.isfinite(scale).all()):
                box["skip"] = True
                self.ledger.mark_nonfinite(step)
            return box["skip"]

        def launch_p_scale() -> Future:
            with self.metrics.timed("compress_s", key):
                if sendable:
                    p_local.extend(product(mat, q) for mat, q in zip(matrices, qs))
            return scale_round(p_local, p_scale, p_scales, sendable)

        def all_reduce_round1() -> Future:
            futures = [self._all_reduce(key, t) for t in round1_parts]
            return futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)

        # Step 2: P = M Q for every matrix, one all_reduce with the uncompressed gradients (two
        # where the factors travel in a narrower dtype).
        def launch_p() -> Future:
            if int8 and scale_marker(p_scale):
                return completed(None)  # the MAX is the same on every rank: all skip together
            with self.metrics.timed("compress_s", key):
                if int8 and matrices:
                    offset = 0
                    for j, p in enumerate(p_local):
                        codes = to_codes(p, p_scales[j], levels)
                        p_wire[offset : offset + p.numel()] = codes.reshape(-1)
                        offset += p.numel()
                    return all_reduce_round1()
                if not sendable:
                    for t in round1_parts:
                        t.fill_(float("nan"))  # the marker: every rank's sum turns NaN
                    return all_reduce_round1()
                offset = 0
                for mat, q in zip(matrices, qs):
                    p = to_wire(product(mat, q), world_size, factor_dtype)
                    p_wire[offset : offset + p.numel()] = p.reshape(-1)
                    offset += p.numel()
            return all_reduce_round1()

        # Steps 3 and 4: orthogonalize P, then Q = M^T P, one all_reduce.
        def prepare_q() -> bool:
            """Orthogonalize the summed P and compute this rank's Q; False if some rank's bucket
            was not finite (the sum is the same on every rank, so all of them skip together)."""
            if box["skip"]:
                return False
            if nonfinite.received_marker(round1_parts):
                self.ledger.mark_nonfinite(step)
                box["skip"] = True
                return False
            with self.metrics.timed("compress_s", key):
                offset = 0
                for mat, q in zip(matrices, qs):
                    n, r = mat.shape[0], q.shape[1]
                    summed = p_wire[offset : offset + n * r].view(n, r)
                    # int8: the summed codes are the sum with each column scaled by a positive
                    # number, which leaves QR's orthonormal basis as it is; they cannot overflow.
                    p = orthogonalize(summed)
                    p_hat.append(p)
                    q_raw.append(product(mat.T, p))
                    offset += n * r
            return True

        def launch_q_scale() -> Future:
            if not prepare_q():
                return completed(None)
            return scale_round(q_raw, q_scale, q_scales, True)

        def launch_q() -> Future:
            if int8 and scale_marker(q_scale):
                return completed(None)
            if not int8 and not prepare_q():
                return completed(None)
            with self.metrics.timed("compress_s", key):
                q_offset = 0
                for j, q_local in enumerate(q_raw):
                    if int8:
                        codes = to_codes(q_local, q_scales[j], levels)
                        round2[q_offset : q_offset + q_local.numel()] = codes.reshape(-1)
                        # The residual is taken against this rank's Q as its codes carry it.
                        q_local_list.append(from_codes(codes, q_scales[j], levels))
                        q_offset += q_local.numel()
                        continue
                    q_sent = to_wire(q_local, world_size, factor_dtype)
                    round2[q_offset : q_offset + q_local.numel()] = q_sent.reshape(-1)
                    # Low-bit factors: the residual is taken against what this rank's Q became
                    # on the wire, so the rounding is fed back too.
                    q_local_list.append(q_sent.float().mul_(world_size) if low_bit else q_local)
                    q_offset += q_local.numel()
            return self._all_reduce(key, round2)

        # Step 5: decode, update residuals and Q memory.
        def finish(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            if box["skip"] or nonfinite.received_marker([*round1_parts, round2]):
                return self.ledger.marked_result(step, grad)
            quality = QualityAccumulator() if monitored else None
            with self.metrics.timed("decompress_s", key):
                offset = 0
                for i, piece in zip(layout.uncompressed, uncompressed):
                    o = layout.offsets[i]
                    out[o : o + piece.numel()] = round1[offset : offset + piece.numel()]
                    offset += piece.numel()
                q_offset = 0
                for j, i in enumerate(layout.compressed):
                    mat, p, q_local = matrices[j], p_hat[j], q_local_list[j]
                    name = tensor_key(key, i)
                    q_mean = round2[q_offset : q_offset + q_local.numel()].view_as(q_local).float()
                    if int8:  # the summed codes, back to the mean of the ranks' Q
                        q_mean = from_codes(q_mean, q_scales[j], levels * world_size)
                    q_offset += q_local.numel()
                    o = layout.offsets[i]
                    self._decode(p, q_mean, out[o : o + mat.numel()].view(mat.shape))
                    if quality is not None:
                        local = p @ q_local.T
                        self.feedback.update(name, mat, local, step=step)
                        # the residual just stored is exactly mat - local
                        quality.add(mat, local, difference=self.feedback.residuals.get(name))
                    else:
                        # mat - P Q_local^T in place: mat is this reducer's own copy (the
                        # compensated gradient) and is not read again, so the residual costs
                        # one fused pass and no allocation.
                        self.feedback.store(name, mat.addmm_(p, q_local.T, alpha=-1), step=step)
                    if self.compressor.warm_start:
                        self.q_replaced.setdefault(name, self.q_memory.get(name))
                        # A copy, not a view into round2: a resumed run starts from a freshly
                        # allocated copy, and CPU matmul can round differently for an operand at
                        # an arbitrary offset, so the live run keeps the same kind of tensor.
                        self.q_memory[name] = q_mean.clone()
            if quality is not None:
                for piece in uncompressed:
                    quality.add_exact(piece)
                quality.add_gradient(grad)
                for i in layout.compressed:
                    quality.add_residual(self.feedback.residuals.get(tensor_key(key, i)))
                self.metrics.add_quality(key, quality.figures())
            return out.view(grad.shape)

        if int8 and matrices:
            first = self.queue.submit(launch_p, after=self.queue.submit(launch_p_scale, device=device), device=device)
            return self.queue.submit(launch_q, after=self.queue.submit(launch_q_scale, after=first, device=device), device=device).then(finish)
        first = self.queue.submit(launch_p, device=device)
        if not matrices:
            return first.then(finish)
        return self.queue.submit(launch_q, after=first, device=device).then(finish)

    def _dense_piece(self, key: Hashable, piece: Tensor, step: int) -> Tensor:
        """A layer sent uncompressed: with the residual a lower rank left it (a per-layer plan
        that moved it to dense), which then travels whole and is forgotten."""
        residual = self.feedback.residuals.get(key)
        if residual is None or residual.numel() != piece.numel():
            return piece
        compensated = piece + residual.reshape(-1).to(piece.dtype)
        self.feedback.drop(key, step=step)
        return nonfinite.checked_input(piece, compensated)[0]

    @staticmethod
    def _decode(p: Tensor, q_mean: Tensor, out: Tensor) -> None:
        """Write ``p @ q_mean.T`` into ``out`` (``n x m``, any floating dtype). Each entry is at
        most ``sqrt(r) * max|q_mean|`` (``p`` has orthonormal columns); only past ``out``'s range
        is it computed in float64 and saturated, a decision the same on every rank since
        ``q_mean`` is."""
        bound = float(q_mean.abs().max()) * math.sqrt(q_mean.shape[1]) if q_mean.numel() else 0.0
        if bound >= torch.finfo(out.dtype).max:
            out.copy_(nonfinite.saturate(p.double() @ q_mean.double().T, out.dtype))
        elif out.dtype == p.dtype:
            torch.mm(p, q_mean.T, out=out)
        else:
            out.copy_(p @ q_mean.T)

    def _settle(self, keep: bool) -> None:
        # the warm-start factors settle with the residuals: kept, or put back as they were
        super()._settle(keep)
        if not keep:
            for key, old in self.q_replaced.items():
                if old is None:
                    self.q_memory.pop(key, None)
                else:
                    self.q_memory[key] = old
        self.q_replaced = {}

    def _all_reduce(self, key: Hashable, tensor: Tensor) -> Future:
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return self.metrics.track(work.get_future(), (key,))

    def _reduce_dense(self, key: Hashable, grad: Tensor, world_size: int, *, step: int = 0) -> Future:
        tensor = grad.div(world_size)
        if not nonfinite.is_finite(grad):
            tensor.fill_(float("nan"))  # the marker; an inf alone could pass for an overflow
        sent = allreduce_bytes(wire.nbytes([tensor]), world_size)
        self.metrics.add_bucket(
            key, payload_bytes=tensor.numel() * tensor.element_size(),
            dense_bytes=grad.numel() * grad.element_size(), collective="dense", compressed=False,
            sent_bytes=sent, received_bytes=sent, codec=self.compressor.spec,
        )
        if self.metrics.wants_quality(step):
            self.metrics.add_quality(key, quality_figures(grad, grad))

        def finish(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            if not nonfinite.received_marker([tensor]):
                return tensor
            return self.ledger.marked_result(step, tensor)

        return self.queue.submit(lambda: self._all_reduce(key, tensor), device=tensor.device).then(finish)

    def probe(self, key: Hashable, grad: Tensor, *, step: int, shapes: Sequence[torch.Size] | None = None) -> dict[str, Any]:
        """One local power iteration on ``grad`` (as one rank alone would run it): no collective,
        no state change. Used by controllers to price PowerSGD on a real bucket; before
        ``start_step`` the dense all_reduce the bucket then takes (exact, no encoding).

        Returns:
            ``compress_s`` (P = M Q, orthogonalize, Q = M^T P), ``decompress_s`` (P Q^T),
            ``payload_bytes`` (both rounds), ``sent_bytes`` (what this rank sends in both ring
            all_reduces), ``collectives`` (1 or 2) and ``decoded`` (the rank-r approximation,
            ``grad``'s shape).
        """
        world_size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if step < self.compressor.start_step:
            return dense_probe(grad, world_size)  # before start_step the bucket travels dense
        layout = self._layout(grad, shapes, key)
        flat = grad.reshape(-1)
        decoded = flat.clone()
        compress_s = decompress_s = 0.0
        payload_bytes = sum(layout.shapes[i].numel() for i in layout.uncompressed) * grad.element_size()
        factor_bytes = 0
        for i in layout.compressed:
            n, m = matrix_view_shape(layout.shapes[i])
            r = layout.codecs[i].effective_rank(n, m)
            o = layout.offsets[i]
            mat = flat[o : o + n * m].view(n, m).float()
            q = self.q_memory.get(tensor_key(key, i))
            start = time.perf_counter()
            if q is None or q.shape != (m, r):
                q = self._initial_q(tensor_key(key, i), m, r, step, grad.device)
            p = orthogonalize(product(mat, q))
            q_local = product(mat.T, p)
            middle = time.perf_counter()
            decoded[o : o + n * m] = (p @ q_local.T).reshape(-1).to(decoded.dtype)
            end = time.perf_counter()
            compress_s += middle - start
            decompress_s += end - middle
            factor_item = wire.dtype_nbytes(self.compressor.factor_dtype(grad.dtype))
            payload_bytes += layout.codecs[i].matrix_payload_nbytes(layout.shapes[i], grad.dtype)
            factor_bytes += m * r * factor_item
        sent = allreduce_bytes(payload_bytes - factor_bytes, world_size) + allreduce_bytes(factor_bytes, world_size)
        return {
            "compress_s": compress_s, "decompress_s": decompress_s, "payload_bytes": payload_bytes,
            "sent_bytes": sent, "collectives": 2 if layout.compressed else 1, "decoded": decoded.view(grad.shape),
        }

    def take_residual(self, key: Hashable, shapes: Sequence[torch.Size] | None = None) -> Tensor | None:
        """Remove the residuals of bucket ``key`` and return them laid out as the flat bucket
        (zeros where a gradient travelled uncompressed), or None if there are none.

        Used when a bucket changes codec, so that what PowerSGD dropped is not lost.
        """
        if shapes is None:
            return None
        shapes = [torch.Size(s) for s in shapes]
        total = sum(s.numel() for s in shapes)
        out, found, offset = None, False, 0
        for i, shape in enumerate(shapes):
            residual = self.feedback.take(tensor_key(key, i))
            if residual is not None and residual.numel() == shape.numel():
                if out is None:
                    out = torch.zeros(total, dtype=residual.dtype, device=residual.device)
                out[offset : offset + shape.numel()] = residual.reshape(-1)
                found = True
            offset += shape.numel()
        return out if found else None

    def state_dict(self) -> dict[str, Any]:
        """Residuals and warm-start factors, for checkpoints (they differ across ranks), after
        settling the step in progress."""
        return {**super().state_dict(), "q_memory": {k: v.clone() for k, v in self.q_memory.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (anything undoable is forgotten)."""
        super().load_state_dict(state)
        self.q_replaced = {}
        self.q_memory = {k: v.clone() for k, v in state["q_memory"].items()}
