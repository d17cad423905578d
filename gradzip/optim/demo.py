"""DeMo: decoupled momentum, of which only the top DCT components per chunk are exchanged.

Source: Peng, Quesnelle, Kingma et al., "DeMo: Decoupled Momentum Optimization"
(arXiv 2411.19870); reference code bloc97/DeMo ``demo.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradzip.comm import nonfinite
from gradzip.comm.queue import CollectiveQueue
from gradzip.compressors import check_int
from gradzip.compressors.kernels import wire
from gradzip.compressors.values import check_flag
from gradzip.metrics import StepMetrics
from gradzip.optim import dct
from gradzip.optim.base import (
    added_checked,
    check_loadable,
    check_nonnegative,
    closure_loss,
    group_world_size,
    kept_settings,
    restore_missing,
)
from gradzip.optim.collectives import gather_payloads

#: the name its bucket carries in StepMetrics
CODEC = "demo"

#: the name :meth:`DeMo.state_dict` records
KIND = "demo"

#: compact values: bfloat16, or 8-bit floats (e4m3) scaled per chunk
VALUE_BITS = (8, 16)

#: the largest magnitude of the 8-bit floats (e4m3, no infinities): a chunk's largest value maps to it
FP8_MAX = 448.0

#: the widest chunk side: the DCT is a dense ``side x side`` matrix per side (64 MB in fp32 at
#: 4,096), and a wider one would only ask the memory for what a 1-D transform of that length needs
MAX_CHUNK = 4096


@functools.cache
def compact_limit(dtype: torch.dtype) -> float:
    """The largest bfloat16 value that ``dtype`` also holds: ``compact`` saturates the values it
    sends there (bfloat16's largest, 3.39e38, for fp32 and fp64; 65280 for fp16, whose 65504
    would round up to 65536 in bfloat16 and come back as inf)."""
    mantissa, exponent = math.frexp(torch.finfo(dtype).max)
    # bfloat16 keeps 8 significant bits: round the dtype's largest value down to them
    return min(torch.finfo(torch.bfloat16).max, math.ldexp(math.floor(mantissa * 256) / 256, exponent))


def _fp8_encode(values: Tensor) -> tuple[Tensor, Tensor]:
    """``(scales, codes)`` of ``values`` (chunks x k): per chunk ``scale = max|v| / FP8_MAX``
    (fp32, chunks x 1; 1 for a chunk of zeros) and ``codes = v / scale`` as e4m3 (rounded to
    nearest). A step whose momentum is not finite sends NaN scales instead (the marker)."""
    values = values.float()
    scales = values.abs().amax(-1, keepdim=True) / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (values / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return scales, codes


def _fp8_decode(scales: Tensor, codes: Tensor) -> Tensor:
    """``codes * scales`` in fp32 (chunks x k)."""
    return codes.float() * scales


def _check_group(group: dict[str, Any]) -> None:
    # >= 0: a learning-rate schedule may put it at 0 (the constructor's lr stays > 0)
    check_nonnegative(group["lr"], name="lr")
    check_nonnegative(group["weight_decay"], name="weight_decay")


class DeMo(torch.optim.Optimizer):
    """DeMo (Peng et al. 2024, arXiv 2411.19870) as a ``torch.optim.Optimizer`` that owns its
    communication (no DDP all_reduce underneath: run backward under ``no_sync``, e.g. inside
    :func:`~gradzip.optim.grad_sync`, which does so for every step of this optimizer).

    Each step, for every parameter ``p`` with gradient ``g`` (this rank's own):

    1. ``delta = compression_decay * delta + lr * g``: the local momentum, never averaged.
    2. ``delta`` is cut into chunks (1-D: ``compression_chunk`` consecutive elements; 2-D:
       ``compression_chunk x compression_chunk`` blocks; each side the largest divisor of the
       dimension up to ``compression_chunk``, see :mod:`gradzip.optim.dct`) and each chunk is
       DCT-II transformed (orthonormal).
    3. The ``k = min(compression_topk, chunk numel)`` coefficients of largest magnitude per chunk
       are kept, and their inverse transform is subtracted from ``delta`` (the momentum is its
       own error feedback).
    4. One ``all_gather`` per step carries every rank's kept values and their positions in the
       chunk (the narrowest index dtype: uint8 up to 256 elements per chunk, int16 up to 32768;
       with ``compact=True``, values in bfloat16 and positions packed, below).
    5. Every rank decodes the same gathered payloads: per chunk and position, the mean of the
       values the ranks sent there (0 where none did), inverse DCT (both in at least fp32), then
       ``p = p * (1 - lr * weight_decay) - lr * sign(update)``.

    Ranks hold bit-identical parameters after every step (they decode identical bytes in the
    same order); the momenta differ per rank, so save every rank's own :meth:`state_dict`.
    Biased (top-k and sign); not aggregatable (all_gather). Bytes each rank hands to the
    all_gather per step: ``sum_p chunks_p * k_p * (value_bytes + index_bytes_p)`` (the gradient
    dtype's bytes per value; :meth:`payload_nbytes`), sending ``(world_size - 1)`` times that.
    With ``compact=True``: ``sum_p chunks_p * k_p * 2 + ceil(chunks_p * k_p * b_p / 8)``, where
    ``b_p = ceil(log2(chunk numel))`` (12 bits for a 64 x 64 block): the values travel as
    bfloat16 (fp32's exponent range, which the momentum's ``lr``-scaled values need; what is
    subtracted from the momentum is the rounded value, so the rounding is fed back like the
    rest; saturated at :func:`compact_limit`, so a finite momentum never travels as inf) and the
    positions as a packed stream of ``b_p``-bit codes. With ``value_bits=8`` as well:
    ``sum_p chunks_p * (k_p + 4) + ceil(chunks_p * k_p * b_p / 8)``: each value an 8-bit float
    (e4m3, rounded to nearest) on a scale per chunk (fp32, the chunk's largest kept magnitude /
    448), the decoded value again what leaves the momentum. Not in the paper, whose code sends
    each value in the parameter's dtype and each position as int64.

    Args:
        params: parameters or parameter groups; a group may set its own ``lr`` and
            ``weight_decay``.
        lr: learning rate (> 0); the reference's OLMo configurations' 4e-4. It scales both the
            momentum's input and the sign step, as in the reference code.
        compression_decay: the momentum's decay, in [0, 1) (the paper's 0.999).
        compression_topk: coefficients kept per chunk (>= 1; the paper's 32).
        compression_chunk: chunk side (1 to :data:`MAX_CHUNK`, 4096; the paper's 64).
        compact: values in bfloat16 and positions in packed ``ceil(log2(chunk numel))``-bit codes
            (True or False; default False, the reference's encoding narrowed to uint8/int16
            positions).
        value_bits: with ``compact``, 16 (bfloat16 values) or 8 (e4m3 codes on a scale per
            chunk); 8 without ``compact`` is refused (the reference's encoding has no 8-bit
            values).
        weight_decay: decoupled weight decay per unit of learning rate (>= 0; the paper's 0).
        process_group: the data-parallel group; None for the default group.
        metrics: where the bytes and times of its all_gather go.

    Raises:
        ValueError: for a value out of its range, naming it.

    Differences from the reference code: indices travel in the narrowest dtype (the reference
    sends int64) and values and indices in one all_gather (the reference issues two per
    parameter); tensors of more than 2 dimensions are transformed as 2-D (first dimension x the
    rest; the reference handles 1-D and 2-D only). A step is skipped on every rank, leaving no
    trace (momenta, parameters, step counter), when any rank's momentum holds inf or NaN: that
    rank sends NaN values (:mod:`gradzip.comm.nonfinite`) and every rank sees them.
    At world size 1 nothing is sent and the rank decodes its own components.
    """

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float = 4e-4,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        weight_decay: float = 0.0,
        compact: bool = False,
        value_bits: int = 16,
        process_group: dist.ProcessGroup | None = None,
        metrics: StepMetrics | None = None,
    ) -> None:
        defaults = {"lr": check_nonnegative(lr, name="lr", strict=True),
                    "weight_decay": check_nonnegative(weight_decay, name="weight_decay")}
        super().__init__(params, defaults)
        decay = check_nonnegative(compression_decay, name="compression_decay")
        if decay >= 1:
            raise ValueError(f"compression_decay must be a number in [0, 1); got {compression_decay!r}")
        self.compression_decay = decay
        self.compression_topk = check_int(compression_topk, name="compression_topk", low=1)
        self.compression_chunk = check_int(compression_chunk, name="compression_chunk", low=1, high=MAX_CHUNK)
        self.compact = check_flag(compact, name="compact")
        self.value_bits = wire.check_bits(value_bits, allowed=VALUE_BITS, name="value_bits")
        if self.value_bits == 8 and not self.compact:
            raise ValueError("value_bits=8 needs compact=True (the values of the reference's encoding are the parameter's dtype)")
        self.process_group = process_group
        self.metrics = metrics if metrics is not None else StepMetrics()
        self.queue = CollectiveQueue()
        self.steps_taken = 0
        self.skipped_steps = 0
        self.last_step_skipped = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group`` with the ranges checked.

        Raises:
            ValueError: naming the setting out of range; the group is not added.
        """
        added_checked(self, param_group, _check_group)

    @property
    def needs_grad_sync(self) -> bool:
        """Always False: each rank's own gradient feeds its own momentum."""
        return False

    def synchronize(self) -> None:
        """A no-op: every step ends with the same parameters on every rank."""

    @property
    def world_size(self) -> int:
        return group_world_size(self.process_group)

    # ----- sizes ------------------------------------------------------------------------------

    def _kept(self, p: Tensor) -> tuple[int, int, int]:
        """``(chunks, kept per chunk, chunk numel)`` of ``p``."""
        chunks, chunk_numel = dct.chunk_layout(p.shape, self.compression_chunk)
        return chunks, min(self.compression_topk, chunk_numel), chunk_numel

    def param_payload_nbytes(self, p: Tensor) -> int:
        """Bytes of ``p``'s kept values and indices: ``chunks * k * (value + index bytes)``, or
        with ``compact``, ``chunks * k * 2 + ceil(chunks * k * index_bits / 8)``."""
        chunks, kept, chunk_numel = self._kept(p)
        if self.compact:
            positions = (chunks * kept * wire.index_bits(chunk_numel) + 7) // 8
            if self.value_bits == 8:  # a code per value and an fp32 scale per chunk
                return chunks * kept + chunks * 4 + positions
            return chunks * kept * 2 + positions
        return chunks * kept * (p.element_size() + wire.index_nbytes(chunk_numel))

    def payload_nbytes(self) -> int:
        """Bytes this rank hands to the all_gather for the parameters that have a gradient now."""
        return sum(self.param_payload_nbytes(p) for _, p, _ in self._params_with_grad())

    def _params_with_grad(self) -> list[tuple[int, Tensor, dict[str, Any]]]:
        out, index = [], 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError("DeMo does not support sparse gradients")
                    out.append((index, p, group))
                index += 1
        return out

    # ----- the step ---------------------------------------------------------------------------

    @property
    def _parts(self) -> int:
        """Tensors each parameter sends: values and positions, or scales, codes and positions."""
        return 3 if self.compact and self.value_bits == 8 else 2

    def _compress(self, p: Tensor, delta: Tensor) -> tuple[tuple[Tensor, ...], Tensor]:
        """Steps 2 and 3: ``(parts, transmitted)`` of the momentum ``delta``: ``parts`` what
        travels, its first a floating tensor (the non-finite marker goes there), and
        ``transmitted`` the inverse transform of the kept components as sent (``p``'s shape)."""
        chunks, kept, chunk_numel = self._kept(p)
        coeffs = dct.encode(delta, self.compression_chunk)
        indices = torch.topk(coeffs.abs(), kept, dim=-1, largest=True, sorted=False).indices
        values = torch.gather(coeffs, -1, indices)
        # What is sent is what is taken out of the momentum: the rounded values.
        if not self.compact:
            parts: tuple[Tensor, ...] = (values, indices.to(wire.index_dtype(chunk_numel)))
            sent = values
        elif self.value_bits == 16:
            # Saturated first: a finite coefficient past bfloat16's range would travel as inf and
            # make every rank skip every step; one that rounds past the parameter dtype's (fp16)
            # would turn the momentum inf. NaN stays NaN.
            limit = compact_limit(coeffs.dtype)
            sent = values.clamp(-limit, limit).to(torch.bfloat16)
            parts = (sent, wire.pack_uint(indices, wire.index_bits(chunk_numel)))
        else:
            scales, codes = _fp8_encode(values)
            sent = _fp8_decode(scales, codes)
            parts = (scales, codes.view(torch.uint8), wire.pack_uint(indices, wire.index_bits(chunk_numel)))
        sparse = torch.zeros_like(coeffs).scatter_(-1, indices, sent.to(coeffs.dtype))
        return parts, dct.decode(sparse, p.shape, self.compression_chunk)

    def _decode(self, p: Tensor, gathered: list[tuple[Tensor, ...]]) -> Tensor:
        """Step 5's update of ``p`` from every rank's parts: per chunk and position the mean of
        the values the ranks sent there (0 where none did), inverse-transformed. Identical on
        every rank."""
        chunks, kept, chunk_numel = self._kept(p)
        if self.compact:
            bits = wire.index_bits(chunk_numel)
            if self.value_bits == 8:
                gathered = [(_fp8_decode(s, c.view(torch.float8_e4m3fn)), i) for s, c, i in gathered]
            gathered = [(v, wire.unpack_uint(i, bits, chunks * kept).view(chunks, kept)) for v, i in gathered]
        # At least fp32: in fp16 the sum over ranks and the inverse transform overflow (to inf,
        # then NaN, whose sign is 0: the update silently lost) for values fp16 holds.
        dtype = torch.promote_types(p.dtype, torch.float32)
        values = torch.cat([v.to(dtype) for v, _ in gathered], dim=-1)
        indices = torch.cat([i.long() for _, i in gathered], dim=-1)
        sums = torch.zeros(chunks, chunk_numel, dtype=values.dtype, device=values.device).scatter_add_(-1, indices, values)
        counts = torch.zeros_like(sums).scatter_add_(-1, indices, torch.ones_like(values))
        return dct.decode(sums / counts.clamp(min=1), p.shape, self.compression_chunk)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step (collective: every rank of the group must call it, with a gradient
        for the same parameters). Sets :attr:`last_step_skipped` when a non-finite momentum on
        some rank made every rank skip it.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            the closure's loss, or None.
        """
        loss = closure_loss(closure)
        items = self._params_with_grad()
        deltas, payload = [], []
        for _key, p, group in items:
            delta = self._momentum(p).mul(self.compression_decay).add_(p.grad, alpha=group["lr"])
            parts, transmitted = self._compress(p, delta)
            if not nonfinite.is_finite(delta):
                parts = (torch.full_like(parts[0], float("nan")), *parts[1:])  # the marker every rank will see
            deltas.append(delta.sub_(transmitted))
            payload += parts
        gathered, finite = self._exchange(tuple(payload), items)
        self.last_step_skipped = not finite
        if not finite:
            self.skipped_steps += 1
            return loss
        for j, ((_key, p, group), delta) in enumerate(zip(items, deltas)):
            state = self.state[p]
            state["delta"] = delta
            state["step"] = state.get("step", 0) + 1
            m = self._parts
            update = self._decode(p, [tuple(ranks[m * j : m * (j + 1)]) for ranks in gathered])
            if group["weight_decay"] != 0:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update.sign_(), alpha=-group["lr"])
        self.steps_taken += 1
        return loss

    def _momentum(self, p: Tensor) -> Tensor:
        state = self.state[p]
        return state["delta"] if "delta" in state else torch.zeros_like(p, memory_format=torch.preserve_format)

    def _exchange(self, payload: tuple[Tensor, ...], items: list) -> tuple[list[tuple[Tensor, ...]], bool]:
        """Every rank's payload (step 4), and whether all were finite."""
        if self.world_size == 1:
            return [payload], all(nonfinite.is_finite(t) for t in payload)
        dense_bytes = sum(p.grad.numel() * p.grad.element_size() for _, p, _ in items)
        return gather_payloads(payload, key=("demo",), dense_bytes=dense_bytes, group=self.process_group,
                               queue=self.queue, metrics=self.metrics, codec=CODEC)

    # ----- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim`` state (each parameter's ``delta`` and ``step``; this rank's, they differ
        per rank) plus ``"gradzip"``: the step counters."""
        out = super().state_dict()
        out["gradzip"] = {"optimizer": KIND, "steps_taken": self.steps_taken, "skipped_steps": self.skipped_steps}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: for another optimizer's state_dict (checked before anything is loaded).
        """
        check_loadable(self, state_dict, kind=KIND, extra_keys=("steps_taken", "skipped_steps"), state_keys=("delta",),
                       plain_ok=False, check_group=_check_group, state_shapes=lambda p, _group: {"delta": tuple(p.shape)})
        state_dict = dict(state_dict)
        extra = state_dict.pop("gradzip")
        settings = kept_settings(self)
        super().load_state_dict(state_dict)
        restore_missing(self, settings)
        self.steps_taken = extra["steps_taken"]
        self.skipped_steps = extra["skipped_steps"]
