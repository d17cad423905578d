"""Options declared once: a config dataclass field carries its help text, its check and how it
appears on the command line; the CLI, ``compare``'s pass-through and the checkpoint's
must-match list are derived from the fields.

    steps: int = option(300, "optimizer steps", check=Int(1))

A field's ``metadata`` holds an :class:`Option`. :func:`add_arguments` adds one argparse
argument per field; :func:`check_fields` runs every field's check; :func:`names_where` lists the
fields with a given flag (``must_match``, ``compare``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gradzip.compressors.base import check_int


def flag_of(name: str) -> str:
    """``--steps`` for the field ``steps``; ``--seq-len`` for ``seq_len``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Int:
    """An integer in ``[low, high]`` (``high`` None: no upper bound)."""

    low: int
    high: int | None = None
    parse = int

    def __call__(self, name: str, value: Any) -> None:
        check_int(value, name=flag_of(name), low=self.low, high=self.high)


@dataclass(frozen=True)
class Num:
    """A finite number in ``(low, high]`` (``closed_low``: from ``[low``; ``open_high``: to ``high)``;
    ``high`` None: unbounded)."""

    low: float
    high: float | None = None
    closed_low: bool = False
    open_high: bool = False
    parse = float

    def __call__(self, name: str, value: Any) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            ok = ok and math.isfinite(value)
        except OverflowError:  # an int too large for a float
            ok = False
        ok = ok and (value >= self.low if self.closed_low else value > self.low)
        ok = ok and (self.high is None or (value < self.high if self.open_high else value <= self.high))
        if not ok:
            left, right = "[" if self.closed_low else "(", ")" if self.open_high else "]"
            bound = f"in {left}{self.low:g}, {self.high:g}{right}" if self.high is not None else (
                f">= {self.low:g}" if self.closed_low else f"> {self.low:g}")
            raise ValueError(f"{flag_of(name)} must be a number {bound}; got {value!r}")


@dataclass(frozen=True)
class OneOf:
    """One of ``values``."""

    values: tuple[str, ...]
    parse = str

    def __call__(self, name: str, value: Any) -> None:
        if value not in self.values:
            raise ValueError(f"{flag_of(name)} must be one of {', '.join(self.values)}; got {value!r}")


@dataclass(frozen=True)
class Option:
    """How one config field appears to users.

    Attributes:
        help: the help text (``--help`` shows it with the default).
        check: validates the value (``Int``, ``Num``, ``OneOf`` or any callable ``(name, value)``);
            None: checked elsewhere or free.
        metavar: the argument's placeholder in ``--help``.
        group: the ``--help`` section ("" for the main one).
        cli: whether the option is on the command line at all.
        flag: the command-line flag when it is not the field's name (``--quiet`` for ``progress``).
        negate: a boolean shown as a flag that sets the field to False.
        must_match: a resumed run must use the checkpoint's value (it shapes the saved state or
            the data).
        compare: ``gradzip compare`` passes the option through to every run.
    """

    help: str
    check: Callable[[str, Any], None] | None = None
    metavar: str | None = None
    group: str = ""
    cli: bool = True
    flag: str | None = None
    negate: bool = False
    must_match: bool = False
    compare: bool = False


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with an :class:`Option` (keyword arguments as its attributes)."""
    return field(default=default, metadata={"option": Option(help, **kwargs)})


def _option(f: dataclasses.Field) -> Option | None:
    return f.metadata.get("option")


def as_argument(cls: type, name: str, value: Any) -> str:
    """Field ``name`` at ``value`` as the command line would give it: ``--n-layer 2``; a boolean
    as its flag (``--quiet`` for ``progress`` False) or ``without --quiet``."""
    opt = next((_option(f) for f in dataclasses.fields(cls) if f.name == name), None)
    flag = opt.flag if opt is not None and opt.flag else flag_of(name)
    if isinstance(value, bool):
        return flag if value != bool(opt is not None and opt.negate) else f"without {flag}"
    return f"{flag} {value}"


def names_where(cls: type, attribute: str) -> tuple[str, ...]:
    """Names of ``cls``'s fields whose :class:`Option` has ``attribute`` true, in field order."""
    return tuple(f.name for f in dataclasses.fields(cls) if _option(f) and getattr(_option(f), attribute))


def check_fields(obj: Any) -> None:
    """Run every field's check on ``obj``'s values.

    Raises:
        ValueError: from the first check that fails, naming the option and its range.
    """
    for f in dataclasses.fields(obj):
        opt = _option(f)
        if opt and opt.check is not None:
            opt.check(f.name, getattr(obj, f.name))


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *, names: Iterable[str] | None = None, defaults: bool = True,
    groups: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
) -> None:
    """Add one argument per command-line field of ``cls`` (or of ``names``) to ``parser``.

    Args:
        names: only these fields; None: every field with ``cli``.
        defaults: the fields' defaults as argparse defaults; False: None (the caller passes only
            what the user gave, as ``compare`` does).
        groups: argument groups by :attr:`Option.group`, created on first use when missing.
        overrides: defaults by field name in place of the fields' own (a command that runs the
            same job with other defaults, as ``finetune`` does).
    """
    overrides = overrides or {}
    groups = {} if groups is None else groups
    wanted = None if names is None else set(names)
    for f in dataclasses.fields(cls):
        opt = _option(f)
        if opt is None or not opt.cli or (wanted is not None and f.name not in wanted):
            continue
        target = parser
        if opt.group and isinstance(parser, argparse.ArgumentParser):  # groups do not nest
            if opt.group not in groups:
                groups[opt.group] = parser.add_argument_group(opt.group)
            target = groups[opt.group]
        flag = opt.flag or flag_of(f.name)
        default = overrides.get(f.name, f.default if f.default is not dataclasses.MISSING else None)
        help_text = opt.help.replace("%", "%%")
        if isinstance(default, bool):
            action = "store_false" if opt.negate else "store_true"
            target.add_argument(flag, dest=f.name, action=action, default=default if defaults else None, help=help_text)
            continue
        metavar = opt.metavar or {Int: "N", Num: "X"}.get(type(opt.check), "VALUE")
        kwargs: dict[str, Any] = {"dest": f.name, "metavar": metavar, "default": default if defaults else None}
        parse = getattr(opt.check, "parse", None)
        if parse is not None:
            kwargs["type"] = parse
        if isinstance(opt.check, OneOf):
            kwargs["choices"] = opt.check.values
            kwargs.pop("metavar")
        if defaults and default is not None:
            help_text += f" (default {default})"
        target.add_argument(flag, help=help_text, **kwargs)


def codec_only(spec: str, command: str) -> str:
    """``spec``, unless it names one of PyTorch's hooks or a schedule, which only a training run
    can take: then a ``ValueError`` saying so (``command`` measures or models codecs alone)."""
    from gradzip.choice import AUTO
    from gradzip.control.schedules import LAYER_SCHEDULES

    head = spec.strip().lower()
    if head.startswith("torch:"):
        raise ValueError(f"PyTorch's DDP hooks run in gradzip train and compare, not in {command}; name a gradzip "
                         "codec (gradzip list)")
    name = head.split(":")[0]
    if name in (AUTO, *LAYER_SCHEDULES):
        raise ValueError(f"{name} is a schedule that picks codecs as a run trains; {command} takes codecs "
                         "(gradzip list)")
    return spec


def list_entry(option: str, spec: str, build: Callable[[str], Any], *, names: tuple[str, ...] | None = None) -> Any:
    """``build(spec)`` for one entry of a list option (``--codecs``, ``--compressors``), its
    ``ValueError`` naming the option and the entry: ``--codecs entry 'topk:ratio=1.5': ratio must
    be in (0, 1]; got 1.5``. A message that starts by naming a single-value option this command
    has not (``names``, in order; by default the main job's ``--compressor SPEC:``) is reworded so."""
    try:
        return build(spec)
    except ValueError as exc:
        message = str(exc)
        for name in (f"--compressor {spec}: ",) if names is None else names:
            message = message.removeprefix(name)
        raise type(exc)(f"{option} entry {spec!r}: {message}") from None
