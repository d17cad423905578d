"""A link whose rate changes at given steps of a run: the emulated cluster's ``tbf`` rate set
anew as the run's ``metrics.jsonl`` reaches each step.

A schedule is ``STEP:RATE`` pairs, ``40:20mbit,80:1gbit``: the rate becomes ``20mbit`` once step
39 is recorded (so from about step 40 on), then ``1gbit`` once step 79 is. The steps are read
from the file rank 0 of ``gradzip train`` appends a line to after every step, polled every
``poll_s`` seconds from a thread of the process that owns the cluster, so a change lands during
step ``STEP``, or a step later when that step is shorter than a poll and the ``tc`` calls. Each
change records the last step recorded before it began and after it ended
(:attr:`LinkSchedule.applied`): the step that first saw the new rate lies between them, one step
after each.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gradzip.lab.cluster.netns import Cluster, format_bandwidth, parse_bandwidth
from gradzip.lab.train.tail import MetricsTail


@dataclass(frozen=True)
class RateChange:
    """The link rate ``bits_per_s`` from step ``step`` on."""

    step: int
    bits_per_s: int


@dataclass(frozen=True)
class Applied:
    """A change as it happened: the last step recorded before it began and after it ended."""

    change: RateChange
    recorded_before: int
    recorded_after: int
    seconds: float  # since the schedule started

    @property
    def first_step(self) -> int:
        """The earliest step that can have run at the new rate."""
        return self.recorded_before + 1


def parse_link_schedule(text: str, *, name: str = "--link-schedule") -> list[RateChange]:
    """``"40:20mbit,80:1gbit"`` -> the changes, steps strictly increasing.

    Raises:
        ValueError: naming ``name`` for a malformed pair, a step below 1, a bad rate (see
            :func:`~gradzip.lab.cluster.netns.parse_bandwidth`) or steps not increasing.
    """
    changes: list[RateChange] = []
    for part in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+)\s*:\s*(\S+)\s*", part, re.ASCII)
        if not match:
            raise ValueError(f"{name} must be STEP:RATE pairs separated by commas, e.g. 40:20mbit,80:1gbit; got {text!r}")
        step = int(match.group(1))
        try:
            bits = parse_bandwidth(match.group(2))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if step < 1:
            raise ValueError(f"{name}: steps must be >= 1 (step 0 runs at the cluster's rate); got {step}")
        if changes and step <= changes[-1].step:
            raise ValueError(f"{name}: steps must increase; got {step} after {changes[-1].step}")
        changes.append(RateChange(step, bits))
    return changes


def format_link_schedule(changes: list[RateChange]) -> str:
    """The text :func:`parse_link_schedule` reads back."""
    return ",".join(f"{c.step}:{format_bandwidth(c.bits_per_s)}" for c in changes)


class LinkSchedule:
    """Sets ``cluster``'s link rate as the run writing ``metrics`` reaches each change's step.

    Use as a context manager around the run (the thread stops on exit)::

        with LinkSchedule(cluster, parse_link_schedule("40:20mbit,80:1gbit"), out / "metrics.jsonl") as sched:
            launch_run(...)
        sched.applied  # what changed, and when

    Args:
        cluster: a running :class:`~gradzip.lab.cluster.netns.Cluster`.
        changes: from :func:`parse_link_schedule`.
        metrics: rank 0's ``metrics.jsonl`` (it may not exist yet).
        poll_s: seconds between reads of the file.
    """

    def __init__(self, cluster: Cluster, changes: list[RateChange], metrics: str | Path, *, poll_s: float = 0.02) -> None:
        self.cluster = cluster
        self.changes = list(changes)
        self.metrics = Path(metrics)
        self.poll_s = poll_s
        self.applied: list[Applied] = []
        self.error: BaseException | None = None
        self._last_step = -1
        self._tail = MetricsTail(self.metrics)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-schedule", daemon=True)
        self._start = 0.0

    def __enter__(self) -> LinkSchedule:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def last_step(self) -> int:
        """The last step recorded in ``metrics`` (-1 before the first), read now."""
        for record in self._tail.read():
            step = record.get("step")
            if isinstance(step, int):
                self._last_step = max(self._last_step, step)
        return self._last_step

    def _run(self) -> None:
        pending = list(self.changes)
        try:
            while pending and not self._stop.is_set():
                before = self.last_step()
                if before >= pending[0].step - 1:
                    change = pending.pop(0)
                    self.cluster.set_bandwidth(change.bits_per_s)
                    self.applied.append(Applied(change, before, self.last_step(), time.monotonic() - self._start))
                    continue
                self._stop.wait(self.poll_s)
        except BaseException as exc:  # reported to the owner, who reads .error after the run
            self.error = exc
