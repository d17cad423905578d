"""What a compressor string asks for, parsed once at the edge into a typed value.

A compressor string (``--compressor`` on the command line, the first argument of
:class:`gradzip.CompressionState`) is one of three kinds:

- a codec spec, ``name[:key=value,...]`` or several joined by ``+`` (see
  :mod:`gradzip.compressors.spec`), optionally with DGC's reducer options ``warmup_steps``,
  ``warmup_stages`` and ``clip_norm`` (:mod:`gradzip.comm.warmup`) or with ``embeddings=CODEC``
  (the embedding tables sent by a summable elementwise codec of their own,
  :mod:`gradzip.comm.split`): a :class:`CodecChoice`;
- ``torch:NAME[:params]``, one of PyTorch's own DDP hooks run as an anchor: a
  :class:`TorchHookChoice` (the lab runs these; the library's hook does not);
- ``auto``: a :class:`AutoChoice`, a codec per bucket picked by :mod:`gradzip.control.auto`;
- ``kimad``, ``legacy``, ``edgc`` (with their parameters, ``kimad:target_ms=200``): an
  :class:`AutoChoice` of a per-layer schedule (:mod:`gradzip.control.schedules`), a codec per
  layer of every bucket.

:func:`parse_compressor` is the one place that reads the text; everything below it receives the
typed value or the objects built from it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from gradzip.compressors import REGISTRY, Compressor, SpecError, build, list_compressors, parse_spec
from gradzip.compressors.spec import TRAINING_OPTIONS, format_spec, split_training_options

AUTO = "auto"
#: the hook option that sends the embedding tables by a codec of their own
EMBEDDINGS = "embeddings"
#: the codecs the embedding tables may take: elementwise, and summed by all_reduce
EMBEDDING_CODECS = ("none", "fp16", "bf16", "int8")
#: PyTorch's DDP hooks that ``torch:NAME`` names, with the parameters each takes
TORCH_HOOKS: dict[str, tuple[str, ...]] = {
    "allreduce": (),
    "fp16": (),
    "bf16": (),
    "powersgd": ("approx_rank", "start_step"),
}


@dataclass(frozen=True)
class CodecChoice:
    """A gradzip codec, built, with DGC's reducer options if any were given.

    Attributes:
        codec: the built codec.
        warmup: ``warmup_steps``, ``warmup_stages``, ``clip_norm`` where given (empty: none).
        embeddings: the codec of the embedding tables (one of :data:`EMBEDDING_CODECS`), or None:
            they take ``codec`` like every other parameter.
    """

    codec: Compressor
    warmup: dict[str, Any] = field(default_factory=dict)
    embeddings: str | None = None
    kind = "codec"

    @property
    def hook_options(self) -> dict[str, Any]:
        """The options given beside the codec that only the DDP hook acts on (empty: none)."""
        return {**self.warmup, **({EMBEDDINGS: self.embeddings} if self.embeddings else {})}

    @property
    def spec(self) -> str:
        """The spec as the user gave it in canonical form, reducer options included."""
        options = ",".join(f"{k}={v}" for k, v in self.hook_options.items())
        if not options:
            return self.codec.spec
        return self.codec.spec + ("," if ":" in self.codec.spec else ":") + options


@dataclass(frozen=True)
class TorchHookChoice:
    """One of PyTorch's DDP hooks (``torch:fp16``, ``torch:powersgd:approx_rank=4``).

    Attributes:
        name: a key of :data:`TORCH_HOOKS`.
        params: its parameters (checked against :data:`TORCH_HOOKS`; values checked by the lab).
    """

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    kind = "torch"

    @property
    def spec(self) -> str:
        params = ",".join(f"{k}={v}" for k, v in self.params.items())
        return f"torch:{self.name}" + (f":{params}" if params else "")


@dataclass(frozen=True)
class AutoChoice:
    """A schedule that chooses while training: ``auto`` (a codec per bucket,
    :mod:`gradzip.control.auto`) or a per-layer schedule (``kimad``, ``legacy``, ``edgc``).

    Attributes:
        schedule: ``auto`` or a key of :data:`gradzip.control.schedules.LAYER_SCHEDULES`.
        params: the per-layer schedule's parameters as given (checked when parsed).
    """

    schedule: str = AUTO
    params: dict[str, Any] = field(default_factory=dict)
    kind = "auto"

    @property
    def per_layer(self) -> bool:
        return self.schedule != AUTO

    @property
    def spec(self) -> str:
        return format_spec(self.schedule, self.params)


Choice = CodecChoice | TorchHookChoice | AutoChoice


def accepted_names() -> str:
    """Every name a compressor string may start with, for error messages."""
    from gradzip.control.schedules import LAYER_SCHEDULES

    return ", ".join([*list_compressors(), AUTO, *LAYER_SCHEDULES, *(f"torch:{name}" for name in TORCH_HOOKS)])


def parse_compressor(text: str | Compressor | Choice) -> Choice:
    """Parse a compressor string (see the module docstring); built values pass through.

    Raises:
        SpecError: (a ``ValueError``) for an unknown name, listing every accepted one, or a
            malformed spec.
        ValueError: for a parameter out of its range, naming it and the range.
    """
    if isinstance(text, (CodecChoice, TorchHookChoice, AutoChoice)):
        return text
    if isinstance(text, Compressor):
        return CodecChoice(text)
    if not isinstance(text, str):
        raise SpecError(f"compressor must be a spec string or a codec; got {type(text).__name__}")
    stripped = text.strip()
    if stripped.lower() == AUTO:
        return AutoChoice()
    if stripped.lower().startswith("torch:"):
        return _torch_hook(stripped[len("torch:"):], text)
    parts = parse_spec(stripped)
    from gradzip.control.schedules import LAYER_SCHEDULES, layer_controller

    if len(parts) == 1 and parts[0][0] in LAYER_SCHEDULES:
        name, params = parts[0]
        # every parameter checked now, before training starts (the run's length comes later)
        layer_controller(name, params, total_steps=1)
        return AutoChoice(name, params)
    for name, _params in parts:
        if name == AUTO:  # ``auto`` alone was taken above; its settings go in CompressionState(auto=...)
            raise SpecError(f"auto takes no parameters and joins no composition; got {stripped!r}")
        if name not in REGISTRY:
            raise SpecError(f"unknown compressor {name!r}; known: {accepted_names()}")
    codec_spec, embeddings = _split_embeddings(stripped, parts)
    codec_spec, warmup = split_training_options(codec_spec)
    try:
        codec = build(codec_spec)
    except SpecError as exc:
        # The DDP warm-up's options were taken off the spec before the codec saw it: name them too.
        takes_ratio = "ratio" in inspect.signature(REGISTRY[parts[0][0]].__init__).parameters
        if len(parts) == 1 and "has no parameter" in str(exc) and takes_ratio:
            raise SpecError(f"{exc}; as a DDP hook's codec also {', '.join(TRAINING_OPTIONS)} "
                            "(DGC's sparsity warm-up)") from None
        raise
    if warmup:
        from gradzip.comm.warmup import WarmupReducer

        WarmupReducer.check_options(codec, **warmup)
    if warmup and embeddings:
        raise ValueError(f"{EMBEDDINGS}= does not combine with {', '.join(warmup)} (DGC's warm-up wraps whole buckets)")
    return CodecChoice(codec, warmup, embeddings)


def _split_embeddings(text: str, parts: list) -> tuple[str, str | None]:
    """``(the spec without embeddings=, its value)``: ``separate:embeddings=int8`` gives
    ``("separate", "int8")``; None where not given."""
    if len(parts) != 1 and any(EMBEDDINGS in params for _, params in parts):
        # each codec of a composition would refuse it as a parameter of its own
        raise SpecError(f"{EMBEDDINGS}= goes with one codec, not with a composition of several; got {text!r}")
    if len(parts) != 1 or EMBEDDINGS not in parts[0][1]:
        return text, None
    name, params = parts[0][0], dict(parts[0][1])
    value = str(params.pop(EMBEDDINGS)).lower()
    if value not in EMBEDDING_CODECS:
        raise ValueError(f"{EMBEDDINGS} must be one of {', '.join(EMBEDDING_CODECS)}; got {value!r}")
    return format_spec(name, params), value


def _torch_hook(rest: str, text: str) -> TorchHookChoice:
    parts = parse_spec(rest) if rest.strip() else []
    if len(parts) != 1 or parts[0][0] not in TORCH_HOOKS:
        raise SpecError(f"unknown PyTorch hook {text.strip()!r}; known: {', '.join(f'torch:{n}' for n in TORCH_HOOKS)}")
    name, params = parts[0]
    unknown = sorted(set(params) - set(TORCH_HOOKS[name]))
    if unknown:
        takes = ", ".join(TORCH_HOOKS[name]) or "no parameters"
        raise SpecError(f"torch:{name} takes {takes}; got {', '.join(unknown)}")
    return TorchHookChoice(name, params)
