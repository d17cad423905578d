"""Per-step figures collected by reducers and hooks: bytes, times, which collective ran, and how
faithful the compression was.

Reducers run partly on communication threads (future callbacks), so every update takes a lock.
``communicate_s`` is the wall time during which at least one collective of this rank was in
flight (overlapping collectives are not double counted); a bucket's own ``communicate_s`` runs from
the launch of its collective to its completion (collectives of different buckets may overlap).

Quality figures (every ``monitor_every`` steps), for the tensor ``x`` handed to the codec (the
gradient, plus the error-feedback residual where the codec keeps one) and its local decode
``d = D(C(x))``:

- norm ratio ``||d|| / ||x||``
- cosine ``<d, x> / (||d|| ||x||)``
- relative error ``||x - d|| / ||x||``
- error-feedback ratio ``||e|| / ||g||``: the residual kept after this step over the raw gradient.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Hashable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

QUALITY_FIELDS = ("norm_ratio", "cosine", "relative_error", "feedback_ratio")
TIME_FIELDS = ("compress_s", "decompress_s", "communicate_s")


class QualityAccumulator:
    """Sums that give the quality figures of a tensor sent in pieces (one piece or many).

    All sums are float64 Python numbers; each :meth:`add` costs four passes over the piece.
    """

    def __init__(self) -> None:
        self.xx = 0.0  # ||x||^2
        self.dd = 0.0  # ||d||^2
        self.xd = 0.0  # <x, d>
        self.diff = 0.0  # ||x - d||^2, computed directly: the identity xx - 2xd + dd cancels badly
        self.gg = 0.0  # ||g||^2 of the raw gradient
        self.ee = 0.0  # ||e||^2 of the residual kept
        self.has_feedback = False

    def add(self, sent: Tensor, decoded: Tensor) -> None:
        """Add one piece: ``sent`` (x, any shape and floating dtype) and ``decoded`` (d, same numel)."""
        x = sent.reshape(-1).float()
        d = decoded.reshape(-1).float()
        self.xx += float(torch.dot(x, x))
        self.dd += float(torch.dot(d, d))
        self.xd += float(torch.dot(x, d))
        self.diff += float(torch.linalg.vector_norm(x - d)) ** 2

    def add_exact(self, sent: Tensor) -> None:
        """Add a piece that travelled uncompressed (``d == x``)."""
        sq = float(torch.linalg.vector_norm(sent.float())) ** 2
        self.xx += sq
        self.dd += sq
        self.xd += sq

    def add_gradient(self, grad: Tensor) -> None:
        """Add a piece of the raw gradient (the denominator of the error-feedback ratio)."""
        self.gg += float(torch.linalg.vector_norm(grad.float())) ** 2

    def add_residual(self, residual: Tensor | None) -> None:
        """Add a piece of the error-feedback residual kept after this step (None: no feedback)."""
        if residual is None:
            return
        self.has_feedback = True
        self.ee += float(torch.linalg.vector_norm(residual.float())) ** 2

    def figures(self) -> dict[str, float] | None:
        """The quality figures; None when ``x`` is all zeros (no direction to compare)."""
        return quality_from_sums(self.xx, self.dd, self.xd, self.diff, self.gg, self.ee if self.has_feedback else None)


def quality_from_sums(
    xx: float, dd: float, xd: float, diff: float, gg: float = 0.0, ee: float | None = None
) -> dict[str, float] | None:
    """Norm ratio, cosine, relative error (and error-feedback ratio) from squared norms and a dot.

    Returns None when ``xx == 0``. A zero decode of a nonzero ``x`` has cosine 0.
    """
    if xx <= 0.0:
        return None
    x_norm, d_norm = math.sqrt(xx), math.sqrt(max(dd, 0.0))
    out = {
        "norm_ratio": d_norm / x_norm,
        "cosine": xd / (x_norm * d_norm) if d_norm > 0 else 0.0,
        "relative_error": math.sqrt(max(diff, 0.0)) / x_norm,
    }
    if ee is not None:
        out["feedback_ratio"] = math.sqrt(ee) / math.sqrt(gg) if gg > 0 else 0.0
    return out


def quality_figures(sent: Tensor, decoded: Tensor, *, grad: Tensor | None = None,
                    residual: Tensor | None = None) -> dict[str, float] | None:
    """Quality figures of one tensor (see the module docstring); None when ``sent`` is zero.

    Args:
        sent: x, the tensor handed to the codec; any shape, floating dtype.
        decoded: d = D(C(x)), the same number of elements.
        grad: the raw gradient (default ``sent``), for the error-feedback ratio.
        residual: the residual kept after this step; None leaves ``feedback_ratio`` out.
    """
    acc = QualityAccumulator()
    acc.add(sent, decoded)
    acc.add_gradient(sent if grad is None else grad)
    acc.add_residual(residual)
    return acc.figures()


def relative_difference(value: Tensor, reference: Tensor) -> dict[str, float]:
    """``||value - reference|| / ||reference||`` (0 when both are zero) and the max abs difference."""
    diff = value.reshape(-1).float() - reference.reshape(-1).float()
    ref = float(torch.linalg.vector_norm(reference.float()))
    err = float(torch.linalg.vector_norm(diff))
    return {
        "relative_difference": err / ref if ref > 0 else (0.0 if err == 0 else math.inf),
        "max_abs_difference": float(diff.abs().max()) if diff.numel() else 0.0,
    }


class StepMetrics:
    """Accumulates one step's figures; :meth:`pop` returns them and starts the next step.

    Args:
        monitor_every: compute quality figures every this many steps (0: never). Bytes and
            times are kept every step.
    """

    def __init__(self, monitor_every: int = 0) -> None:
        if isinstance(monitor_every, bool) or not isinstance(monitor_every, int) or monitor_every < 0:
            raise ValueError(f"monitor_every must be an integer >= 0; got {monitor_every!r}")
        self.monitor_every = monitor_every
        self._lock = threading.Lock()
        self._in_flight = 0
        self._flight_start = 0.0
        #: running totals per bucket since construction (never reset by pop); read by controllers
        self.totals: dict[Hashable, dict[str, float]] = {}
        self._reset()

    def _reset(self) -> None:
        self.payload_bytes = 0
        self.dense_bytes = 0
        self.compress_s = 0.0
        self.decompress_s = 0.0
        self.communicate_s = 0.0
        self.uncompressed_buckets = 0
        self.buckets: dict[Hashable, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []

    def wants_quality(self, step: int) -> bool:
        """Whether reducers should compute quality figures at ``step``."""
        return self.monitor_every > 0 and step % self.monitor_every == 0

    def _entry(self, key: Hashable) -> dict[str, Any]:
        entry = self.buckets.get(key)
        if entry is None:
            entry = self.buckets[key] = {
                "payload_bytes": 0, "dense_bytes": 0, "collective": None, "compressed": False,
                "compress_s": 0.0, "decompress_s": 0.0, "communicate_s": 0.0, "collectives": 0,
            }
        return entry

    def _total(self, key: Hashable) -> dict[str, float]:
        total = self.totals.get(key)
        if total is None:
            total = self.totals[key] = {"payload_bytes": 0, "collectives": 0, "calls": 0,
                                        "compress_s": 0.0, "decompress_s": 0.0, "communicate_s": 0.0}
        return total

    def add_bucket(
        self, key: Hashable, *, payload_bytes: int, dense_bytes: int, collective: str, compressed: bool = True,
        codec: str | None = None,
    ) -> None:
        """Record one bucket's exchange: bytes this rank handed to collectives, and how."""
        with self._lock:
            self.payload_bytes += payload_bytes
            self.dense_bytes += dense_bytes
            if not compressed:
                self.uncompressed_buckets += 1
            entry = self._entry(key)
            entry["payload_bytes"] += payload_bytes
            entry["dense_bytes"] += dense_bytes
            entry["collective"] = collective
            entry["compressed"] = compressed
            if codec is not None:
                entry["codec"] = codec
            total = self._total(key)
            total["payload_bytes"] += payload_bytes
            total["calls"] += 1

    @contextmanager
    def timed(self, field: str, key: Hashable | None = None):
        """Add the wall time of the ``with`` block to ``compress_s`` or ``decompress_s`` (and to
        bucket ``key``'s own figure when given)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                setattr(self, field, getattr(self, field) + elapsed)
                if key is not None:
                    self._entry(key)[field] += elapsed
                    self._total(key)[field] += elapsed

    def collective_started(self, key: Hashable | None = None) -> float:
        """Mark a collective as in flight; returns its start time (pass it to :meth:`collective_finished`)."""
        with self._lock:
            now = time.perf_counter()
            if self._in_flight == 0:
                self._flight_start = now
            self._in_flight += 1
            return now

    def collective_finished(self, key: Hashable | None = None, start: float | None = None) -> None:
        """Mark a collective as done; with ``key`` and ``start``, add its duration to that bucket."""
        with self._lock:
            now = time.perf_counter()
            self._in_flight -= 1
            assert self._in_flight >= 0, "collective finished more often than started"
            if self._in_flight == 0:
                self.communicate_s += now - self._flight_start
            if key is not None and start is not None:
                entry = self._entry(key)
                entry["communicate_s"] += now - start
                entry["collectives"] += 1
                total = self._total(key)
                total["communicate_s"] += now - start
                total["collectives"] += 1

    def add_quality(self, key: Hashable, figures: dict[str, float] | None) -> None:
        """Attach quality figures (see :func:`quality_figures`) to bucket ``key``; None is skipped."""
        if figures is None:
            return
        with self._lock:
            self._entry(key)["quality"] = dict(figures)

    def add_verify(self, key: Hashable, figures: dict[str, float]) -> None:
        """Attach the exactness check of bucket ``key`` (compressed mean against the dense mean)."""
        with self._lock:
            self._entry(key)["verify"] = dict(figures)

    def add_event(self, event: dict[str, Any]) -> None:
        """Record something that happened this step (an auto decision, a trial verdict)."""
        with self._lock:
            self.events.append(dict(event))

    def pop(self) -> dict[str, Any]:
        """This step's totals (``payload_bytes``, ``dense_bytes``, ``compression_ratio``, times,
        ``buckets`` with per-bucket bytes, times and, on monitored steps, ``quality``; ``events``),
        then reset."""
        with self._lock:
            out = {
                "payload_bytes": self.payload_bytes,
                "dense_bytes": self.dense_bytes,
                "compression_ratio": self.dense_bytes / self.payload_bytes if self.payload_bytes else 1.0,
                "compress_s": self.compress_s,
                "decompress_s": self.decompress_s,
                "communicate_s": self.communicate_s,
                "uncompressed_buckets": self.uncompressed_buckets,
                "buckets": self.buckets,
                "events": self.events,
            }
            self._reset()
            return out


# Figures over a window of steps, as adaptive controllers see them (identical on every rank:
# the reducer all-reduces them before a controller reads them).


@dataclass
class CandidateFigures:
    """One candidate codec priced on one bucket by a local probe (no collective).

    Attributes:
        spec: the codec spec.
        compress_s: seconds to encode the bucket (max over ranks).
        decompress_s: seconds to decode what arrives (every rank's payload for gathered codecs).
        payload_bytes: bytes this rank hands to collectives for the bucket.
        collectives: collectives per step (PowerSGD: 2).
        collective: ``allreduce`` or ``allgather``.
        relative_error: ``||g - D(C(g))|| / ||g||`` of one step's gradient, no error feedback
            (max over ranks); 0 for dense.
    """

    spec: str
    compress_s: float
    decompress_s: float
    payload_bytes: float
    collectives: float
    collective: str
    relative_error: float


@dataclass
class BucketFigures:
    """One bucket over a window.

    Attributes:
        key: the bucket's key (its index).
        numel: elements in the bucket.
        itemsize: bytes per element of the gradient.
        current: index of the candidate the bucket used in the window.
        payload_bytes: bytes handed to collectives per step in the window.
        communicate_s: seconds per step from launch to completion of its collectives (min over
            ranks: the last rank to arrive waits least, so its figure is closest to the transfer).
        collectives: collectives per step.
        collective: ``allreduce`` or ``allgather`` of the current codec.
        gradient_sum_norm: norm of the bucket's gradient summed over the window (max over ranks).
        entropy: normalised Shannon entropy in [0, 1] of a sample of the last gradient (max over ranks).
        candidates: probe figures per candidate (same order as the reducer's candidates), or
            None when this window did not probe.
    """

    key: Hashable
    numel: int
    itemsize: int
    current: int
    payload_bytes: float
    communicate_s: float
    collectives: float
    collective: str
    gradient_sum_norm: float
    entropy: float
    candidates: list[CandidateFigures] | None = None


@dataclass
class WindowFigures:
    """Everything a controller sees at the end of a window of steps ``[start, end)``.

    Attributes:
        start, end: the window's steps.
        world_size: ranks in the group.
        period_s: median seconds from one step's first bucket to the next step's (max over
            ranks), over the window's steps less its first (a switch) and last (the probe).
        buckets: per-bucket figures, in hook order.
    """

    start: int
    end: int
    world_size: int
    period_s: float
    buckets: list[BucketFigures] = field(default_factory=list)


@dataclass
class Plan:
    """A controller's answer: the candidate of each bucket for the next window.

    Attributes:
        choices: candidate index per bucket key.
        window_steps: length of the next window in steps.
        reasons: a sentence per bucket whose choice changed or was examined.
        note: a sentence about the whole decision (a trial started, accepted or rejected).
        probe_next: whether the next window should probe candidates at its last step.
    """

    choices: dict[Hashable, int]
    window_steps: int
    reasons: dict[Hashable, str] = field(default_factory=dict)
    note: str = ""
    probe_next: bool = True


def sampled_entropy(x: Tensor, *, samples: int = 65536, bins: int = 256) -> float:
    """Normalised Shannon entropy (in [0, 1]) of the values of ``x``, from an evenly strided
    sample of at most ``samples`` elements in a ``bins``-bin histogram between their min and max.

    The down-sampling follows EDGC (Yi et al., arXiv 2511.10333), which estimates gradient entropy
    on a sample to keep it cheap. A constant or empty tensor has entropy 0.
    """
    flat = x.reshape(-1)
    if flat.numel() < 2:
        return 0.0
    stride = max(1, flat.numel() // samples)
    sample = flat[::stride].float()
    low, high = float(sample.min()), float(sample.max())
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return 0.0
    counts = torch.histc(sample, bins=bins, min=low, max=high)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum()) / math.log(bins)
