"""The codec interface: a tensor in, a :class:`Payload` out, and back.

A compressor never calls a collective. It declares the properties a reducer needs to pick one:
``aggregatable`` (the element-wise sum of payloads decodes to the sum of the inputs, so the
payload may be ``all_reduce``-d), ``unbiased`` and ``needs_shared_seed``.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from gradzip.compressors.kernels import wire
from gradzip.compressors.values import check_int, check_ratio

__all__ = ["Compressor", "Payload", "check_int", "check_ratio", "clamped_group", "kept_count", "seed_hash", "seeded_generator"]


@dataclass(frozen=True)
class Payload:
    """What one rank sends for one tensor.

    Attributes:
        tensors: exactly the tensors handed to the collective; their bytes are the payload.
        ctx: local metadata needed to decode (never sent); identical in shape on every rank.
    """

    tensors: tuple[Tensor, ...]
    ctx: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the sum of ``numel * element_size`` of :attr:`tensors`."""
        return wire.nbytes(self.tensors)


class Compressor(ABC):
    """A gradient codec.

    Subclasses set the class attributes and implement :meth:`compress`, :meth:`decompress` and
    :meth:`payload_nbytes`. Parameters come from the spec string (see
    :func:`gradzip.compressors.build`) as keyword arguments of ``__init__``.
    """

    name: ClassVar[str]
    aggregatable: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    needs_shared_seed: ClassVar[bool] = False
    #: whether the default reducer keeps an error-feedback residual for this codec
    error_feedback: ClassVar[bool] = False
    #: multi-round methods (PowerSGD, SEPARATE, the count sketch) run in a reducer of their own
    #: and have no single-shot compress: ``"module:Class"`` of that reducer, imported when a
    #: reducer is made (the reducers sit above the codecs, so the codec names it, not imports it)
    own_reducer: ClassVar[str | None] = None
    #: set from ``own_reducer`` for every subclass
    multi_round: ClassVar[bool] = False
    #: on a CUDA device, what its path through a hook reads on the host (each read waits for
    #: the device, which stalls the backward pass behind it); empty where it reads nothing
    #: (tests run those on meta tensors, which have no values to read)
    host_reads: ClassVar[str] = ""
    #: why compressing this codec's decoded mean a second time, as two phases do on the rank
    #: that owns each chunk, costs more loss than the bytes it saves are worth; ``auto`` then
    #: does not weigh the two-phase route (it can still be asked for). Empty where it does not.
    twophase_cost: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.multi_round = cls.own_reducer is not None
    #: steps exchanged dense (an uncompressed all_reduce, error feedback untouched) before the
    #: codec takes over; every codec accepts ``start_step=N`` in its spec (see :func:`build`)
    start_step: int = 0
    #: the most ranks the codec sums over (its int8 codes would overflow past it); None: no limit
    max_world_size: int | None = None

    def __init__(self, **params: Any) -> None:
        self.params = params

    @abstractmethod
    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """Encode ``x`` (any shape, floating dtype) into a payload."""

    @abstractmethod
    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Decode ``payload`` into a tensor with the shape, dtype and device of ``like``."""

    @abstractmethod
    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes on the wire for a tensor of ``numel`` elements of ``dtype`` (the formula)."""

    @property
    def spec(self) -> str:
        """The canonical spec: the name and the parameters that differ from their defaults.

        ``build(c.spec)`` gives a codec equal to ``c``; two codecs built from equivalent specs
        (``topk:ratio=1`` and ``topk:ratio=1.0``) have the same spec.
        """
        defaults = {
            p.name: p.default
            for p in inspect.signature(type(self).__init__).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }
        defaults.setdefault("start_step", 0)
        args = []
        for key, value in self.params.items():
            default = defaults.get(key, inspect.Parameter.empty)
            if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if default is not inspect.Parameter.empty and value == default and type(value) is type(default):
                continue
            args.append(f"{key}={_format(value)}")
        return f"{self.name}:{','.join(args)}" if args else self.name

    def replace(self, **changes: Any) -> Compressor:
        """A new codec of this kind with ``changes`` applied to its parameters (checked as
        :func:`gradzip.compressors.build` checks them)."""
        from gradzip.compressors import instantiate

        return instantiate(self.name, {**self.params, **changes})

    def state_dict(self) -> dict[str, Any]:
        """Codec state beyond its parameters (none for stateless codecs)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (stateless codecs hold nothing)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)
    return str(value)


def clamped_group(group: int, numel: int) -> int:
    """Elements per group actually used for a tensor of ``numel`` elements: ``group``, but no
    more than ``numel`` (at least 1), so that a group parameter larger than the tensor sizes no
    buffer beyond the tensor. One group either way: ``ceil(n / group)`` is unchanged."""
    return max(1, min(group, numel))


def kept_count(numel: int, ratio: float) -> int:
    """Elements kept at ``ratio``: ``clamp(round(ratio * numel), 1, numel)``; 0 for an empty tensor."""
    if numel == 0:
        return 0
    return min(max(int(round(ratio * numel)), 1), numel)


def seed_hash(seed: int, step: int, key: Hashable) -> int:
    """A 63-bit integer from ``(seed, step, key)``, the same in every process (FNV-1a of the text;
    ``hash()`` of a str differs between processes)."""
    text = f"{seed}/{step}/{key!r}".encode()
    h = 0xCBF29CE484222325
    for byte in text:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


def seeded_generator(seed: int, step: int, key: Hashable, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from ``(seed, step, key)``, identical on every rank; never the global RNG."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed_hash(seed, step, key))
    return gen
