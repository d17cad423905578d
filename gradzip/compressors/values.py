"""Validation of the numbers in codec specs and options: one place, one wording.

Every check refuses what is not a number of the right kind (``bool`` is not a number here),
NaN and infinities, and values outside the allowed range, with a ``ValueError`` that names the
parameter and the range. Integers of any size are compared exactly before anything converts
them, so a 400-digit value is refused with its range instead of overflowing in ``float()`` or
``math.isfinite``; integers stop at :data:`MAX_INT` (they may travel as int64, seed a
generator or size a tensor).
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any

#: the largest integer a parameter may hold: int64's largest
MAX_INT = 2**63 - 1
#: the largest finite float
MAX_FLOAT = sys.float_info.max
#: an integer as text: ASCII digits and an optional sign (Python's ``int()`` also reads other
#: scripts' digits, ``1_000`` and surrounding blanks)
INT_TEXT = re.compile(r"[+-]?[0-9]+", re.ASCII)
#: a decimal number as text, ASCII only (``float()`` also reads ``nan``, ``inf`` and other digits)
FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)


def shown(value: Any, limit: int = 40) -> str:
    """``repr(value)``, cut in the middle past ``limit`` characters (a 400-digit number in an
    error message would bury the message)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]}...{text[-limit // 4:]} ({len(text)} characters)"


def is_number(value: Any) -> bool:
    """Whether ``value`` is an int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(value: Any, *, name: str, low: int, high: int | None = None) -> int:
    """Validate an integer in ``[low, high]`` (``high`` None: up to :data:`MAX_INT`).

    Raises:
        ValueError: naming ``name`` and the allowed range.
    """
    bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer {bound}; got {shown(value)}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer {bound}; got {shown(value)}")
    if value > MAX_INT:
        raise ValueError(f"{name} must be an integer in [{low}, {MAX_INT}]; got {shown(value)}")
    return value


def check_number(
    value: Any, *, name: str, low: float | None = None, high: float | None = None, low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Validate a finite number in the interval ``low`` .. ``high`` (None: unbounded that side;
    ``*_open``: the end itself excluded). Returns it as a float.

    Raises:
        ValueError: naming ``name`` and the interval, for a non-number, NaN, an infinity, a value
            outside the interval, or an integer too large for a float.
    """
    bound = _interval(low, high, low_open, high_open)
    if not is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{name} must be a number {bound}; got {shown(value)}")
    # int against float compares exactly in Python, whatever the int's size.
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        wording = "" if low is not None and high is not None else "a number "
        raise ValueError(f"{name} must be {wording}{bound}; got {shown(value)}")
    if abs(value) > MAX_FLOAT:
        finite = _interval(-MAX_FLOAT if low is None else low, MAX_FLOAT if high is None else high, low_open, high_open)
        raise ValueError(f"{name} must be a finite number {finite}; got {shown(value)}")
    return float(value)


def check_flag(value: Any, *, name: str) -> bool:
    """Validate a True/False setting (a string such as ``"no"`` would read as true).

    Raises:
        ValueError: naming ``name``.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")
    return value


def check_ratio(ratio: Any, *, name: str = "ratio") -> float:
    """Validate a kept fraction in (0, 1].

    Raises:
        ValueError: naming ``name`` when ``ratio`` is not a finite number in (0, 1].
    """
    return check_number(ratio, name=name, low=0, high=1, low_open=True)


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is None and high is None:
        return "(finite)"
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
