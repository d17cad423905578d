"""Compressed gradient reduce-scatter of one FSDP2 module, with error feedback.

FSDP copies each module's gradients into one flat padded buffer and reduce-scatters it:
``input.view(world_size, -1)[r]`` is the chunk rank ``r`` keeps. :class:`CompressedReduceScatter`
replaces that collective (``gradzip.fsdp`` installs it with ``set_custom_reduce_scatter``) by a
route of the registry (:mod:`gradzip.comm.routes`, family ``shard``), chosen per call from the
codec's declared properties:

1. ``all_to_all`` (any single-round codec): compress each destination chunk, exchange the
   ``world_size`` payloads with one ``all_to_all_single``, decode the payloads of the own chunk
   and sum them in rank order. Nothing is re-compressed, so there is no server-side residual.
   Each rank sends ``(world_size - 1)`` chunk payloads of a chunk of ``numel / world_size``
   elements: flat in the world size.
2. ``reduce_scatter``: compress each destination chunk, reduce-scatter the payloads (summed on
   the wire), decode the own chunk once. The identity codec ``none`` always takes it (it is
   FSDP's own collective, so it equals FSDP's default bit for bit); other aggregatable codecs
   with an all floating-point payload take it where it sends no more bytes than the
   all_to_all: on a ring reduce-scatter (NCCL), not on gloo, whose reduce-scatter moves as
   much as an all_reduce (``2 (W-1)/W`` of the buffer per rank, measured; see
   :func:`gradzip.comm.traffic.reduce_scatter_bytes`).
3. Codecs with a reducer of their own whose payloads add up (PowerSGD, Vogels et al. 2019,
   arXiv 1905.13727; SEPARATE; Radius; the count sketch): each parameter is taken as the tensor
   its ``world_size`` chunks stack into (``(world_size * rows, cols...)``, the padded unsharded
   gradient for FSDP's default ``Shard(0)``) and the module's gradient is reduced by the codec's
   reducer exactly as the DDP hook reduces a bucket (one compression per rank, summed by
   ``all_reduce``, shared seeds and warm starts); each rank keeps its own rows of the mean. So
   each rank hands the codec's all_reduce payload for the whole module, the same at every world
   size, where a reduce-scatter of the raw buffer hands ``(W - 1) / W`` of it. PowerSGD's other
   parameters (1-D, or too small to gain) are reduce-scattered uncompressed; the other codecs
   take the whole module (SEPARATE sends its 1-D parameters dense in its own all_reduce). The
   matrix codecs (PowerSGD, SEPARATE) need the parameters' shard shapes; where they are unknown
   the whole buffer travels uncompressed, with a warning; the flat codecs (Radius, the count
   sketch) then reduce the buffer as it is.

A compressed exchange that would hand more bytes to its collective than the raw buffer falls
back to FSDP's plain reduce-scatter (route ``dense_reduce_scatter``, recorded as ``dense``) and
says so in the metrics (``uncompressed_buckets``).

Reduce ops: FSDP passes ``AVG`` (fp32 and bf16 reduce dtypes), ``SUM`` (fp16 reduce dtype, or
``set_force_sum_reduction_for_comms(True)``; FSDP divides before and after) or
``PREMUL_SUM(f)`` (a gradient divide factor other than the world size). All three are handled:
the mean, the sum, or ``f`` times the sum of the ranks' decoded chunks. gloo has no
``PREMUL_SUM``, so gradzip multiplies by ``f`` itself; an fp16 wire predivides ``AVG`` by the
world size (fp16 sums overflow). Other ops raise ``ValueError``.

Non-finite gradients follow :mod:`gradzip.comm.nonfinite` on the compressed single-round routes:
a rank whose buffer holds inf or NaN sends NaN-marked payloads of zeros for every chunk (codecs
with no floating tensor in their payload get the 2-byte marker slot), every rank then finds the
marker among what it receives for its own chunk and returns all NaN, and the module's residual
updates of that call are dropped on every rank (a residual never turns inf or NaN). The plain
reduce-scatter carries inf and NaN through as they are.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradzip.comm import compat, nonfinite, own_reducer
from gradzip.comm.queue import CollectiveQueue, completed
from gradzip.comm.routes import REGISTRY, choose_shard_route
from gradzip.compressors import Compressor, Payload
from gradzip.compressors.kernels import wire
from gradzip.compressors.lowrank import PowerSGD
from gradzip.feedback import ErrorFeedback, check_error_feedback, check_own_feedback
from gradzip.metrics import StepMetrics

try:  # the interface class is private; any object with allocate() and __call__() works
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as ReduceScatterBase
except ImportError:  # pragma: no cover - other torch versions
    ReduceScatterBase = object

try:  # a completed Work for callers that ask for async_op=True
    from torch._C._distributed_c10d import _create_work_from_future
except ImportError:  # pragma: no cover - other torch versions
    _create_work_from_future = None

ReduceOp = dist.ReduceOp


def op_kind(op: Any, world_size: int) -> tuple[str, float]:
    """``("avg", 1/world_size)``, ``("sum", 1.0)`` or ``("premul", factor)`` for an FSDP op.

    Raises:
        ValueError: for an op FSDP does not use for gradients (MIN, MAX, ...).
    """
    if op == ReduceOp.AVG:
        return "avg", 1.0 / world_size
    if op == ReduceOp.SUM:
        return "sum", 1.0
    if getattr(op, "op", None) == ReduceOp.PREMUL_SUM:
        return "premul", float(op.factor)
    raise ValueError(f"op must be AVG, SUM or PREMUL_SUM for a gradient reduce-scatter; got {op!r}")


def wire_op(input: Tensor, op: Any, kind: str, factor: float, world_size: int) -> tuple[Tensor, Any]:
    """What a reduce-scatter of ``input`` under ``op`` hands to the backend: gloo has no
    PREMUL_SUM (multiplied here, then summed) and fp16 sums overflow (AVG predivided, summed)."""
    if kind == "premul":
        return input * factor, ReduceOp.SUM
    if kind == "avg" and input.dtype == torch.float16:
        return input / world_size, ReduceOp.SUM
    return input, op


def encode_chunk(
    codec: Compressor, feedback: ErrorFeedback | None, name: str, chunk: Tensor, j: int, step: int, sendable: bool
) -> Payload:
    """Compress destination chunk ``j`` (codec key ``(name, j)``) with its residual (key ``j``)
    and stage the residual's update. A rank whose buffer is not finite (``sendable`` False)
    sends the NaN-marked payload of zeros and leaves the residual alone."""
    key = (name, j)
    if not sendable:
        return nonfinite.marked(codec.compress(torch.zeros_like(chunk), step=step, key=key))
    if feedback is None:
        return codec.compress(chunk, step=step, key=key)
    compensated = feedback.compensate(j, chunk, step=step)
    # A finite gradient plus its residual may overflow the wire dtype: saturate, never inf.
    wire_input = nonfinite.saturate(compensated, chunk.dtype).to(chunk.dtype)
    payload = codec.compress(wire_input, step=step, key=key)
    feedback.update(j, compensated, codec.decompress(payload, like=wire_input), step=step)
    return payload


def decode_sum(codec: Compressor, payloads: Sequence[Payload], like: Tensor) -> Tensor:
    """Sum of the decoded payloads, in rank order (the order every rank uses)."""
    total = codec.decompress(payloads[0], like=like).clone()
    for payload in payloads[1:]:
        total += codec.decompress(payload, like=like)
    return total


def _scaled(mean: Tensor, scale: float) -> Tensor:
    """``scale * mean`` (the sum an op asks for), computed in fp32 and saturated at ``mean``'s
    range: an fp16 mean of finite gradients must not become inf when multiplied out."""
    return nonfinite.saturate(mean.float() * scale, mean.dtype).to(mean.dtype)


class CompressedReduceScatter(ReduceScatterBase):
    """One FSDP module's reduce-scatter, compressed (FSDP's ``ReduceScatter`` interface).

    Args:
        compressor: a built codec (this module's own instance).
        name: the module's name; keys metrics and seeds (``(name, chunk)``).
        shard_shapes: the parameters' shapes within one chunk, in buffer order (PowerSGD and
            SEPARATE need them); None if unknown.
        error_feedback: keep a residual per destination chunk; None uses the codec's default.
            The codecs with a reducer of their own keep theirs.
        metrics: where bytes and times go (shared by the modules of a model).
        queue: the ordered launch queue of the group (the own reducers' rounds go through it).

    ``__call__(output_tensor, input_tensor, group, op)`` reduces ``input_tensor`` (1-D,
    ``world_size * c`` elements, fp32, bf16 or fp16) into ``output_tensor`` (``c`` elements,
    same dtype) synchronously. Payload handed to collectives per call: the route's ``nbytes``
    (``world_size * payload_nbytes(c, dtype)`` for the compressed single-round routes); for
    PowerSGD ``sum((n + m) * r) * itemsize`` for the matrices plus ``world_size * u * itemsize``
    for the ``u`` uncompressed elements per chunk; for the other codecs with a reducer of their
    own, what that reducer hands for the module's ``world_size * c`` elements (as under DDP).

    Raises:
        ValueError: for a codec with a reducer of its own whose payloads do not add up, or an
            ``error_feedback`` other than True, False or None, or one that codec cannot follow.
    """

    def __init__(
        self,
        compressor: Compressor,
        *,
        name: str,
        shard_shapes: Sequence[torch.Size] | None = None,
        error_feedback: bool | None = None,
        metrics: StepMetrics | None = None,
        queue: CollectiveQueue | None = None,
    ) -> None:
        check_error_feedback(error_feedback)
        check_own_feedback(compressor, error_feedback)
        self.compressor = compressor
        self.name = name
        self.shard_shapes = None if shard_shapes is None else [torch.Size(s) for s in shard_shapes]
        self.metrics = metrics or StepMetrics()
        self.step = 0
        self.calls = 0
        #: the exchange of the latest call: a shard route's label (``reduce_scatter``,
        #: ``all_to_all``, ``dense``), ``powersgd``, or ``allreduce`` (another codec's own reducer)
        self.last_exchange: str | None = None
        self._warned_layout = False
        self._floating: dict[tuple[int, torch.dtype], bool] = {}
        if not compressor.multi_round:
            # A slot for the NaN marker where the payload has no floating tensor (2 bytes, counted).
            compressor = self.compressor = nonfinite.with_marker_slot(compressor)
        if compressor.multi_round:
            if not compressor.aggregatable:
                raise ValueError(
                    f"fsdp: codec {compressor.name!r} brings its own rounds and its payloads do not add up; "
                    "no reduce-scatter exchange carries it"
                )
            #: the codec's own reducer (PowerSGD's two rounds, SEPARATE's, Radius's, the sketch's)
            self.own = own_reducer(compressor, queue=queue or CollectiveQueue(), metrics=self.metrics)
            self.feedback = None
        else:
            self.own = None
            use_feedback = compressor.error_feedback if error_feedback is None else error_feedback
            # fp32 residuals keep what a bf16 or fp16 wire drops from flushing to zero; updates are
            # staged until the exchange shows whether some rank sent the NaN marker.
            self.feedback = ErrorFeedback(dtype=torch.float32, deferred=True) if use_feedback else None

    @property
    def keeps_residuals(self) -> bool:
        """Whether this reduce-scatter keeps error-feedback state."""
        return self.own is not None or self.feedback is not None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A fresh buffer for FSDP to copy gradients into (or to receive into)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: Any, async_op: bool = False
    ) -> Any:
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` through the codec.

        Args:
            output_tensor: 1-D, ``input_tensor.numel() // world_size`` elements, written.
            input_tensor: 1-D flat padded gradients; ``view(world_size, -1)[r]`` goes to rank r.
                Not modified.
            group: the process group (its size is the world size).
            op: ``AVG``, ``SUM`` or ``PREMUL_SUM(f)``.
            async_op: the work runs synchronously either way; True returns a completed work.

        Returns:
            None, or a completed work when ``async_op`` is True.

        Raises:
            ValueError: for another op, or buffers whose sizes do not match.
        """
        world_size = group.size()
        kind, factor = op_kind(op, world_size)
        if input_tensor.numel() != world_size * output_tensor.numel():
            raise ValueError(
                f"input_tensor holds {input_tensor.numel()} elements, not world_size ({world_size}) "
                f"x output_tensor ({output_tensor.numel()})"
            )
        step = self.step
        if world_size == 1:
            output_tensor.copy_(input_tensor if kind != "premul" else input_tensor * factor)
        elif isinstance(self.compressor, PowerSGD):
            self._powersgd(output_tensor, input_tensor, group, op, kind, factor, step, world_size, group.rank())
        elif self.own is not None:
            self._summed(output_tensor, input_tensor, group, op, kind, factor, step, world_size, group.rank())
        else:
            route = self.route(output_tensor.numel(), input_tensor.dtype, group, step=step)
            route.launch(self, output_tensor, input_tensor, group, op, step=step)
        self.step += 1
        self.calls += 1
        if async_op:
            if _create_work_from_future is None:
                raise ValueError("async_op=True needs torch's _create_work_from_future; call with async_op=False")
            # Done already; on CUDA the future's event orders the waiter after this call's work.
            return _create_work_from_future(completed(output_tensor))
        return None

    def route(self, chunk_numel: int, dtype: torch.dtype, group: dist.ProcessGroup, *, step: int):
        """The shard route of a call with ``chunk_numel`` elements per chunk (single-round codecs)."""
        return choose_shard_route(
            self.compressor, group.size() * chunk_numel, dtype, group.size(), backend=dist.get_backend(group),
            step=step, floating_payload=lambda: self._floating_payload(chunk_numel, dtype),
        )

    def _floating_payload(self, chunk_numel: int, dtype: torch.dtype) -> bool:
        """Whether the codec's payload of a chunk is all floating point (found once per size by
        encoding zeros with a copy of the codec, so its state is untouched)."""
        if chunk_numel == 0:
            return False
        key = (chunk_numel, dtype)
        if key not in self._floating:
            probe = copy.deepcopy(self.compressor).compress(torch.zeros(chunk_numel, dtype=dtype), step=0, key="probe")
            self._floating[key] = all(t.is_floating_point() for t in probe.tensors)
        return self._floating[key]

    # -- what the routes use -----------------------------------------------------------------

    def timed_collective(self, issue) -> None:
        """Run a blocking collective, timed as in flight (in total and for this module)."""
        done: torch.futures.Future = torch.futures.Future()
        self.metrics.track(done, (self.name,))
        try:
            issue()
        finally:
            done.set_result(None)

    def reduce_scatter(self, output: Tensor, input: Tensor, group, op: Any) -> None:
        """One reduce-scatter applying ``op`` (see :func:`wire_op`)."""
        kind, factor = op_kind(op, group.size())
        input, op = wire_op(input, op, kind, factor, group.size())
        self.timed_collective(lambda: compat.reduce_scatter_single(output, input, op=op, group=group))

    def encode(self, chunk: Tensor, j: int, step: int, sendable: bool) -> Payload:
        """:func:`encode_chunk` with this module's codec, residuals and name."""
        return encode_chunk(self.compressor, self.feedback, self.name, chunk, j, step, sendable)

    def settle(self, marked: bool) -> None:
        """Keep the staged residual updates, or drop them where some rank sent the marker."""
        if self.feedback is None:
            return
        if marked:
            self.feedback.discard()
        else:
            self.feedback.commit()

    def check_bytes(self, handed: int, chunks: Tensor) -> None:
        expected = chunks.shape[0] * self.compressor.payload_nbytes(chunks.shape[1], chunks.dtype)
        assert handed == expected, f"{self.compressor.name}: handed {handed} bytes, formula says {expected}"

    # -- the codecs with a reducer of their own (PowerSGD, SEPARATE, Radius, the count sketch) --

    def _layout_known(self, chunk_numel: int) -> bool:
        """Whether the shard shapes are known and fill the chunk."""
        shapes = self.shard_shapes
        return shapes is not None and sum(s.numel() for s in shapes) == chunk_numel

    def _sent_dense(self, output, input, group, op, step: int, *, needs_layout: bool) -> bool:
        """Reduce-scatter uncompressed, and say so, before ``start_step`` or where a codec that
        needs the shard shapes lacks them (warned once per module)."""
        chunk_numel = output.numel()
        if needs_layout and not self._layout_known(chunk_numel):
            if not self._warned_layout:
                warnings.warn(
                    f"fsdp: module {self.name!r}: parameter layout of its reduce-scatter buffer unknown "
                    f"({chunk_numel} elements per chunk); {self.compressor.name} sends it uncompressed",
                    stacklevel=4,
                )
                self._warned_layout = True
        elif step >= self.compressor.start_step:
            return False
        REGISTRY["dense_reduce_scatter"].launch(self, output, input, group, op, step=step)
        return True

    def _powersgd(self, output, input, group, op, kind, factor, step, world_size, rank) -> None:
        if self._sent_dense(output, input, group, op, step, needs_layout=True):
            return
        dense = REGISTRY["dense_reduce_scatter"]
        self.last_exchange = "powersgd"
        grid = input.view(world_size, output.numel())
        spans, stacked_shapes = self._spans(), self._stacked_shapes(world_size)
        matrices = [i for i, s in enumerate(stacked_shapes) if self.compressor.compresses(s)]
        rest = [spans[i] for i in range(len(spans)) if i not in set(matrices)]

        if matrices:
            flat = self._stack(grid, [spans[i] for i in matrices])
            mean = self._own_reduce(flat, group, step, [stacked_shapes[i] for i in matrices])
            self._keep_rows(output, mean, [spans[i] for i in matrices], rank, world_size, kind, factor)
        if rest:
            plain = torch.cat([grid[:, a : a + n] for a, n in rest], dim=1)
            recv = plain.new_empty(plain.shape[1])
            nbytes = wire.nbytes([plain])
            self.reduce_scatter(recv, plain.reshape(-1), group, op)
            backend = dist.get_backend(group)
            sent = dense.sent_nbytes(self.compressor, plain.numel(), plain.dtype, world_size, backend=backend)
            self.metrics.add_bucket(
                self.name, payload_bytes=nbytes, dense_bytes=nbytes, collective="reduce_scatter",
                compressed=bool(matrices), sent_bytes=sent, received_bytes=sent,
            )
            offset = 0
            for a, n in rest:
                output[a : a + n] = recv[offset : offset + n]
                offset += n

    def _summed(self, output, input, group, op, kind, factor, step, world_size, rank) -> None:
        """The whole module through the codec's own reducer; this rank keeps its rows."""
        # The matrix codecs (SEPARATE) need the shard shapes; the flat ones take the buffer as is.
        if self._sent_dense(output, input, group, op, step, needs_layout=hasattr(self.compressor, "compresses")):
            return
        chunk_numel = output.numel()
        if chunk_numel == 0:
            self.last_exchange = "dense"
            return
        if self._layout_known(chunk_numel):
            spans = self._spans()
            flat = self._stack(input.view(world_size, chunk_numel), spans)
            stacked = self._stacked_shapes(world_size)
        else:
            spans, flat, stacked = [(0, chunk_numel)], input, None
        mean = self._own_reduce(flat, group, step, stacked)
        # The reducer's own record: "allreduce", or "dense" where the payload would not be smaller.
        self.last_exchange = self.metrics.buckets.get(self.name, {}).get("collective", "allreduce")
        self._keep_rows(output, mean, spans, rank, world_size, kind, factor)

    def _spans(self) -> list[tuple[int, int]]:
        """``(start, numel)`` of each parameter within a chunk (the shard shapes are known)."""
        spans, start = [], 0
        for s in self.shard_shapes:
            spans.append((start, s.numel()))
            start += s.numel()
        return spans

    def _stacked_shapes(self, world_size: int) -> list[torch.Size]:
        """The tensor each parameter's ``world_size`` chunks stack into: ``(world_size * rows,
        cols...)``, the padded unsharded gradient under FSDP's default ``Shard(0)``."""
        return [
            torch.Size((world_size * s[0], *s[1:])) if len(s) else torch.Size((world_size,)) for s in self.shard_shapes
        ]

    def _stack(self, grid: Tensor, spans: Sequence[tuple[int, int]]) -> Tensor:
        """The parameters at ``spans``, each stacked from its chunks (rows of ``grid``), end to end."""
        with self.metrics.timed("compress_s", self.name):
            return torch.cat([grid[:, a : a + n].reshape(-1) for a, n in spans])

    def _keep_rows(self, output, mean, spans, rank: int, world_size: int, kind: str, factor: float) -> None:
        """Write this rank's rows of each stacked parameter of ``mean`` (the reducer's mean, laid
        out as :meth:`_stack` lays it) into ``output`` at ``spans``, scaled to what the op asks."""
        scale = {"avg": 1.0, "sum": float(world_size), "premul": world_size * factor}[kind]
        with self.metrics.timed("decompress_s", self.name):
            offset = 0
            for a, n in spans:
                own = mean[offset : offset + world_size * n].view(world_size, n)[rank]
                output[a : a + n] = own if scale == 1.0 else _scaled(own, scale)
                offset += world_size * n

    def _own_reduce(self, flat: Tensor, group: dist.ProcessGroup, step: int, shapes) -> Tensor:
        """The mean of ``flat`` over ``group`` through the codec's own reducer. The reducer holds
        the group only for the call: a gloo callback can drop the last reference to the reducer
        after the call, and a group released there is destroyed on its own worker thread, which
        then joins itself and aborts the process."""
        self.own.group = group
        try:
            return self.own.reduce(self.name, flat, step=step, shapes=shapes).wait()
        finally:
            self.own.group = None

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step, codec state and residuals (they differ across ranks); tensors cloned."""
        return {
            "step": self.step,
            "compressor": self.compressor.state_dict(),
            "feedback": None if self.feedback is None else self.feedback.state_dict(),
            "own": None if self.own is None else self.own.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.step = state["step"]
        self.compressor.load_state_dict(state["compressor"])
        if self.feedback is not None and state["feedback"] is not None:
            self.feedback.load_state_dict(state["feedback"])
        own = state.get("own", state.get("powersgd"))  # "powersgd": the key before other codecs had one
        if self.own is not None and own is not None:
            self.own.load_state_dict(own)


__all__ = ["CompressedReduceScatter", "ReduceScatterBase", "decode_sum", "encode_chunk", "op_kind", "wire_op"]
