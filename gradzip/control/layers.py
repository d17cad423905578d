"""What the per-layer schedules (Kimad, LEGACY, EDGC) share: the codec and the parameter their
decisions set, the spec of a layer at a level, its bytes on the wire, and a schedule's settings
read from a spec string.

A schedule compresses every layer with one codec (``codec=topk`` by default) and decides one
number per layer, the codec's *knob*: ``ratio`` for the sparsifiers (Top-K, Random-K, DGC),
``approx_rank`` for PowerSGD, ``bits`` for the quantizers. A layer whose codec would send more
than its raw bytes at that level travels dense (``none``), as every gradzip exchange does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Hashable, Sequence
from dataclasses import fields
from typing import Any

import torch

from gradzip.comm.int8sum import sent_nbytes as int8_sent_nbytes
from gradzip.comm.layered import INT8, LOW_RANK, summed
from gradzip.comm.traffic import allgather_bytes, allreduce_bytes
from gradzip.compressors import REGISTRY, Compressor, SpecError, build

DENSE = "none"
#: the knob of a codec, in order of preference among its parameters
KNOBS = ("ratio", "approx_rank", "bits")
#: a schedule's levels when none are given, by knob: ratios, ranks, bits
DEFAULT_LEVELS = {"ratio": "0.001/0.01/0.1", "approx_rank": "1/2/4/8", "bits": "2/4/8"}


def knob_of(codec: str) -> str:
    """The parameter a schedule sets for codec ``codec`` (a registered name).

    Raises:
        ValueError: for an unknown codec or one with no ratio, rank or bits to set.
    """
    if codec not in REGISTRY:
        raise SpecError(f"codec must be a registered codec name; got {codec!r}")
    params = inspect.signature(REGISTRY[codec].__init__).parameters
    for knob in KNOBS:
        if knob in params:
            return knob
    raise ValueError(f"codec {codec} has none of {', '.join(KNOBS)} for a schedule to set")


class Ladder:
    """One codec at the levels of its knob: specs, bytes and the dense fallback.

    Args:
        codec: a registered codec name (``topk``, ``powersgd``, ``qsgd``, ...).
        extra: further parameters of the codec, fixed at every level.
    """

    def __init__(self, codec: str, **extra: Any) -> None:
        self.knob = knob_of(codec)
        if REGISTRY[codec].multi_round and codec != LOW_RANK:
            raise ValueError(
                f"codec must be a single-round codec or {LOW_RANK} (the per-layer exchange runs those); "
                f"{codec} has its own exchange"
            )
        self.codec = codec
        self.extra = extra
        self._built: dict[Any, Compressor] = {}

    def build(self, level: Any) -> Compressor:
        """The codec at ``level`` (cached).

        Raises:
            ValueError: for a level out of the knob's range.
        """
        codec = self._built.get(level)
        if codec is None:
            codec = build(self.codec).replace(**self.extra, **{self.knob: level})
            self._built[level] = codec
        return codec

    def spec(self, level: Any, shape: torch.Size, dtype: torch.dtype = torch.float32) -> str:
        """The spec of a layer of ``shape`` at ``level``: the codec's, or ``none`` where it would
        not send fewer bytes than the raw layer (for PowerSGD: where the layer is not a matrix
        its rank compresses)."""
        if level is None:
            return DENSE
        codec = self.build(level)
        numel = torch.Size(shape).numel()
        if codec.multi_round:
            return codec.spec if codec.compresses(shape) else DENSE
        return codec.spec if codec.payload_nbytes(numel, dtype) < numel * dtype.itemsize else DENSE


@functools.lru_cache(maxsize=4096)
def sent_bytes(spec: str, shape: torch.Size, dtype: torch.dtype, world_size: int) -> int:
    """Bytes one rank sends for one layer under ``spec`` in the layered exchange
    (:mod:`gradzip.comm.layered`): all_reduce for summable payloads, PowerSGD's factors and
    ``int8``'s scales and codes, all_gather for the rest. Cached: a schedule prices every layer
    at every level each time it plans."""
    codec = build(spec)
    shape = torch.Size(shape)
    if codec.name == INT8:  # scales by MAX, then codes by SUM
        return int8_sent_nbytes(codec.n_scales(shape.numel()), shape.numel(), world_size)
    if codec.multi_round:
        return allreduce_bytes(codec.matrix_payload_nbytes(shape, dtype), world_size)
    payload = codec.payload_nbytes(shape.numel(), dtype)
    return allreduce_bytes(payload, world_size) if summed(codec) else allgather_bytes(payload, world_size)


def levels_text(text: Any, *, name: str, kind: type = float) -> tuple:
    """A ``/``-separated list of numbers (``0.001/0.01/0.1``) as a tuple of ``kind``.

    Raises:
        ValueError: naming ``name`` for an empty list or a value that is not a ``kind``.
    """
    if isinstance(text, (tuple, list)):
        items = [str(v) for v in text]
    else:
        items = str(text).split("/") if not isinstance(text, (int, float)) else [str(text)]
    try:
        values = tuple(kind(item) if kind is float else _int(item) for item in items if item.strip())
    except ValueError:
        raise ValueError(f"{name} must be numbers separated by '/'; got {text!r}") from None
    if not values:
        raise ValueError(f"{name} must list at least one value; got {text!r}")
    return values


def _int(text: str) -> int:
    value = float(text)
    if value != int(value):
        raise ValueError(text)
    return int(value)


def settings_from(cls, params: dict[str, Any], *, schedule: str):
    """Build the settings dataclass ``cls`` from a spec's parameters (unknown ones refused)."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - names)
    if unknown:
        raise SpecError(f"{schedule} has no parameter {unknown[0]!r}; it takes {', '.join(sorted(names))}")
    return cls(**params).validate()


class LayerSchedule:
    """The part of the controller interface every per-layer schedule shares."""

    per_layer = True
    needs_gradient_sum = False
    needs_entropy = False
    entropy_every = 0
    min_window_steps = 3

    def first_window_steps(self) -> int:
        return 5

    def begin(self, world_size: int) -> None:
        """Called once, before the first plan is asked for, with the group's size."""

    def probe_specs(self, key: Hashable, shapes: Sequence[torch.Size]) -> list[list[str]]:
        return [[] for _ in shapes]

    def entropy(self, averaged: torch.Tensor) -> float:
        return 0.0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
