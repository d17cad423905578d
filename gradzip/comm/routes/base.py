"""What every collective route declares: its name, the codecs it takes, its byte formulas, its
launch, its single-process reference and its cost-model rounds (see :mod:`gradzip.comm.routes`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from gradzip.compressors import Compressor
from gradzip.compressors.kernels import wire
from gradzip.feedback import ErrorFeedback

#: every rank ends with the mean of the whole bucket (the DDP hook's reducers)
MEAN = "mean"
#: rank ``r`` ends with the reduced ``r``-th of ``world_size`` chunks (FSDP's reduce-scatter)
SHARD = "shard"

#: ``payload_nbytes(numel, dtype)``: a codec's payload formula
PayloadFormula = Callable[[int, torch.dtype], int]


@dataclass(frozen=True)
class Round:
    """One collective of a route, as the cost model (:mod:`gradzip.lab.simulate`) prices it.

    Attributes:
        collective: ``allreduce``, ``allgather``, ``reducescatter`` or ``alltoall``.
        nbytes: per worker for all_reduce; the gathered output for all_gather; each worker's
            input for reduce_scatter and all_to_all.
    """

    collective: str
    nbytes: int


@dataclass(frozen=True)
class Cost:
    """What one bucket costs through a route, for the cost model.

    Attributes:
        rounds: the collectives, in order.
        payload_bytes: bytes one worker hands to the collectives' inputs (the model's figure).
        encode_bytes: dense bytes through the encoder (0 for no codec).
        decode_bytes: dense bytes out of the decoder (0 for no codec).
    """

    rounds: tuple[Round, ...]
    payload_bytes: int
    encode_bytes: float = 0.0
    decode_bytes: float = 0.0


def raw_nbytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of ``numel`` uncompressed elements of ``dtype``."""
    return numel * wire.dtype_nbytes(dtype)


class Route:
    """One way a bucket travels. Subclasses set the class attributes and the methods.

    Attributes:
        name: the registry key; also what metrics record as the bucket's ``collective`` unless
            ``label`` says otherwise.
        label: the name metrics and ``CompressedReduceScatter.last_exchange`` record.
        family: :data:`MEAN` (``launch(reducer, key, grad, *, step) -> Future``; the reducer is
            a :class:`~gradzip.comm.reducer.CompressedReducer`) or :data:`SHARD`
            (``launch(comm, output, input, group, op, *, step) -> None``, synchronous; ``comm`` is
            a :class:`~gradzip.comm.reduce_scatter.CompressedReduceScatter`).
        compressed: whether the codec encodes the bucket (dense routes send it raw).
        requestable: a value users may pass as ``collective=`` (and ``--collective``).
        by_bytes: a candidate of ``collective="auto"``, chosen by bytes sent.
        needs_aggregatable: takes only codecs whose summed payloads decode to the sum.
        sums_on_wire: the collective adds payloads, so beyond two ranks the result equals the
            reference to rounding only (the summation order is the backend's).
        rounds_per_bucket: collectives one bucket takes (what controllers' probes report).
    """

    name: ClassVar[str]
    label: ClassVar[str | None] = None
    family: ClassVar[str] = MEAN
    compressed: ClassVar[bool] = True
    requestable: ClassVar[bool] = False
    by_bytes: ClassVar[bool] = False
    needs_aggregatable: ClassVar[bool] = False
    sums_on_wire: ClassVar[bool] = False
    rounds_per_bucket: ClassVar[int] = 1

    @property
    def metric_name(self) -> str:
        """What metrics record for a bucket of this route."""
        return self.label or self.name

    def accepts(self, codec: Compressor) -> bool:
        """Whether ``codec`` can travel this route (single-round codecs only; multi-round codecs
        bring their own reducer)."""
        if not self.compressed:
            return True
        return not codec.multi_round and (codec.aggregatable or not self.needs_aggregatable)

    def auto_takes(self, codec: Compressor) -> bool:
        """Whether ``collective="auto"`` weighs this route for ``codec``."""
        return self.by_bytes and self.accepts(codec)

    def payload_nbytes(self, codec: Compressor, numel: int, dtype: torch.dtype, world_size: int) -> int:
        """Bytes of one rank's bucket as this route encodes it (the raw bytes for dense routes);
        a forced route whose figure exceeds the raw bytes sends the bucket dense."""
        raise NotImplementedError

    def nbytes(self, codec: Compressor, numel: int, dtype: torch.dtype, world_size: int, rank: int = 0) -> int:
        """Bytes ``rank`` hands to the collectives for one bucket (the sum of their input tensors)."""
        raise NotImplementedError

    def sent_nbytes(
        self, codec: Compressor, numel: int, dtype: torch.dtype, world_size: int, rank: int = 0, *, backend: str = "gloo"
    ) -> int:
        """Bytes ``rank`` sends (and, by symmetry, receives) over the wire for one bucket, by the
        bandwidth-optimal algorithms (:mod:`gradzip.comm.traffic`); ``backend`` matters for
        reduce-scatter only."""
        raise NotImplementedError

    def total_sent_nbytes(
        self, codec: Compressor, numel: int, dtype: torch.dtype, world_size: int, *, backend: str = "gloo"
    ) -> int:
        """:meth:`sent_nbytes` summed over the ranks: the same on every rank, so choosing by it
        never splits the ranks."""
        return sum(self.sent_nbytes(codec, numel, dtype, world_size, r, backend=backend) for r in range(world_size))

    def cost(self, payload_nbytes: PayloadFormula, numel: int, dtype: torch.dtype, world_size: int) -> Cost:
        """The rounds and codec work of one bucket for the cost model, from the codec's formula."""
        raise NotImplementedError

    def reference(
        self,
        codec: Compressor,
        grads: Sequence[Tensor],
        *,
        step: int = 0,
        key: Hashable = 0,
        feedback: Sequence[ErrorFeedback] | None = None,
        server_feedback: Sequence[ErrorFeedback] | None = None,
    ) -> list[Tensor]:
        """What every rank ends with, computed in one process from every rank's input.

        Args:
            codec: the codec as the route sends it (marker slot included).
            grads: one tensor per rank, same shape and dtype, at least one element.
            step, key: as passed to the codec.
            feedback: one worker-side memory per rank, updated in place; None for none.
            server_feedback: one server-side memory per rank (routes that re-compress); None for none.

        Returns:
            one tensor per rank.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<route {self.name}>"
