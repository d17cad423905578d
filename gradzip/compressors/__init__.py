"""Codecs and their registry.

``build("topk:ratio=0.01")`` turns a spec string into a :class:`Compressor`; ``list_compressors()``
names every registered codec. One family per module: ``cast``, ``sparse``, ``quant``, ``sign``,
``lowrank``, ``separate`` (shared random projection), ``countsketch`` (bitmap and count sketch),
``radius`` (ranges chosen from the all-reduced gradient).
"""

from __future__ import annotations

import inspect
from typing import Any

from gradzip.compressors.base import Compressor, Payload, check_int, check_ratio, kept_count, seeded_generator
from gradzip.compressors.spec import SpecError, parse_spec

REGISTRY: dict[str, type[Compressor]] = {}


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: make ``cls`` buildable by its ``name``."""
    assert cls.name not in REGISTRY, f"codec {cls.name!r} registered twice"
    REGISTRY[cls.name] = cls
    return cls


def list_compressors() -> list[str]:
    """Names of every registered codec, sorted."""
    return sorted(REGISTRY)


def instantiate(name: str, params: dict[str, Any]) -> Compressor:
    if name not in REGISTRY:
        raise SpecError(f"unknown compressor {name!r}; known: {', '.join(list_compressors())}")
    cls = REGISTRY[name]
    accepted = [
        p.name
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    params = dict(params)
    # Every codec takes start_step; those without a parameter of that name get it as an attribute.
    start_step = params.pop("start_step") if "start_step" in params and "start_step" not in accepted else None
    for key in params:
        if key not in accepted:
            allowed = ", ".join(accepted if "start_step" in accepted else [*accepted, "start_step"])
            raise SpecError(f"{name} has no parameter {key!r}; it takes {allowed}")
    codec = cls(**params)
    if start_step is not None:
        codec.start_step = check_int(start_step, name="start_step", low=0)
        codec.params["start_step"] = codec.start_step
    return codec


def build(spec: str | Compressor) -> Compressor:
    """Build a codec from a spec string such as ``powersgd:approx_rank=4``.

    Every codec takes ``start_step=N`` (default 0): the reducers (DDP hook, two-phase, FSDP
    reduce-scatter, ``auto``'s candidates) exchange the gradient dense, one uncompressed
    all_reduce with the error-feedback residual untouched, at steps below ``N``, as PyTorch's
    PowerSGD hook does before ``start_powerSGD_iter``. Calling the codec directly ignores it.

    Args:
        spec: ``name[:key=value,...]`` or several joined by ``+`` (see :mod:`.spec`), or an
            already built :class:`Compressor`, returned as is.

    Raises:
        SpecError: (a ``ValueError``) for an unknown codec or parameter or a malformed spec.
        ValueError: for a parameter out of its range, naming it and the range.
    """
    if isinstance(spec, Compressor):
        return spec
    parts = parse_spec(spec)
    codecs = [instantiate(name, params) for name, params in parts]
    if len(codecs) == 1:
        return codecs[0]
    from gradzip.compressors.compose import Composed  # compose imports this registry

    return Composed(codecs)


def _import_codec_modules() -> None:
    """Import every module of this package, so that a codec registers itself by being a file here
    (adding a codec is one file plus its tests)."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        if not module.ispkg and not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


_import_codec_modules()

__all__ = [
    "Compressor",
    "Payload",
    "REGISTRY",
    "SpecError",
    "build",
    "check_int",
    "check_ratio",
    "instantiate",
    "kept_count",
    "list_compressors",
    "register",
    "seeded_generator",
]
