"""What each method puts on the wire for one bucket: the collectives, their bytes, the codec work.

Bytes come from the real codecs (``payload_nbytes``, PowerSGD's ``matrix_payload_nbytes``) built
by :func:`gradzip.compressors.build`, and the rounds of each single-round route from the route
itself (:meth:`gradzip.comm.routes.Route.cost`, read from :data:`gradzip.comm.routes.REGISTRY`);
nothing here keeps a second table of sizes. The route follows the codec's declared properties,
as the reducers do:

- ``aggregatable`` single-round codecs: ``all_reduce`` of the payload (DDP) or
  ``reduce_scatter`` of it (FSDP).
- other single-round codecs: ``all_gather`` of every worker's payload (per-worker traffic grows
  with ``p``), or the two-phase exchange of 1-bit Adam (Tang et al. 2021, arXiv 2102.02888):
  ``all_to_all`` of ``p`` compressed chunks, each worker averages its chunk, compresses it again
  and ``all_gather``-s it (per-worker traffic about ``2 payload(n)``, whatever ``p``).
- multi-round low-rank codecs (PowerSGD): one ``all_reduce`` per round of their factors.
- a payload larger than the dense tensor falls back to a dense ``all_reduce``, as the reducer does.

``diloco:sync_every=H[,fragments=F,delay=D][+CODEC]`` is DiLoCo (:class:`gradzip.DiLoCo`): no
exchange in backward; every ``H`` steps the fp32 pseudo-gradient of every parameter travels
through ``CODEC`` (default ``none``), one fragment per ``H / F`` steps (see
:mod:`gradzip.lab.simulate.step`).

``onebit-adam`` is a name of this module, not a codec: 1-bit Adam's momentum exchange after a
warm-up fraction of dense steps, as :class:`gradzip.optim.OneBitAdam` runs it (the two-phase
exchange of the ``efsignsgd`` payload, one per parameter tensor), or with ``fused=true`` as one
exchange of all momenta flattened into one buffer (DeepSpeed's ``compressed_allreduce``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradzip.comm.routes import MEAN
from gradzip.comm.routes import REGISTRY as ROUTE_REGISTRY
from gradzip.comm.routes import Route as CommRoute
from gradzip.compressors import REGISTRY, Compressor, build
from gradzip.compressors.kernels import wire
from gradzip.compressors.spec import parse_spec
from gradzip.compressors.values import check_number
from gradzip.lab.simulate.collectives import Fabric
from gradzip.outer.schedule import Schedule

#: ``collective`` values for codecs that are not aggregatable: ``auto`` or a route that takes them
COLLECTIVE_CHOICES = (
    "auto",
    *(n for n, r in ROUTE_REGISTRY.items() if r.family == MEAN and r.requestable and not r.needs_aggregatable),
)
ONEBIT_ADAM = "onebit-adam"
DILOCO = "diloco"
#: 1-bit Adam's default warm-up: the paper's BERT-Large pre-training froze the variance after
#: 23k of 152k steps, about 15% (Tang et al. 2021, arXiv 2102.02888, section 7.1).
ONEBIT_WARMUP_FRACTION = 0.15
#: registered 1-bit codecs whose payload 1-bit Adam's momentum exchange has, in order of preference
_SIGN_CODECS = ("efsignsgd", "signsgd")


@dataclass(frozen=True)
class Round:
    """One collective.

    Attributes:
        collective: ``allreduce``, ``allgather``, ``reducescatter`` or ``alltoall``.
        nbytes: the bytes argument of :meth:`Fabric.collective_s`: per worker for all_reduce;
            the gathered output for all_gather; each worker's input for reduce_scatter and
            all_to_all.
    """

    collective: str
    nbytes: int

    def sent_bytes(self, p: int) -> float:
        """Bytes one worker sends in this collective with the ring / pairwise algorithms."""
        if p == 1:
            return 0.0
        if self.collective == "allreduce":
            return 2 * (p - 1) / p * self.nbytes
        return (p - 1) / p * self.nbytes


@dataclass(frozen=True)
class Exchange:
    """How one bucket (or FSDP unit) travels.

    Attributes:
        method: ``dense``, ``allreduce``, ``allgather``, ``twophase``, ``reducescatter``,
            ``alltoall`` or ``lowrank``.
        rounds: the collectives, in order.
        payload_bytes: bytes this worker hands to collectives (the sum of its inputs).
        encode_bytes: dense bytes through the encoder (0 for no codec).
        decode_bytes: dense bytes out of the decoder (0 for no codec).
    """

    method: str
    rounds: tuple[Round, ...]
    payload_bytes: int
    encode_bytes: float = 0.0
    decode_bytes: float = 0.0

    def comm_s(self, fabric: Fabric, p: int, algorithm: str = "auto") -> float:
        """Seconds of all rounds, one after the other."""
        return sum(fabric.collective_s(r.collective, r.nbytes, p, algorithm) for r in self.rounds)

    def sent_bytes(self, p: int) -> float:
        """Bytes one worker sends over all rounds."""
        return sum(r.sent_bytes(p) for r in self.rounds)


def numel_of(shapes: Sequence[tuple[int, ...]]) -> int:
    """Elements in tensors of ``shapes``."""
    return sum(math.prod(s) for s in shapes)


def route_exchange(route: CommRoute, payload_nbytes, numel: int, dtype: torch.dtype, p: int, method: str | None = None) -> Exchange:
    """One bucket of ``numel`` elements through ``route`` (its :meth:`~gradzip.comm.routes.Route.cost`),
    named ``method`` (default the route's name)."""
    cost = route.cost(payload_nbytes, numel, dtype, p)
    rounds = tuple(Round(r.collective, r.nbytes) for r in cost.rounds)
    return Exchange(method or route.name, rounds, cost.payload_bytes, cost.encode_bytes, cost.decode_bytes)


def dense_exchange(numel: int, dtype: torch.dtype) -> Exchange:
    """Uncompressed all_reduce of ``numel`` elements of ``dtype``."""
    return route_exchange(ROUTE_REGISTRY["dense"], None, numel, dtype, 1)


def outer_schedule(params: dict) -> Schedule:
    """DiLoCo's schedule from ``diloco:`` parameters (``sync_every`` required; ``fragments`` and
    ``delay`` as :class:`gradzip.DiLoCo` takes them; fragments bounded by ``sync_every`` here,
    the model's tensor count being far larger).

    Raises:
        ValueError: for a missing ``sync_every``, another key, or a value out of range.
    """
    params = dict(params)
    unknown = sorted(set(params) - {"sync_every", "fragments", "delay"})
    if unknown or "sync_every" not in params:
        raise ValueError(f"{DILOCO} takes sync_every (required), fragments and delay; got {sorted(params)}")
    h = params["sync_every"]
    return Schedule(sync_every=h, fragments=params.get("fragments", 1), delay=params.get("delay", 0),
                    n_tensors=h if isinstance(h, int) and not isinstance(h, bool) and h >= 1 else 1)


class Method:
    """A codec spec as the model sees it: one entry of ``--compressors``.

    Args:
        spec: a codec spec (``powersgd:approx_rank=4``), ``onebit-adam[:warmup=0.15,fused=false]``
            or ``diloco:sync_every=H[,fragments=F,delay=D][+CODEC]``.

    Raises:
        ValueError: for an unknown codec or parameter, a warm-up outside [0, 1], or a DiLoCo
            schedule out of range (as :class:`gradzip.outer.schedule.Schedule` says).
    """

    def __init__(self, spec: str) -> None:
        self.spec = spec.strip()
        parts = parse_spec(self.spec)
        #: DiLoCo's schedule, None for a method that exchanges gradients every step
        self.outer: Schedule | None = None
        codec_spec = self.spec
        if parts[0][0] == DILOCO and DILOCO not in REGISTRY:
            outer_text, _, codec_spec = self.spec.partition("+")
            codec_spec = codec_spec.strip() or "none"
            self.outer = outer_schedule(parse_spec(outer_text)[0][1])
            parts = parse_spec(codec_spec)
            if parts[0][0] in (ONEBIT_ADAM, DILOCO):
                raise ValueError(f"the codec after {DILOCO}:...+ must be a gradzip codec; got {codec_spec!r}")
        self.onebit_adam = len(parts) == 1 and parts[0][0] == ONEBIT_ADAM and ONEBIT_ADAM not in REGISTRY
        self.codec: Compressor | None = None
        self.sign_codec: Compressor | None = None
        self.warmup_fraction = 0.0
        self.fused = False
        if self.onebit_adam:
            params = dict(parts[0][1])
            warmup = params.pop("warmup", ONEBIT_WARMUP_FRACTION)
            fused = params.pop("fused", False)
            if params:
                hint = ("; a projection has no step count: gradzip train's warmup_steps=N of --steps S is "
                        "warmup=N/S here") if "warmup_steps" in params else ""
                raise ValueError(
                    f"{ONEBIT_ADAM} takes warmup (a fraction of steps in [0, 1]) and fused (true or false); "
                    f"got {sorted(params)}{hint}"
                )
            check_number(warmup, name="warmup", low=0, high=1)
            if not isinstance(fused, bool):
                raise ValueError(f"fused must be true or false; got {fused!r}")
            self.warmup_fraction = float(warmup)
            self.fused = fused
            self.sign_codec = next((build(n) for n in _SIGN_CODECS if n in REGISTRY), None)
        else:
            self.codec = build(codec_spec)
            if not self.codec.multi_round:
                # As the reducers send it: a payload with no floating tensor carries a 2-byte
                # slot for the non-finite marker (gradzip.comm.nonfinite).
                from gradzip.comm.nonfinite import with_marker_slot

                self.codec = with_marker_slot(self.codec)
            lowrank_api = ("matrix_payload_nbytes", "compresses", "effective_rank")
            if self.codec.multi_round and not all(hasattr(self.codec, a) for a in lowrank_api):
                raise ValueError(
                    f"simulate models multi-round codecs by their low-rank factors ({', '.join(lowrank_api)}); "
                    f"{self.spec} has not all of them"
                )

    @property
    def is_identity(self) -> bool:
        """Whether this is the uncompressed baseline (``none``)."""
        return self.outer is None and self.codec is not None and self.codec.name == "none"

    def __repr__(self) -> str:
        return f"Method({self.spec!r})"

    # DDP -----------------------------------------------------------------------------------

    def ddp_candidates(self, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, p: int, collective: str = "auto") -> list[Exchange]:
        """The ways one DDP bucket holding tensors of ``shapes`` can travel.

        The step model takes the fastest by predicted seconds (the reducer's ``auto`` takes the
        fewest bytes sent; ``collective`` forces one route for both).

        Args:
            shapes: shapes of the gradients in the bucket (flattened end to end).
            dtype: gradient dtype.
            p: world_size.
            collective: for codecs that are not aggregatable: ``allgather``, ``twophase`` or
                ``auto`` (both are returned).

        Raises:
            ValueError: for an unknown ``collective``.
        """
        if collective not in COLLECTIVE_CHOICES:
            raise ValueError(f"collective must be one of {', '.join(COLLECTIVE_CHOICES)}; got {collective!r}")
        numel = numel_of(shapes)
        if self.onebit_adam:
            # During the compressed phase the gradient is not exchanged in backward at all.
            return [Exchange("none", (), 0)]
        codec = self.codec
        assert codec is not None
        dense_bytes = numel * wire.dtype_nbytes(dtype)
        if codec.name == "none":  # the baseline, or DiLoCo's uncompressed outer exchange
            return [dense_exchange(numel, dtype)]
        if codec.multi_round:
            return [lowrank_exchange(codec, shapes, dtype)]
        payload = codec.payload_nbytes(numel, dtype)
        if payload > dense_bytes:
            return [dense_exchange(numel, dtype)]
        # The compressed routes the reducer's auto weighs; a forced one for codecs that are not
        # aggregatable (an aggregatable codec's only such route is allreduce), even one that auto
        # leaves out for the codec (two phases for the sign codecs).
        forced = collective != "auto" and not codec.aggregatable
        routes = [
            r for r in ROUTE_REGISTRY.values()
            if r.family == MEAN and r.compressed
            and (r.name == collective and r.accepts(codec) if forced else r.auto_takes(codec))
        ]
        return [route_exchange(r, codec.payload_nbytes, numel, dtype, p) for r in routes]

    def onebit_momentum_exchange(self, numel: int, p: int) -> Exchange:
        """1-bit Adam's two-phase exchange of one fp32 momentum tensor of ``numel`` elements."""
        assert self.onebit_adam
        return twophase_exchange(self.sign_payload_nbytes, numel, torch.float32, p)

    def onebit_momentum_exchanges(self, shapes: Sequence[tuple[int, ...]], p: int) -> list[Exchange]:
        """The exchanges of one compressed step: one per parameter, or one of all if ``fused``."""
        if self.fused:
            return [self.onebit_momentum_exchange(numel_of(shapes), p)]
        return [self.onebit_momentum_exchange(math.prod(s), p) for s in shapes]

    def sign_payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """1-bit payload of ``numel`` elements: a registered sign codec's, else packed signs + one fp32 scale."""
        if self.sign_codec is not None:
            return self.sign_codec.payload_nbytes(numel, dtype)
        return wire.packed_nbytes(numel, 1) + wire.dtype_nbytes(torch.float32)

    # FSDP ----------------------------------------------------------------------------------

    def fsdp_gradient_exchange(self, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, p: int) -> Exchange:
        """How the gradients of one FSDP unit reach their shard owners.

        Aggregatable codecs reduce_scatter the payload; others all_to_all one compressed chunk
        per shard (the first phase of the two-phase exchange); low-rank codecs all_reduce their
        factors and each worker keeps its shard of the product.

        Raises:
            ValueError: for ``onebit-adam``, which is modelled with DDP only (like DeepSpeed's,
                it does not combine with sharded optimizer states).
        """
        if self.onebit_adam:
            raise ValueError(f"{ONEBIT_ADAM} is modelled with strategy ddp only; use another codec with fsdp")
        numel = numel_of(shapes)
        dense_bytes = numel * wire.dtype_nbytes(dtype)
        codec = self.codec
        assert codec is not None
        if codec.multi_round:
            return lowrank_exchange(codec, shapes, dtype)
        if self.is_identity or codec.payload_nbytes(numel, dtype) > dense_bytes:
            route = ROUTE_REGISTRY["dense_reduce_scatter"]
        else:
            # The ring (NCCL) the model prices sums aggregatable payloads on the wire.
            route = ROUTE_REGISTRY["reduce_scatter" if codec.aggregatable else "all_to_all"]
        ex = route_exchange(route, codec.payload_nbytes, numel, dtype, p)
        return Exchange(ex.rounds[0].collective, ex.rounds, ex.payload_bytes, ex.encode_bytes, ex.decode_bytes)


def twophase_exchange(payload_nbytes, numel: int, dtype: torch.dtype, p: int) -> Exchange:
    """The two-phase compressed all_reduce of ``numel`` elements over ``p`` workers
    (:class:`gradzip.comm.routes.twophase.TwoPhase`).

    The bucket is cut as :func:`gradzip.comm.traffic.chunk_sizes` cuts it (``p`` chunks, sizes
    differing by at most one) and every chunk compressed: ``P = sum_j payload(c_j)`` bytes per
    worker, the figure the reducer records. Phase 1: all_to_all of the chunk payloads (each worker
    holds ``P``). Each worker decodes the ``p`` versions of its chunk, averages, compresses again.
    Phase 2: all_gather of those (``P`` gathered). Per-worker bytes sent: about ``2 (p-1)/p P``,
    flat in ``p``.

    Args:
        payload_nbytes: the codec's ``payload_nbytes(numel, dtype)``.
    """
    return route_exchange(ROUTE_REGISTRY["twophase"], payload_nbytes, numel, dtype, p)


def lowrank_exchange(codec: Compressor, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> Exchange:
    """PowerSGD's two all_reduce rounds for a bucket of tensors of ``shapes``.

    Round 1 carries the tensors that travel uncompressed and ``P`` (``n x r``) of every matrix;
    round 2 carries ``Q`` (``m x r``). Their sum equals the codec's ``matrix_payload_nbytes``.
    """
    from gradzip.compressors.lowrank import matrix_view_shape

    item = wire.dtype_nbytes(dtype)
    round1 = round2 = 0
    compressed = False
    for shape in shapes:
        if codec.compresses(shape):
            n, m = matrix_view_shape(shape)
            r = codec.effective_rank(n, m)
            round1 += n * r * item
            round2 += m * r * item
            compressed = True
        else:
            round1 += math.prod(shape) * item
    total = sum(codec.matrix_payload_nbytes(s, dtype) for s in shapes)
    assert round1 + round2 == total, "round bytes disagree with the codec's matrix_payload_nbytes"
    dense = numel_of(shapes) * item
    if not compressed:
        return Exchange("dense", (Round("allreduce", round1),), round1)
    return Exchange("lowrank", (Round("allreduce", round1), Round("allreduce", round2)), total, dense, dense)
