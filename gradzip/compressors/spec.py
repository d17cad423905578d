"""One parser for codec specs such as ``topk:ratio=0.01`` or ``qsgd:bits=4,bucket=512``.

Grammar: ``name[:key=value[,key=value...]]``, and ``spec+spec`` to compose (the second codec
encodes the values the first keeps). Values parse as int (ASCII digits, an optional sign), then
float (ASCII decimal or exponent notation: ``nan``, ``inf``, ``1_000`` and other digits than
0-9 are not numbers here), then ``true``/``false``, else stay strings; a value with a character
outside ASCII is refused.
"""

from __future__ import annotations

import re
from typing import Any

from gradzip.compressors.values import FLOAT_TEXT, INT_TEXT

_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")
_KEY = re.compile(r"^[a-z_][a-z0-9_]*$")
MAX_SPEC_LEN = 1000


class SpecError(ValueError):
    """A codec spec that cannot be parsed or names an unknown codec or parameter."""


def parse_value(text: str) -> Any:
    """Turn a spec value into int, float, bool or str (see the module docstring)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    # Python's int() and float() also read other scripts' digits, underscores and nan/inf.
    if INT_TEXT.fullmatch(text):
        return int(text)
    if FLOAT_TEXT.fullmatch(text):
        return float(text)
    return text


def split_spec_list(text: str, *, name: str) -> list[str]:
    """Split a list of specs, the one rule of every option that takes several.

    Specs are separated by ``;`` or ``,``. A comma-separated item whose first ``+``-joined part is
    a bare ``key=value`` (no ``:``) continues the spec before it, so
    ``none,topk:ratio=0.01,start_step=3+uniform:bits=8,fp16`` gives ``none``,
    ``topk:ratio=0.01,start_step=3+uniform:bits=8`` and ``fp16``; ``none;fp16`` gives two.
    Empty items are dropped.

    Args:
        text: the list as the user wrote it.
        name: the option that holds it, for the error message.

    Raises:
        SpecError: naming ``name`` when the list is empty, names a spec twice or an item starts with a
            bare ``key=value``.
    """
    specs: list[str] = []
    for group in text.split(";"):
        first = True
        for item in (part.strip() for part in group.split(",")):
            if not item:
                continue
            head = item.split("+", 1)[0]
            if "=" in head and ":" not in head:
                if first:
                    raise SpecError(f"{name} must start each spec with a codec name, not the parameter {item!r}; got {text!r}")
                specs[-1] += "," + item
            else:
                specs.append(item)
            first = False
    twice = sorted({spec for spec in specs if specs.count(spec) > 1})
    if twice:
        raise SpecError(f"{name} lists {', '.join(repr(t) for t in twice)} twice; give each spec once")
    if not specs:
        raise SpecError(f"{name} must name at least one codec, such as none,fp16; got {text!r}")
    return specs


def parse_spec(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """Split a spec into ``[(name, params), ...]``, one entry per ``+``-joined part.

    Raises:
        SpecError: on an empty or malformed spec, a repeated key, or a bad name.
    """
    if not isinstance(spec, str):
        raise SpecError(f"compressor spec must be a string; got {type(spec).__name__}")
    if len(spec) > MAX_SPEC_LEN:
        raise SpecError(f"compressor spec is longer than {MAX_SPEC_LEN} characters")
    text = spec.strip()
    if not text:
        raise SpecError("compressor spec is empty; try 'none', 'fp16' or 'topk:ratio=0.01'")
    parts = []
    for part in text.split("+"):
        name, sep, rest = part.strip().partition(":")
        name = name.strip().lower()
        if not _NAME.match(name):
            raise SpecError(f"bad codec name {name!r} in spec {spec!r}")
        params: dict[str, Any] = {}
        if sep and not rest.strip():
            raise SpecError(f"spec {spec!r} has ':' but no parameters after it")
        for item in rest.split(",") if rest.strip() else []:
            key, eq, value = item.partition("=")
            key, value = key.strip().lower(), value.strip()
            if not eq or not _KEY.match(key) or not value:
                raise SpecError(f"bad parameter {item.strip()!r} in spec {spec!r}; expected key=value")
            if key in params:
                raise SpecError(f"parameter {key!r} given twice in spec {spec!r}")
            if not value.isascii():
                raise SpecError(f"{key} must be written in ASCII (digits 0-9, letters); got {value!r} in spec {spec!r}")
            params[key] = parse_value(value)
        parts.append((name, params))
    return parts


#: spec options handled by the reducer (DGC's warm-up and clipping) rather than by the codec
TRAINING_OPTIONS = ("warmup_steps", "warmup_stages", "clip_norm")


def split_training_options(spec: str) -> tuple[str, dict[str, Any]]:
    """``(codec spec, options)``: ``dgc:ratio=0.001,warmup_steps=100`` gives
    ``("dgc:ratio=0.001", {"warmup_steps": 100})``; options are :data:`TRAINING_OPTIONS`."""
    parts = parse_spec(spec)
    if len(parts) != 1:
        return spec, {}
    name, params = parts[0]
    options = {k: params.pop(k) for k in TRAINING_OPTIONS if k in params}
    if not options:
        return spec, {}
    return format_spec(name, params), options


def format_spec(name: str, params: dict[str, Any]) -> str:
    """``name:key=value,...`` that :func:`gradzip.compressors.parse_spec` reads back as ``params``
    (floats in their shortest exact form)."""
    if not params:
        return name
    return name + ":" + ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in params.items())
