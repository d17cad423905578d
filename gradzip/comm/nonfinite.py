"""Non-finite gradients: every rank learns of them in the round that carries the payload.

The contract every reducer keeps (tested for every registered codec on real gloo ranks):

1. If the tensor handed to ``reduce`` holds inf or NaN on any rank, the result on every rank is
   entirely NaN: the marker a training loop tests for to skip the step on all ranks together.
   No extra collective and no extra byte is needed: the rank with the bad input sends a payload
   whose floating tensors are NaN, and every rank checks the floating tensors it receives
   (an all_reduce sum or every gathered payload) for NaN before decoding; the sum of the NaN
   with anything stays NaN. Only a codec whose payload holds no floating tensor at all gets a
   one-element fp16 slot beside it (:class:`MarkerSlot`, 2 bytes, counted).
2. A step whose result was the marker leaves no trace in the reducer: the error-feedback
   residuals, PowerSGD warm-start factors and codec state a step replaces are kept until the
   next step starts (or ``settle()``, or ``state_dict()``), and put back if any bucket of the
   step carried the marker.
3. Finite input never becomes non-finite on the way: codecs saturate at their wire dtype's
   largest finite value, payloads are divided by world_size before they are summed, a sum that
   still overflows by rounding (an inf, never a NaN, as every summand is finite) is saturated,
   and an error-compensated gradient that overflows where the gradient itself is finite is
   saturated too.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Hashable, Iterable
from typing import Any

import torch
from torch import Tensor

from gradzip.compressors import Compressor, Payload


def is_finite(t: Tensor) -> bool:
    """Whether every element of ``t`` is finite (True for an empty or integer tensor)."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    # min and max propagate NaN and show an inf: one reduction pass with no boolean copy, about
    # 20x faster than isfinite(t).all() on a CPU bucket, and this runs on every bucket each step.
    low, high = torch.aminmax(t)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def saturate(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``t`` clamped to the finite range of ``dtype`` (default ``t.dtype``); NaN stays NaN."""
    limit = torch.finfo(dtype or t.dtype).max
    return t.clamp(-limit, limit)


def checked_input(grad: Tensor, compensated: Tensor) -> tuple[Tensor, bool]:
    """The tensor to compress and whether it may be sent.

    Args:
        grad: the gradient as handed to the reducer.
        compensated: ``grad`` plus the error-feedback residual (or ``grad`` itself).

    Returns:
        ``(compensated, True)`` when it is finite; ``(saturated compensated, True)`` when only the
        residual sum overflowed (``grad`` is finite: compression must not turn that into inf);
        ``(compensated, False)`` when ``grad`` itself holds inf or NaN.
    """
    if is_finite(compensated):
        return compensated, True
    if compensated is not grad and is_finite(grad):
        return saturate(compensated), True
    return compensated, False


def has_float(tensors: Iterable[Tensor]) -> bool:
    """Whether any tensor is floating with at least one element (a place for the NaN marker)."""
    return any(t.is_floating_point() and t.numel() > 0 for t in tensors)


def poison(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Copies of ``tensors`` with every floating tensor filled with NaN (integer parts as they are)."""
    return tuple(torch.full_like(t, float("nan")) if t.is_floating_point() else t for t in tensors)


def received_marker(tensors: Iterable[Tensor]) -> bool:
    """Whether a received payload (a sum over ranks, or one rank's gathered payload) carries the
    NaN marker. An inf, which only a sum of finite values that overflowed can produce, is
    saturated in place at the dtype's range instead."""
    for t in tensors:
        if is_finite(t):
            continue
        if bool(torch.isnan(t).any()):
            return True
        saturate_(t)
    return False


def saturate_(t: Tensor) -> Tensor:
    """Replace +-inf in ``t`` by the dtype's largest finite value, in place; NaN stays NaN."""
    limit = torch.finfo(t.dtype).max
    return t.nan_to_num_(nan=float("nan"), posinf=limit, neginf=-limit)


class MarkerSlot(Compressor):
    """A codec whose payload holds no floating tensor, with a one-element fp16 tensor (0, or NaN
    as the marker) sent beside it: 2 bytes more than the codec's own payload, counted.

    Everything else (name, spec, properties, state) is the wrapped codec's.
    """

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner
        self.params = inner.params
        for attr in ("name", "aggregatable", "unbiased", "needs_shared_seed", "error_feedback", "multi_round", "start_step"):
            setattr(self, attr, getattr(inner, attr))

    @property
    def spec(self) -> str:
        """The wrapped codec's spec (its defaults and a composition's parts are its own)."""
        return self.inner.spec

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        payload = self.inner.compress(x, step=step, key=key)
        return Payload(payload.tensors + (torch.zeros(1, dtype=torch.float16, device=x.device),), payload.ctx)

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        return self.inner.decompress(Payload(payload.tensors[:-1], payload.ctx), like=like)

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return self.inner.payload_nbytes(numel, dtype) + 2

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def with_marker_slot(codec: Compressor) -> Compressor:
    """``codec`` itself if its payload has a floating tensor to carry the NaN marker, else
    wrapped in :class:`MarkerSlot` (found by encoding zeros with a copy of the codec)."""
    probe = copy.deepcopy(codec).compress(torch.zeros(4096), step=0, key="marker-probe")
    return codec if has_float(probe.tensors) else MarkerSlot(codec)


def marked(payload: Payload) -> Payload:
    """``payload`` with the NaN marker in every floating tensor (see :func:`with_marker_slot`
    for codecs that have none)."""
    return Payload(poison(payload.tensors), payload.ctx)


def marker_like(t: Tensor) -> Tensor:
    """The result a reducer returns for a step some rank could not send: all NaN, ``t``'s shape."""
    return torch.full_like(t, float("nan"))


class StepLedger:
    """The steps in which some bucket carried the NaN marker.

    One ledger is shared by every reducer of a hook (an auto hook holds several), so that a
    step skipped for one bucket is put back in the reducers of all the others too.
    """

    def __init__(self) -> None:
        self.nonfinite: set[int] = set()

    def mark_nonfinite(self, step: int) -> None:
        self.nonfinite.add(step)

    def finite(self, step: int) -> bool:
        return step not in self.nonfinite


class OpenStep:
    """The step whose changes a reducer can still put back, and the keys it has seen in it.

    ``begin(key, step)`` is called at the start of every ``reduce`` and returns the step that is
    over, if one is: a later step number arrived, or a key came back within the same number (a
    caller that reuses step numbers). ``finish()`` ends the open step explicitly.
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self.keys: set[Hashable] = set()

    def begin(self, key: Hashable, step: int) -> int | None:
        closed = None
        if self.step is not None and (step != self.step or key in self.keys):
            closed = self.finish()
        self.step = step
        self.keys.add(key)
        return closed

    def finish(self) -> int | None:
        closed, self.step, self.keys = self.step, None, set()
        return closed


def clone_state(state):
    """A deep copy of a state dict's tensors (containers rebuilt, other values shared)."""
    if isinstance(state, Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(clone_state(v) for v in state)
    return state
