"""Per-step figures collected by reducers and hooks: bytes, times, which collective ran.

Reducers run partly on communication threads (future callbacks), so every update takes a lock.
``communicate_s`` is the wall time during which at least one collective of this rank was in
flight (overlapping collectives are not double counted).

Per bucket (``buckets[key]``): the route it took (``collective``: ``allreduce``, ``allgather``,
``twophase``, ``dense`` or ``fused``), whether it was compressed, ``payload_bytes`` (the codec's
payload of the bucket), ``sent_bytes`` and ``received_bytes`` (what this rank moves over the
wire by the formulas of :mod:`gradzip.comm.traffic`), and ``compress_s``, ``communicate_s``
(launch to completion of each of its collectives, summed) and ``decompress_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from contextlib import contextmanager
from typing import Any

from torch.futures import Future


class StepMetrics:
    """Accumulates one step's figures; :meth:`pop` returns them and starts the next step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._flight_start = 0.0
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

    def _entry(self, key: Hashable) -> dict[str, Any]:
        return self.buckets.setdefault(
            key,
            {
                "collective": None, "compressed": False, "payload_bytes": 0, "dense_bytes": 0,
                "sent_bytes": 0, "received_bytes": 0, "compress_s": 0.0, "communicate_s": 0.0,
                "decompress_s": 0.0,
            },
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

    def track(self, fut: Future, keys: tuple[Hashable, ...] = ()) -> Future:
        """Count a just-issued collective as in flight until ``fut`` completes; its duration is
        added to the ``communicate_s`` of each bucket in ``keys``. Returns ``fut``."""
        self.collective_started()
        start = time.perf_counter()

        def done(_fut: Future) -> None:
            elapsed = time.perf_counter() - start
            with self._lock:
                for key in keys:
                    self._entry(key)["communicate_s"] += elapsed
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
                self.communicate_s += time.perf_counter() - self._flight_start

    def pop(self) -> dict[str, Any]:
        """This step's totals (``payload_bytes``, ``dense_bytes``, ``compression_ratio``,
        ``sent_bytes``, ``received_bytes``, times, bucket counts, ``buckets``), then reset."""
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
            }
            self._reset()
            return out
