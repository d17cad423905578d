"""Compressed gradient reduce-scatter for FSDP2 (``fully_shard``), with error feedback.

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    state = gradzip.fsdp.compress_reduce_scatter(model, "topk:ratio=0.01")
    ...  # train as usual; state.metrics.pop() after each step, state.state_dict() in checkpoints

In every backward pass FSDP copies each module's gradients into one flat padded buffer and
reduce-scatters it: ``input.view(world_size, -1)[r]`` is the chunk rank ``r`` keeps (zeros pad
every parameter's first dimension to a multiple of ``world_size``). gradzip replaces that one
collective per module (``FSDPModule.set_custom_reduce_scatter``) by an exchange chosen from the
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
3. PowerSGD (Vogels et al. 2019, arXiv 1905.13727): each parameter of 2 or more dims is taken
   as the matrix its ``world_size`` chunks stack into (``(world_size * rows, cols)``, the padded
   unsharded gradient for FSDP's default ``Shard(0)``) and reduced by
   :class:`~gradzip.comm.powersgd.PowerSGDReducer`, exactly as the DDP hook reduces it
   (``P`` and ``Q`` all_reduced, shared warm start); each rank keeps its own rows. The other
   parameters (1-D, or too small to gain) are reduce-scattered uncompressed. PowerSGD needs the
   parameters' shard shapes, read from FSDP's private state; where that is missing the whole
   buffer travels uncompressed, with a warning.

A compressed exchange that would hand more bytes to its collective than the raw buffer falls
back to FSDP's plain reduce-scatter and says so in the metrics (``uncompressed_buckets``).

Reduce ops: FSDP passes ``AVG`` (fp32 and bf16 reduce dtypes), ``SUM`` (fp16 reduce dtype, or
``set_force_sum_reduction_for_comms(True)``; FSDP divides before and after) or
``PREMUL_SUM(f)`` (a gradient divide factor other than the world size). All three are handled:
the mean, the sum, or ``f`` times the sum of the ranks' decoded chunks. gloo has no
``PREMUL_SUM``, so gradzip multiplies by ``f`` itself; an fp16 wire predivides ``AVG`` by the
world size (fp16 sums overflow). Other ops raise ``ValueError``.

When error feedback is on, every module's parameters without a gradient this step are
reduce-scattered as zeros (``set_reduce_scatter_unused_params``): the buffer layout stays the
same every step, so each residual stays aligned with its parameters and is still sent out
when a parameter gets no gradient. Such parameters then get a gradient (zeros plus what
error feedback releases) instead of ``None``.

Non-finite gradients follow :mod:`gradzip.comm.nonfinite` on the compressed single-round exchanges:
a rank whose buffer holds inf or NaN sends NaN-marked payloads of zeros for every chunk (codecs
with no floating tensor in their payload get the 2-byte marker slot), every rank then finds the
marker among what it receives for its own chunk and returns all NaN, and the module's residual
updates of that call are dropped on every rank (a residual never turns inf or NaN). The plain
reduce-scatter carries inf and NaN through as they are.

FSDP never calls the reduce-scatter at world size 1 or on micro-steps without gradient sync
(``set_requires_gradient_sync(False)``); the accumulated gradient is compressed once, on the
step that syncs.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradzip.comm import nonfinite
from gradzip.comm.powersgd import PowerSGDReducer
from gradzip.comm.queue import CollectiveQueue
from gradzip.comm.traffic import all_to_all_bytes, reduce_scatter_bytes
from gradzip.compressors import Compressor, Payload, build
from gradzip.compressors.cast import Identity
from gradzip.compressors.kernels import wire
from gradzip.compressors.lowrank import PowerSGD
from gradzip.feedback import ErrorFeedback
from gradzip.metrics import StepMetrics

try:  # public since torch 2.6; under torch.distributed._composable.fsdp before
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._composable.fsdp import FSDPModule

try:  # the interface class is private; any object with allocate() and __call__() works
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - other torch versions
    _ReduceScatterBase = object

try:  # a completed Work for callers that ask for async_op=True
    from torch._C._distributed_c10d import _create_work_from_future
except ImportError:  # pragma: no cover - other torch versions
    _create_work_from_future = None

EXCHANGES = ("reduce_scatter", "all_to_all", "powersgd", "dense")
ReduceOp = dist.ReduceOp


def _op_kind(op: Any, world_size: int) -> tuple[str, float]:
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


def _shard_shapes(module: nn.Module) -> list[torch.Size] | None:
    """Shapes of the module's parameters within one chunk of its reduce-scatter buffer, in
    buffer order; ``[]`` for a module with no parameters; None where FSDP's private state
    cannot be read.

    Raises:
        ValueError: for a module with several parameter groups (FSDP refuses a custom
            reduce-scatter there).
    """
    try:
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = state._fsdp_param_group
            groups = [] if group is None else [group]
        if len(groups) > 1:
            raise ValueError("a module with several FSDP parameter groups cannot take a custom reduce-scatter")
        if not groups:
            return []
        return [torch.Size(p.padded_sharded_param_size) for p in groups[0].fsdp_params]
    except AttributeError:
        return None


def _decode_sum(codec: Compressor, payloads: Sequence[Payload], like: Tensor) -> Tensor:
    """Sum of the decoded payloads, in rank order (the order every rank uses)."""
    total = codec.decompress(payloads[0], like=like).clone()
    for payload in payloads[1:]:
        total += codec.decompress(payload, like=like)
    return total


class CompressedReduceScatter(_ReduceScatterBase):
    """One FSDP module's reduce-scatter, compressed (FSDP's ``ReduceScatter`` interface).

    Args:
        compressor: a built codec (this module's own instance).
        name: the module's name; keys metrics and seeds (``(name, chunk)``).
        shard_shapes: the parameters' shapes within one chunk, in buffer order (PowerSGD needs
            them); None if unknown.
        error_feedback: keep a residual per destination chunk; None uses the codec's default.
            PowerSGD always keeps one.
        metrics: where bytes and times go (shared by the modules of a model).
        queue: the ordered launch queue of the group (PowerSGD's two rounds go through it).

    ``__call__(output_tensor, input_tensor, group, op)`` reduces ``input_tensor`` (1-D,
    ``world_size * c`` elements, fp32, bf16 or fp16) into ``output_tensor`` (``c`` elements,
    same dtype) synchronously. Payload handed to collectives per call: ``world_size *
    payload_nbytes(c, dtype)`` for single-round codecs; for PowerSGD ``sum((n + m) * r) *
    itemsize`` for the matrices plus ``world_size * u * itemsize`` for the ``u`` uncompressed
    elements per chunk.
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
        self.compressor = compressor
        self.name = name
        self.shard_shapes = None if shard_shapes is None else [torch.Size(s) for s in shard_shapes]
        self.metrics = metrics or StepMetrics()
        self.step = 0
        self.calls = 0
        #: the exchange of the latest call: ``reduce_scatter``, ``all_to_all``, ``powersgd``
        #: or ``dense`` (FSDP's plain reduce-scatter)
        self.last_exchange: str | None = None
        self._warned_layout = False
        if not compressor.multi_round:
            # A slot for the NaN marker where the payload has no floating tensor (2 bytes, counted).
            compressor = self.compressor = nonfinite.with_marker_slot(compressor)
        if compressor.multi_round:
            if not isinstance(compressor, PowerSGD):
                raise ValueError(f"fsdp: multi-round codec {compressor.name!r} has no reduce-scatter exchange; use powersgd or a single-round codec")
            self.powersgd = PowerSGDReducer(compressor, queue=queue or CollectiveQueue(), metrics=self.metrics)
            self.feedback = None
        else:
            self.powersgd = None
            use_feedback = compressor.error_feedback if error_feedback is None else error_feedback
            # fp32 residuals keep what a bf16 or fp16 wire drops from flushing to zero; updates are
            # staged until the exchange shows whether some rank sent the NaN marker.
            self.feedback = ErrorFeedback(dtype=torch.float32, deferred=True) if use_feedback else None

    @property
    def keeps_residuals(self) -> bool:
        """Whether this reduce-scatter keeps error-feedback state."""
        return self.powersgd is not None or self.feedback is not None

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
        world_size, rank = group.size(), group.rank()
        kind, factor = _op_kind(op, world_size)
        if input_tensor.numel() != world_size * output_tensor.numel():
            raise ValueError(
                f"input_tensor holds {input_tensor.numel()} elements, not world_size ({world_size}) "
                f"x output_tensor ({output_tensor.numel()})"
            )
        step = self.step
        if world_size == 1:
            output_tensor.copy_(input_tensor if kind != "premul" else input_tensor * factor)
        elif self.powersgd is not None:
            self._powersgd(output_tensor, input_tensor, group, op, kind, factor, step, world_size, rank)
        else:
            self._single_round(output_tensor, input_tensor, group, op, kind, factor, step, world_size, rank)
        self.step += 1
        self.calls += 1
        if async_op:
            if _create_work_from_future is None:
                raise ValueError("async_op=True needs torch's _create_work_from_future; call with async_op=False")
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(output_tensor)
            return _create_work_from_future(fut)
        return None

    # -- collectives ----------------------------------------------------------------------

    def _timed_collective(self, issue) -> None:
        """Run a blocking collective, timed as in flight (in total and for this module)."""
        done: torch.futures.Future = torch.futures.Future()
        self.metrics.track(done, (self.name,))
        try:
            issue()
        finally:
            done.set_result(None)

    def _reduce_scatter(self, output: Tensor, input: Tensor, group, op: Any, kind: str, factor: float) -> int:
        """One reduce-scatter applying ``op`` (gloo cannot PREMUL_SUM and fp16 sums overflow);
        returns the bytes this rank sends."""
        world_size = group.size()
        if kind == "premul":
            input, op = input * factor, ReduceOp.SUM
        elif kind == "avg" and input.dtype == torch.float16:
            input, op = input / world_size, ReduceOp.SUM
        self._timed_collective(lambda: dist.reduce_scatter_single(output, input, op=op, group=group))
        return reduce_scatter_bytes(wire.nbytes([input]), world_size, dist.get_backend(group))

    def _dense(self, output: Tensor, input: Tensor, group, op: Any, kind: str, factor: float) -> None:
        """FSDP's own reduce-scatter of the raw buffer."""
        nbytes = wire.nbytes([input])
        self.last_exchange = "dense"
        sent = self._reduce_scatter(output, input, group, op, kind, factor)
        self.metrics.add_bucket(
            self.name, payload_bytes=nbytes, dense_bytes=nbytes, collective="dense", compressed=False,
            sent_bytes=sent, received_bytes=sent,
        )

    # -- single-round codecs --------------------------------------------------------------

    def _encode(self, chunk: Tensor, j: int, step: int, sendable: bool) -> Payload:
        """Compress destination chunk ``j`` with its residual; stage the residual's update. A
        rank whose buffer is not finite (``sendable`` False) sends the NaN-marked payload of
        zeros and leaves the residual alone (:mod:`gradzip.comm.nonfinite`)."""
        key = (self.name, j)
        if not sendable:
            return nonfinite.marked(self.compressor.compress(torch.zeros_like(chunk), step=step, key=key))
        if self.feedback is None:
            return self.compressor.compress(chunk, step=step, key=key)
        compensated = self.feedback.compensate(j, chunk, step=step)
        # A finite gradient plus its residual may overflow the wire dtype: saturate, never inf.
        wire_input = nonfinite.saturate(compensated, chunk.dtype).to(chunk.dtype)
        payload = self.compressor.compress(wire_input, step=step, key=key)
        self.feedback.update(j, compensated, self.compressor.decompress(payload, like=wire_input), step=step)
        return payload

    def _single_round(self, output, input, group, op, kind, factor, step, world_size, rank) -> None:
        chunk_numel = output.numel()
        dense_bytes = wire.nbytes([input])
        payload_bytes = world_size * self.compressor.payload_nbytes(chunk_numel, input.dtype)
        if chunk_numel == 0 or payload_bytes > dense_bytes or step < self.compressor.start_step:
            self._dense(output, input, group, op, kind, factor)
            return
        chunks = input.view(world_size, chunk_numel)
        sendable = nonfinite.is_finite(input)
        with self.metrics.timed("compress_s", self.name):
            payloads = [self._encode(chunks[j], j, step, sendable) for j in range(world_size)]
        if self._sums_on_the_wire(payloads[0], payload_bytes, group):
            marked = self._exchange_reduce_scatter(output, chunks, payloads, group, op, kind, factor, rank, dense_bytes)
        else:
            marked = self._exchange_all_to_all(output, chunks, payloads, group, kind, factor, rank, dense_bytes)
        # A non-finite rank marks its payload for every chunk, so every rank sees the marker.
        if self.feedback is not None:
            if marked:
                self.feedback.discard()
            else:
                self.feedback.commit()

    def _sums_on_the_wire(self, payload: Payload, payload_bytes: int, group) -> bool:
        """Whether to reduce-scatter the payloads rather than all_to_all them.

        The identity codec always does: it is FSDP's own collective, bit for bit. Other codecs
        need to be aggregatable with an all floating-point payload (integer parts, indices or
        codes, would be summed too), and the reduce-scatter must send no more bytes than the
        all_to_all: true of NCCL's ring (one decode then replaces ``world_size``), not of gloo,
        whose reduce-scatter moves as much as an all_reduce.
        """
        if isinstance(self.compressor, Identity):
            return True
        if not (self.compressor.aggregatable and all(t.is_floating_point() for t in payload.tensors)):
            return False
        world_size = group.size()
        backend = dist.get_backend(group)
        return reduce_scatter_bytes(payload_bytes, world_size, backend) <= all_to_all_bytes(
            payload_bytes // world_size, world_size
        )

    def _exchange_reduce_scatter(self, output, chunks, payloads, group, op, kind, factor, rank, dense_bytes) -> bool:
        self.last_exchange = "reduce_scatter"
        own = payloads[rank]
        summed = []
        handed = 0
        sent = 0
        for t in range(len(own.tensors)):
            stacked = torch.stack([p.tensors[t].reshape(-1) for p in payloads])
            recv = stacked.new_empty(stacked.shape[1])
            sent += self._reduce_scatter(recv, stacked.view(-1), group, op, kind, factor)
            summed.append(recv.view(own.tensors[t].shape))
            handed += wire.nbytes([stacked])
        self._check_bytes(handed, chunks)
        self.metrics.add_bucket(
            self.name, payload_bytes=handed, dense_bytes=dense_bytes, collective="reduce_scatter",
            sent_bytes=sent, received_bytes=sent,
        )
        with self.metrics.timed("decompress_s", self.name):
            if nonfinite.received_marker(summed):
                output.fill_(float("nan"))
                return True
            # The op was applied to the payload on the wire; the decoder is linear.
            output.copy_(self.compressor.decompress(Payload(tuple(summed), own.ctx), like=chunks[rank]))
        return False

    def _exchange_all_to_all(self, output, chunks, payloads, group, kind, factor, rank, dense_bytes) -> bool:
        self.last_exchange = "all_to_all"
        world_size = len(payloads)
        send = torch.stack([wire.to_bytes(p.tensors) for p in payloads])
        self._check_bytes(send.numel(), chunks)
        recv = torch.empty_like(send)
        sent = all_to_all_bytes(send.shape[1], world_size)
        self.metrics.add_bucket(
            self.name, payload_bytes=send.numel(), dense_bytes=dense_bytes, collective="all_to_all",
            sent_bytes=sent, received_bytes=sent,
        )
        self._timed_collective(lambda: dist.all_to_all_single(recv, send, group=group))
        with self.metrics.timed("decompress_s", self.name):
            own = payloads[rank]
            received = [Payload(wire.from_bytes(recv[r], own.tensors), own.ctx) for r in range(world_size)]
            if any(nonfinite.received_marker(p.tensors) for p in received):
                output.fill_(float("nan"))
                return True
            # Half-precision chunks are summed in fp32 and rounded once.
            like = chunks[rank] if chunks.dtype == torch.float32 else chunks[rank].float()
            total = _decode_sum(self.compressor, received, like)
            if kind == "avg":
                total.div_(world_size)
            elif kind == "premul":
                total.mul_(factor)
            output.copy_(total)
        return False

    def _check_bytes(self, handed: int, chunks: Tensor) -> None:
        expected = chunks.shape[0] * self.compressor.payload_nbytes(chunks.shape[1], chunks.dtype)
        assert handed == expected, f"{self.compressor.name}: handed {handed} bytes, formula says {expected}"

    # -- PowerSGD -------------------------------------------------------------------------

    def _powersgd(self, output, input, group, op, kind, factor, step, world_size, rank) -> None:
        chunk_numel = output.numel()
        shapes = self.shard_shapes
        if shapes is None or sum(s.numel() for s in shapes) != chunk_numel:
            if not self._warned_layout:
                warnings.warn(
                    f"fsdp: module {self.name!r}: parameter layout of its reduce-scatter buffer unknown "
                    f"({chunk_numel} elements per chunk); powersgd sends it uncompressed",
                    stacklevel=3,
                )
                self._warned_layout = True
            self._dense(output, input, group, op, kind, factor)
            return
        if step < self.compressor.start_step:
            self._dense(output, input, group, op, kind, factor)
            return
        self.last_exchange = "powersgd"
        grid = input.view(world_size, chunk_numel)
        offsets = [0]
        for s in shapes[:-1]:
            offsets.append(offsets[-1] + s.numel())
        # The matrix a parameter's chunks stack into: (world_size * rows, cols...).
        stacked_shapes = [torch.Size((world_size * s[0], *s[1:])) if len(s) else s for s in shapes]
        matrices = [i for i, s in enumerate(stacked_shapes) if self.compressor.compresses(s)]
        dense = [i for i in range(len(shapes)) if i not in set(matrices)]

        if matrices:
            self.powersgd.group = group
            with self.metrics.timed("compress_s", self.name):
                flat = torch.cat([grid[:, offsets[i] : offsets[i] + shapes[i].numel()].reshape(-1) for i in matrices])
            mean = self.powersgd.reduce(
                self.name, flat, step=step, shapes=[stacked_shapes[i] for i in matrices]
            ).wait()
            # PowerSGDReducer returns the mean; scale it to what the op asks for.
            scale = {"avg": 1.0, "sum": float(world_size), "premul": world_size * factor}[kind]
            with self.metrics.timed("decompress_s", self.name):
                offset = 0
                for i in matrices:
                    numel = shapes[i].numel()
                    own = mean[offset : offset + world_size * numel].view(world_size, numel)[rank]
                    output[offsets[i] : offsets[i] + numel] = own if scale == 1.0 else own * scale
                    offset += world_size * numel
        if dense:
            rest = torch.cat([grid[:, offsets[i] : offsets[i] + shapes[i].numel()] for i in dense], dim=1)
            recv = rest.new_empty(rest.shape[1])
            nbytes = wire.nbytes([rest])
            sent = self._reduce_scatter(recv, rest.reshape(-1), group, op, kind, factor)
            self.metrics.add_bucket(
                self.name, payload_bytes=nbytes, dense_bytes=nbytes, collective="reduce_scatter",
                compressed=bool(matrices), sent_bytes=sent, received_bytes=sent,
            )
            offset = 0
            for i in dense:
                numel = shapes[i].numel()
                output[offsets[i] : offsets[i] + numel] = recv[offset : offset + numel]
                offset += numel

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step, codec state and residuals (they differ across ranks); tensors cloned."""
        return {
            "step": self.step,
            "compressor": self.compressor.state_dict(),
            "feedback": None if self.feedback is None else self.feedback.state_dict(),
            "powersgd": None if self.powersgd is None else self.powersgd.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.step = state["step"]
        self.compressor.load_state_dict(state["compressor"])
        if self.feedback is not None and state["feedback"] is not None:
            self.feedback.load_state_dict(state["feedback"])
        if self.powersgd is not None and state["powersgd"] is not None:
            self.powersgd.load_state_dict(state["powersgd"])


class _Discard(_ReduceScatterBase):
    """A reduce-scatter that sends nothing and returns zeros (see :meth:`FSDPCompression.paused`)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group, op: Any, async_op: bool = False) -> Any:
        output_tensor.zero_()
        return None


class FSDPCompression:
    """What :func:`compress_reduce_scatter` installed: one :class:`CompressedReduceScatter` per
    FSDP module with parameters, the shared metrics, and their state for checkpoints.

    Attributes:
        compressor: the codec spec.
        comms: module name (``""`` for the root) -> its reduce-scatter.
        metrics: per-step bytes (keyed by module name) and compress / communicate /
            decompress seconds; :meth:`StepMetrics.pop` after each optimizer step.
    """

    def __init__(self, spec: str, comms: dict[str, CompressedReduceScatter], modules: dict[str, nn.Module],
                 metrics: StepMetrics) -> None:
        self.compressor = spec
        self.comms = comms
        self.modules = modules
        self.metrics = metrics

    def install(self) -> None:
        """(Re)install every module's compressed reduce-scatter."""
        for name, module in self.modules.items():
            module.set_custom_reduce_scatter(self.comms[name])

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Inside, reduce-scatters send nothing and leave zero gradients: for measuring
        forward + backward alone. Compressor state and step counters are untouched."""
        discard = _Discard()
        for module in self.modules.values():
            module.set_custom_reduce_scatter(discard)
        try:
            yield
        finally:
            self.install()

    def state_dict(self) -> dict[str, Any]:
        """Spec and every module's step, codec state and residuals."""
        return {"compressor": self.compressor, "modules": {n: c.state_dict() for n, c in self.comms.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: if the checkpoint was made with another codec spec or other modules.
        """
        if state["compressor"] != self.compressor:
            raise ValueError(f"checkpoint holds compressor state for {state['compressor']!r}, not {self.compressor!r}")
        if set(state["modules"]) != set(self.comms):
            raise ValueError(
                f"checkpoint holds compressor state for modules {sorted(state['modules'])}, "
                f"this model shards {sorted(self.comms)}"
            )
        for name, comm in self.comms.items():
            comm.load_state_dict(state["modules"][name])


def compress_reduce_scatter(
    model: nn.Module,
    compressor: str | Compressor = "powersgd:approx_rank=4",
    *,
    error_feedback: bool | None = None,
    reduce_scatter_unused_params: bool | None = None,
    metrics: StepMetrics | None = None,
) -> FSDPCompression:
    """Compress the gradient reduce-scatter of every ``fully_shard`` module of ``model``.

    Args:
        model: a module on which ``fully_shard`` was applied (to it and/or its submodules).
        compressor: a codec spec such as ``"topk:ratio=0.01"`` (see ``gradzip list``) or a built
            codec; every module gets its own instance, built from the (canonical) spec.
        error_feedback: override the codec's default (single-round codecs; PowerSGD always
            keeps residuals).
        reduce_scatter_unused_params: reduce-scatter zeros for parameters without a gradient
            so the buffer layout never changes; None turns it on exactly when residuals are kept.
        metrics: where bytes and times go; a new :class:`~gradzip.metrics.StepMetrics` if None.

    Returns:
        the installed state; keep it for metrics and checkpoints.

    Raises:
        ValueError: for a bad spec, a model without ``fully_shard`` modules, or a module with
            several parameter groups.
    """
    codec = build(compressor)
    spec = codec.spec
    metrics = metrics or StepMetrics()
    queue = CollectiveQueue()
    fsdp_modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise ValueError("model has no fully_shard modules; apply torch.distributed.fsdp.fully_shard first")
    comms: dict[str, CompressedReduceScatter] = {}
    modules: dict[str, nn.Module] = {}
    for name, module in fsdp_modules:
        shapes = _shard_shapes(module)
        if shapes == []:
            continue  # no parameters of its own, so FSDP never reduce-scatters for it
        comm = CompressedReduceScatter(
            build(spec), name=name, shard_shapes=shapes,
            error_feedback=error_feedback, metrics=metrics, queue=queue,
        )
        unused = comm.keeps_residuals if reduce_scatter_unused_params is None else reduce_scatter_unused_params
        if unused and hasattr(module, "set_reduce_scatter_unused_params"):
            module.set_reduce_scatter_unused_params(True, recurse=False)
        module.set_custom_reduce_scatter(comm)
        comms[name] = comm
        modules[name] = module
    return FSDPCompression(spec, comms, modules, metrics)


__all__ = ["CompressedReduceScatter", "EXCHANGES", "FSDPCompression", "compress_reduce_scatter"]
