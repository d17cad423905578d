"""The codec interface: a tensor in, a :class:`Payload` out, and back.

A compressor never calls a collective. It declares the properties a reducer needs to pick one:
``aggregatable`` (the element-wise sum of payloads decodes to the sum of the inputs, so the
payload may be ``all_reduce``-d), ``unbiased`` and ``needs_shared_seed``.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from gradzip.compressors.kernels import wire


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
    #: multi-round methods (PowerSGD) provide their own reducer and no single-shot compress
    multi_round: ClassVar[bool] = False
    #: steps exchanged dense (an uncompressed all_reduce, error feedback untouched) before the
    #: codec takes over; every codec accepts ``start_step=N`` in its spec (see :func:`build`)
    start_step: int = 0

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


def check_ratio(ratio: float, *, name: str = "ratio") -> float:
    """Validate a kept fraction in (0, 1].

    Raises:
        ValueError: naming ``name`` when ``ratio`` is not a finite number in (0, 1].
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio):
        raise ValueError(f"{name} must be a number in (0, 1]; got {ratio!r}")
    if not 0 < ratio <= 1:
        raise ValueError(f"{name} must be in (0, 1]; got {ratio}")
    return float(ratio)


def check_int(value: int, *, name: str, low: int, high: int | None = None) -> int:
    """Validate an integer in ``[low, high]`` (``high`` None: unbounded).

    Raises:
        ValueError: naming ``name`` and the allowed range.
    """
    bound = f"[{low}, {high}]" if high is not None else f">= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer {bound}; got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer {bound}; got {value}")
    return value


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
