"""Per-step figures collected by reducers and hooks: bytes, times, which collective ran, and how
faithful the compression was.

Reducers run partly on communication threads (future callbacks), so every update takes a lock.
``communicate_s`` is the wall time during which at least one collective of this rank was in
flight (overlapping collectives are not double counted).

Per bucket (``buckets[key]``): the route it took (``collective``: ``allreduce``, ``allgather``,
``twophase``, ``dense``, ``fused``, or ``layered`` under a per-layer plan), whether it was
compressed, ``codec`` (its spec), ``payload_bytes`` (the codec's payload of the bucket),
``sent_bytes`` and ``received_bytes`` (what this rank moves over the wire by the formulas of
:mod:`gradzip.comm.traffic`), and ``compress_s``, ``communicate_s`` (launch to completion of
each of its collectives, summed; collectives of different buckets may overlap) and
``decompress_s``. Under a per-layer plan, ``layers`` lists
each layer of the bucket in order with its ``codec``, ``numel`` and ``payload_bytes``.

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
from typing import Any

import torch
from torch import Tensor
from torch.futures import Future

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

    def add(self, sent: Tensor, decoded: Tensor, *, difference: Tensor | None = None) -> None:
        """Add one piece: ``sent`` (x, any shape and floating dtype) and ``decoded`` (d, same numel).

        ``difference``, when given, is ``x - d`` already computed (an error-feedback residual is
        exactly that), which saves a pass and an allocation the size of the piece.
        """
        x = sent.reshape(-1).float()
        d = decoded.reshape(-1).float()
        self.xx += float(torch.dot(x, x))
        self.dd += float(torch.dot(d, d))
        self.xd += float(torch.dot(x, d))
        diff = x - d if difference is None else difference.float()
        self.diff += float(torch.linalg.vector_norm(diff)) ** 2

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
                    residual: Tensor | None = None, difference: Tensor | None = None) -> dict[str, float] | None:
    """Quality figures of one tensor (see the module docstring); None when ``sent`` is zero.

    Args:
        sent: x, the tensor handed to the codec; any shape, floating dtype.
        decoded: d = D(C(x)), the same number of elements.
        grad: the raw gradient (default ``sent``), for the error-feedback ratio.
        residual: the residual kept after this step; None leaves ``feedback_ratio`` out.
        difference: ``sent - decoded`` if already at hand (an error-feedback residual updated
            this step is exactly that); saves a pass and an allocation.
    """
    acc = QualityAccumulator()
    acc.add(sent, decoded, difference=difference)
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
        #: wall seconds with at least one collective in flight since construction (never reset)
        self.in_flight_total_s = 0.0
        #: the link as an adaptive reducer last estimated it (``mbit``, ``latency_ms``, ``step``:
        #: the step it was estimated at), None when nothing estimates it; kept by pop
        self.link: dict[str, float] | None = None
        self._reset()

    def _reset(self) -> None:
        self.payload_bytes = 0
        self.dense_bytes = 0
        self.compress_s = 0.0
        self.decompress_s = 0.0
        self.communicate_s = 0.0
        self.sent_bytes = 0
        self.received_bytes = 0
        self.uncompressed_buckets = 0
        self.fused_buckets = 0
        self.buckets: dict[Hashable, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []

    def wants_quality(self, step: int) -> bool:
        """Whether reducers should compute quality figures at ``step``."""
        return self.monitor_every > 0 and step % self.monitor_every == 0

    def _entry(self, key: Hashable) -> dict[str, Any]:
        return self.buckets.setdefault(
            key,
            {
                "collective": None, "compressed": False, "payload_bytes": 0, "dense_bytes": 0,
                "sent_bytes": 0, "received_bytes": 0, "compress_s": 0.0, "communicate_s": 0.0,
                "decompress_s": 0.0, "collectives": 0,
            },
        )

    def _total(self, key: Hashable) -> dict[str, float]:
        return self.totals.setdefault(
            key,
            {"payload_bytes": 0, "sent_bytes": 0, "collectives": 0, "calls": 0, "compress_s": 0.0,
             "decompress_s": 0.0, "communicate_s": 0.0},
        )

    def add_bucket(
        self,
        key: Hashable,
        *,
        payload_bytes: int,
        dense_bytes: int,
        collective: str,
        compressed: bool = True,
        sent_bytes: int = 0,
        received_bytes: int = 0,
        codec: str | None = None,
    ) -> None:
        """Record one bucket's exchange: the route, the codec's payload bytes, the raw bytes and
        the bytes this rank sends and receives over the wire."""
        with self._lock:
            self.payload_bytes += payload_bytes
            self.dense_bytes += dense_bytes
            self.sent_bytes += sent_bytes
            self.received_bytes += received_bytes
            if not compressed:
                self.uncompressed_buckets += 1
            if collective == "fused":
                self.fused_buckets += 1
            entry = self._entry(key)
            entry["collective"] = collective
            entry["compressed"] = compressed
            entry["payload_bytes"] += payload_bytes
            entry["dense_bytes"] += dense_bytes
            entry["sent_bytes"] += sent_bytes
            entry["received_bytes"] += received_bytes
            if codec is not None:
                entry["codec"] = codec
            total = self._total(key)
            total["payload_bytes"] += payload_bytes
            total["sent_bytes"] += sent_bytes
            total["calls"] += 1

    @contextmanager
    def timed(self, field: str, key: Hashable | None = None):
        """Add the wall time of the ``with`` block to ``compress_s`` or ``decompress_s``, and to
        bucket ``key``'s figure when given."""
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

    def track(self, fut: Future, keys: tuple[Hashable, ...] = ()) -> Future:
        """Count a just-issued collective as in flight until ``fut`` completes; its duration is
        added to the ``communicate_s`` of each bucket in ``keys``. Returns ``fut``."""
        self.collective_started()
        start = time.perf_counter()

        def done(_fut: Future) -> None:
            elapsed = time.perf_counter() - start
            with self._lock:
                for key in keys:
                    entry = self._entry(key)
                    entry["communicate_s"] += elapsed
                    entry["collectives"] += 1
                    total = self._total(key)
                    total["communicate_s"] += elapsed
                    total["collectives"] += 1
            self.collective_finished()

        fut.add_done_callback(done)
        return fut

    def collective_started(self) -> None:
        """Mark a collective as in flight."""
        with self._lock:
            if self._in_flight == 0:
                self._flight_start = time.perf_counter()
            self._in_flight += 1

    def collective_finished(self) -> None:
        """Mark a collective as done."""
        with self._lock:
            self._in_flight -= 1
            assert self._in_flight >= 0, "collective finished more often than started"
            if self._in_flight == 0:
                elapsed = time.perf_counter() - self._flight_start
                self.communicate_s += elapsed
                self.in_flight_total_s += elapsed

    def add_layers(self, key: Hashable, layers: list[dict[str, Any]]) -> None:
        """Attach bucket ``key``'s per-layer exchange (a per-layer plan): one entry per layer, in
        bucket order, with ``codec``, ``numel`` and ``payload_bytes``."""
        with self._lock:
            self._entry(key)["layers"] = [dict(layer) for layer in layers]

    def add_quality(self, key: Hashable, figures: dict[str, float] | None) -> None:
        """Attach quality figures (see :func:`quality_figures`) to bucket ``key``; None is skipped."""
        if figures is None:
            return
        with self._lock:
            self._entry(key)["quality"] = dict(figures)

    def add_figures(self, key: Hashable, **figures: float) -> None:
        """Attach a reducer's own figures to bucket ``key`` (e.g. the count sketch's ``unpeeled``)."""
        with self._lock:
            self._entry(key).update(figures)

    def add_verify(self, key: Hashable, figures: dict[str, float]) -> None:
        """Attach the exactness check of bucket ``key`` (compressed mean against the dense mean)."""
        with self._lock:
            self._entry(key)["verify"] = dict(figures)

    def add_event(self, event: dict[str, Any]) -> None:
        """Record something that happened this step (an auto decision, a trial verdict)."""
        with self._lock:
            self.events.append(dict(event))

    def pop(self, *, labelled: bool = False) -> dict[str, Any]:
        """This step's totals (``payload_bytes``, ``dense_bytes``, ``compression_ratio``,
        ``sent_bytes``, ``received_bytes``, times, bucket counts, ``buckets`` with, on monitored
        steps, ``quality``; ``events``; ``link`` when an adaptive reducer estimates the link),
        then reset.

        Args:
            labelled: key ``buckets`` by each bucket's label (``"params 0-51"``,
                :func:`gradzip.keys.label`) instead of its key (a tuple of the layout and the
                parameters' indices and shapes), so that ``json.dumps`` takes the result.
        """
        if labelled:
            from gradzip.keys import label

            out = self.pop()
            out["buckets"] = {label(key): entry for key, entry in out["buckets"].items()}
            return out
        with self._lock:
            out = {
                "payload_bytes": self.payload_bytes,
                "dense_bytes": self.dense_bytes,
                "compression_ratio": self.dense_bytes / self.payload_bytes if self.payload_bytes else 1.0,
                "compress_s": self.compress_s,
                "decompress_s": self.decompress_s,
                "communicate_s": self.communicate_s,
                "sent_bytes": self.sent_bytes,
                "received_bytes": self.received_bytes,
                "uncompressed_buckets": self.uncompressed_buckets,
                "fused_buckets": self.fused_buckets,
                "buckets": self.buckets,
                "events": self.events,
            }
            if self.link is not None:
                out["link"] = dict(self.link)
            self._reset()
            return out
