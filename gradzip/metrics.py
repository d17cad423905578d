"""Per-step figures collected by reducers and hooks: bytes, times, which collective ran.

Reducers run partly on communication threads (future callbacks), so every update takes a lock.
``communicate_s`` is the wall time during which at least one collective of this rank was in
flight (overlapping collectives are not double counted).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from contextlib import contextmanager
from typing import Any


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
        self.uncompressed_buckets = 0
        self.buckets: dict[Hashable, dict[str, Any]] = {}

    def add_bucket(
        self, key: Hashable, *, payload_bytes: int, dense_bytes: int, collective: str, compressed: bool = True
    ) -> None:
        """Record one bucket's exchange: bytes this rank handed to collectives, and how."""
        with self._lock:
            self.payload_bytes += payload_bytes
            self.dense_bytes += dense_bytes
            if not compressed:
                self.uncompressed_buckets += 1
            entry = self.buckets.setdefault(
                key, {"payload_bytes": 0, "dense_bytes": 0, "collective": collective, "compressed": compressed}
            )
            entry["payload_bytes"] += payload_bytes
            entry["dense_bytes"] += dense_bytes

    @contextmanager
    def timed(self, field: str):
        """Add the wall time of the ``with`` block to ``compress_s`` or ``decompress_s``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                setattr(self, field, getattr(self, field) + elapsed)

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
        """This step's totals (``payload_bytes``, ``dense_bytes``, ``compression_ratio``, times,
        ``buckets``), then reset."""
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
            }
            self._reset()
            return out
