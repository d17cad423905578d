"""The collective routes: one object per way a bucket travels, in one registry.

Each route (:class:`~gradzip.comm.routes.base.Route`) owns its name, the codecs it takes, its
byte formulas (``nbytes``: what a rank hands to the collectives; ``sent_nbytes``: what it sends
over the wire), its launch (the collective calls, through the group's ordered
:class:`~gradzip.comm.queue.CollectiveQueue`), its single-process reference (what ``N`` ranks
would end with) and its rounds for the cost model of ``gradzip simulate``. The reducers, the
route choice, the reference (:func:`gradzip.comm.reference.simulate_ranks`), the cost model, the
CLI's ``--collective`` choices and FSDP all read :data:`REGISTRY`; adding a route is one object
here (``tests/test_routes.py`` runs every registered route on gloo ranks).

Family ``mean`` (the DDP hook's reducers; every rank ends with the mean):

========== ===================================================== ============================
route      what travels                                           taken when
========== ===================================================== ============================
allreduce  aggregatable payloads, all_reduce-d                    ``auto`` for aggregatable codecs
allgather  every rank's payload, all_gather-ed                    ``auto`` for the others
twophase   1-bit Adam's compressed all_reduce (two rounds)        ``auto`` for the others
dense      the raw bucket, all_reduce-d                           compression would not pay
fused      small raw buckets, one all_reduce per dtype            below ``min_compress_bytes``
========== ===================================================== ============================

Family ``shard`` (FSDP's reduce-scatter; each rank ends with its chunk): ``reduce_scatter``,
``all_to_all`` and ``dense_reduce_scatter`` (:mod:`gradzip.comm.routes.sharded`).

Adding a route: a module here with a :class:`~gradzip.comm.routes.base.Route` subclass (its
class attributes say whether users may request it and whether ``auto`` weighs it; its methods
give ``payload_nbytes``, ``nbytes``, ``sent_nbytes``, ``cost``, ``reference`` and ``launch``),
and one instance in :data:`REGISTRY`. ``--collective``, the route choice, the reference, the
cost model and ``tests/test_routes.py`` (bytes handed to gloo and the reference against real
ranks) pick it up from there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradzip.comm.routes.allgather import AllGather
from gradzip.comm.routes.allreduce import AllReduce, predivide
from gradzip.comm.routes.base import MEAN, SHARD, Cost, Round, Route, raw_nbytes
from gradzip.comm.routes.dense import DenseAllReduce, FusedAllReduce
from gradzip.comm.routes.sharded import DenseReduceScatter, ShardAllToAll, ShardReduceScatter
from gradzip.comm.routes.sharded import choose_shard_route as _choose_shard_route
from gradzip.comm.routes.twophase import TwoPhase
from gradzip.compressors import Compressor

#: every route by name; the order breaks ties in :func:`choose_collective` (one round before
#: two, compressed before dense)
REGISTRY: dict[str, Route] = {
    route.name: route
    for route in (
        AllReduce(), AllGather(), TwoPhase(), DenseAllReduce(), FusedAllReduce(),
        ShardReduceScatter(), ShardAllToAll(), DenseReduceScatter(),
    )
}

#: what callers may pass as ``collective=``; ``auto`` picks by bytes
COLLECTIVES = ("auto", *(n for n, r in REGISTRY.items() if r.family == MEAN and r.requestable))
#: what :func:`choose_collective` may answer
ROUTES = tuple(n for n, r in REGISTRY.items() if r.family == MEAN and r.by_bytes)


def check_collective(collective: str, compressor: Compressor) -> str:
    """Validate a requested collective for ``compressor``.

    Raises:
        ValueError: for a name outside :data:`COLLECTIVES`, or a route that does not take the
            codec (``allreduce`` with a codec that is not aggregatable: the sum of its payloads
            does not decode to the sum of inputs).
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}; got {collective!r}")
    route = REGISTRY.get(collective)
    if route is not None and not route.accepts(compressor):
        others = [n for n in COLLECTIVES[1:] if REGISTRY[n].accepts(compressor)]
        need = "an aggregatable codec" if route.needs_aggregatable else "another codec"
        raise ValueError(
            f"collective={collective!r} needs {need}; {compressor.name} is not "
            f"(use {', '.join(others)} or auto)"
        )
    return collective


def choose_collective(
    collective: str, compressor: Compressor, numel: int, dtype: torch.dtype, world_size: int
) -> str:
    """The route a bucket takes: one of :data:`ROUTES`, identical on every rank.

    ``auto`` takes, among the routes whose ``auto_takes`` the codec (two phases do not take a
    codec whose second compression costs loss, ``Compressor.twophase_cost``) and whose payload
    does not exceed the raw bytes, plus ``dense``, the one with the fewest bytes sent summed over all
    ranks (``total_sent_nbytes``, so the choice does not depend on the rank); ties go to the
    earlier in :data:`REGISTRY`. A forced collective is kept, except that a codec whose payload
    for the bucket would exceed the raw bytes sends the bucket ``dense`` (compression never
    sends more than the raw tensor). :func:`explain_collective` says why, in words.

    Args:
        collective: one of :data:`COLLECTIVES` (validated by :func:`check_collective`).
        numel, dtype: the bucket.
        world_size: ranks in the group.
    """
    raw = raw_nbytes(numel, dtype)
    if collective != "auto":
        return "dense" if REGISTRY[collective].payload_nbytes(compressor, numel, dtype, world_size) > raw else collective
    return _auto_candidates(compressor, numel, dtype, world_size)[0][0]


def _auto_candidates(compressor: Compressor, numel: int, dtype: torch.dtype, world_size: int) -> list[tuple[str, int]]:
    """``(route, bytes sent summed over all ranks)`` of every route ``auto`` weighs for the bucket,
    the one it takes first (fewest bytes, ties to the earlier in :data:`REGISTRY`)."""
    raw = raw_nbytes(numel, dtype)
    candidates = [
        name for name in ROUTES
        if not REGISTRY[name].compressed
        or (REGISTRY[name].auto_takes(compressor) and REGISTRY[name].payload_nbytes(compressor, numel, dtype, world_size) <= raw)
    ]
    totals = [(name, REGISTRY[name].total_sent_nbytes(compressor, numel, dtype, world_size)) for name in candidates]
    return sorted(totals, key=lambda pair: (pair[1], ROUTES.index(pair[0])))


def explain_collective(
    collective: str, compressor: Compressor, numel: int, dtype: torch.dtype, world_size: int
) -> str:
    """Why :func:`choose_collective` takes its route for the bucket, in one line: the route
    asked for, or the bytes every route ``auto`` weighed would send (summed over the ranks),
    and what ``auto`` leaves out for this codec (two phases re-compress the mean on the rank
    that owns each chunk, so their loss can exceed ``allgather``'s)."""
    raw = raw_nbytes(numel, dtype)
    if collective != "auto":
        payload = REGISTRY[collective].payload_nbytes(compressor, numel, dtype, world_size)
        if payload > raw:
            return f"{collective} asked for, but its payload ({payload:,} B) exceeds the raw {raw:,} B: sent dense"
        return f"{collective} asked for"
    ranked = _auto_candidates(compressor, numel, dtype, world_size)
    weighed = ", ".join(f"{name} {nbytes:,} B" for name, nbytes in ranked)
    weighed_names = {name for name, _nbytes in ranked}
    skipped = [
        name for name in ROUTES
        if REGISTRY[name].compressed and name not in weighed_names and REGISTRY[name].accepts(compressor)
    ]
    text = f"fewest bytes sent over {world_size} ranks ({weighed})"
    if skipped:
        text += f"; {', '.join(skipped)} not weighed for {compressor.name}"
        if compressor.aggregatable:
            text += " (its payloads add up: all_reduce sums them)"
        elif "twophase" in skipped and compressor.twophase_cost:
            text += f" (two phases cost it loss: {compressor.twophase_cost}; --collective twophase takes them)"
    if ranked[0][0] == "twophase":
        text += "; two phases compress the mean a second time (--collective allgather sends one compression)"
    return text


def choose_shard_route(
    codec: Compressor, numel: int, dtype: torch.dtype, world_size: int, *, backend: str, step: int,
    floating_payload: Callable[[], bool],
) -> Route:
    """The shard route FSDP's reduce-scatter of ``numel`` elements takes (see
    :func:`gradzip.comm.routes.sharded.choose_shard_route`)."""
    return _choose_shard_route(
        codec, numel, dtype, world_size, backend=backend, step=step, floating_payload=floating_payload, routes=REGISTRY
    )


__all__ = [
    "COLLECTIVES", "MEAN", "REGISTRY", "ROUTES", "SHARD", "Cost", "Round", "Route", "check_collective",
    "choose_collective", "choose_shard_route", "explain_collective", "predivide",
]
