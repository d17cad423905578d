"""Bytes each collective moves per worker, and the choice of collective by those bytes.

The figures are the bandwidth-optimal ones, which are also what gloo sends on loopback (checked
by ``benchmarks/collectives.py`` against the bytes each process writes to its sockets):

- ring ``all_reduce`` of ``B`` bytes: each rank sends and receives ``2 (W - 1) B / W`` bytes
  (reduce-scatter, then all-gather, each moving ``W - 1`` of ``W`` parts);
- ``all_gather`` of ``P`` bytes per rank: each rank sends and receives ``(W - 1) P``;
- two-phase compressed all_reduce (:mod:`gradzip.comm.twophase`) of a bucket cut into ``W``
  chunks with payloads ``p_0 .. p_{W-1}``: rank ``r`` sends ``sum_{j != r} p_j`` in the
  all_to_all and ``(W - 1) p_r`` in the all_gather, and receives the mirror image, so
  ``sum_{j != r} p_j + (W - 1) p_r`` each way: about ``2 (W - 1) P / W``, flat in ``W``.

``W`` is the world size. The bytes a rank keeps for itself never touch the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradzip.compressors import Compressor
from gradzip.compressors.kernels import wire

#: what callers may ask for; ``auto`` picks by bytes
COLLECTIVES = ("auto", "allreduce", "allgather", "twophase")
#: what :func:`choose_collective` may answer; ``dense`` is the uncompressed all_reduce
ROUTES = ("allreduce", "allgather", "twophase", "dense")


def check_collective(collective: str, compressor: Compressor) -> str:
    """Validate a requested collective for ``compressor``.

    Raises:
        ValueError: for a name outside :data:`COLLECTIVES`, or ``allreduce`` with a codec that
            is not aggregatable (the sum of its payloads does not decode to the sum of inputs).
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}; got {collective!r}")
    if collective == "allreduce" and not compressor.aggregatable:
        raise ValueError(
            f"collective='allreduce' needs an aggregatable codec; {compressor.name} is not "
            "(use allgather, twophase or auto)"
        )
    return collective


def chunk_sizes(numel: int, world_size: int) -> tuple[int, ...]:
    """Elements in each of the ``world_size`` chunks of a bucket, as ``torch.tensor_split`` cuts
    it: the first ``numel % world_size`` chunks hold one element more; chunks may be empty."""
    base, extra = divmod(numel, world_size)
    return tuple(base + (1 if j < extra else 0) for j in range(world_size))


@dataclass(frozen=True)
class ChunkPlan:
    """How the two-phase exchange cuts one bucket.

    Attributes:
        sizes: elements per chunk; chunk ``j`` is reduced by rank ``j``.
        offsets: where each chunk starts in the flat bucket.
        payload_nbytes: the codec's payload of each chunk (0 for an empty chunk, which is not
            compressed at all).
    """

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    payload_nbytes: tuple[int, ...]

    @property
    def total_payload_nbytes(self) -> int:
        """Bytes of one rank's compressed bucket: the sum of the chunk payloads."""
        return sum(self.payload_nbytes)

    def sent_bytes(self, rank: int) -> int:
        """Bytes ``rank`` sends (and, by symmetry, receives) over both rounds."""
        world_size = len(self.sizes)
        others = self.total_payload_nbytes - self.payload_nbytes[rank]
        return others + (world_size - 1) * self.payload_nbytes[rank]


def plan_chunks(compressor: Compressor, numel: int, dtype: torch.dtype, world_size: int) -> ChunkPlan:
    """Cut a bucket of ``numel`` elements of ``dtype`` into ``world_size`` chunks (see :class:`ChunkPlan`)."""
    sizes = chunk_sizes(numel, world_size)
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    payloads = tuple(compressor.payload_nbytes(size, dtype) if size else 0 for size in sizes)
    return ChunkPlan(sizes, tuple(offsets), payloads)


def allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all_reduce of ``nbytes``: ``2 (W-1) B // W``."""
    return 2 * (world_size - 1) * nbytes // world_size


def dense_probe(grad, world_size: int) -> dict:
    """A controller's probe figures for a bucket that travels dense (one uncompressed all_reduce):
    no encoding, ``grad`` decoded exactly, ``allreduce_bytes`` of its raw bytes sent."""
    raw = grad.numel() * grad.element_size()
    return {"compress_s": 0.0, "decompress_s": 0.0, "payload_bytes": raw, "collectives": 1,
            "sent_bytes": allreduce_bytes(raw, world_size), "decoded": grad}


def allgather_bytes(payload_nbytes: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) when all_gather-ing ``payload_nbytes`` each: ``(W-1) P``."""
    return (world_size - 1) * payload_nbytes


def reduce_scatter_bytes(nbytes: int, world_size: int, backend: str) -> int:
    """Bytes one rank sends (and receives) in a reduce_scatter of ``nbytes`` (the whole input).

    A ring reduce-scatter (NCCL) moves ``(W-1) B // W``. gloo runs it as an all_reduce and keeps
    one part: ``2 (W-1) B // W``, as :func:`allreduce_bytes` (measured on loopback with the
    ``wchar`` count of ``benchmarks/collectives.py`` at W = 2 and 3).
    """
    if backend == "gloo":
        return allreduce_bytes(nbytes, world_size)
    return (world_size - 1) * nbytes // world_size


def all_to_all_bytes(chunk_nbytes: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in an all_to_all of ``world_size`` chunks of
    ``chunk_nbytes`` each: ``(W-1) c`` (the own chunk stays)."""
    return (world_size - 1) * chunk_nbytes


def route_bytes(route: str, compressor: Compressor, numel: int, dtype: torch.dtype, world_size: int, rank: int) -> int:
    """Bytes ``rank`` sends for one bucket through ``route`` (one of :data:`ROUTES`)."""
    if route == "dense":
        return allreduce_bytes(numel * wire.dtype_nbytes(dtype), world_size)
    if route == "allreduce":
        return allreduce_bytes(compressor.payload_nbytes(numel, dtype), world_size)
    if route == "allgather":
        return allgather_bytes(compressor.payload_nbytes(numel, dtype), world_size)
    if route == "twophase":
        return plan_chunks(compressor, numel, dtype, world_size).sent_bytes(rank)
    raise ValueError(f"route must be one of {', '.join(ROUTES)}; got {route!r}")


def choose_collective(
    collective: str, compressor: Compressor, numel: int, dtype: torch.dtype, world_size: int
) -> str:
    """The route a bucket takes: one of :data:`ROUTES`, identical on every rank.

    ``auto`` takes the route with the fewest bytes sent summed over all ranks (so the choice
    does not depend on the rank): for aggregatable codecs between ``allreduce`` and ``dense``
    (a ring all_reduce already is a reduce-scatter and an all-gather of the payload, summed as
    it is, so two phases would add a second compression for at most a few bytes of rounding);
    for the others among ``allgather``, ``twophase`` and ``dense``. Ties go to the earlier in
    that order (one round before two, compressed before dense). A forced collective is kept,
    except that a codec whose payload for the bucket would exceed the raw bytes sends the bucket
    ``dense`` (compression never sends more than the raw tensor).

    Args:
        collective: one of :data:`COLLECTIVES` (validated by :func:`check_collective`).
        numel, dtype: the bucket.
        world_size: ranks in the group.
    """
    raw = numel * wire.dtype_nbytes(dtype)
    payload = {
        "allreduce": compressor.payload_nbytes(numel, dtype),
        "allgather": compressor.payload_nbytes(numel, dtype),
        "twophase": plan_chunks(compressor, numel, dtype, world_size).total_payload_nbytes,
        "dense": raw,
    }
    if collective != "auto":
        return "dense" if payload[collective] > raw else collective
    # Summed over ranks: W ring shares for all_reduce, W (W-1) P for all_gather and, for two
    # phases, 2 (W-1) sum_j p_j (each chunk payload crosses W-1 links in each round).
    total = {
        "allreduce": world_size * allreduce_bytes(payload["allreduce"], world_size),
        "allgather": world_size * allgather_bytes(payload["allgather"], world_size),
        "twophase": 2 * (world_size - 1) * payload["twophase"],
        "dense": world_size * allreduce_bytes(raw, world_size),
    }
    compressed = ("allreduce",) if compressor.aggregatable else ("allgather", "twophase")
    candidates = [r for r in ROUTES if r == "dense" or (r in compressed and payload[r] <= raw)]
    return min(candidates, key=lambda r: (total[r], ROUTES.index(r)))
