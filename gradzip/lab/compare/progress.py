"""What ``gradzip compare`` shows while an entry trains: its step, loss and validation loss,
read from the entry's ``metrics.jsonl`` as rank 0 appends to it (the workers themselves run
``--quiet``)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from gradzip.lab.train.tail import MetricsTail


def status_line(label: str, steps: int, record: dict[str, Any] | None, val_loss: float | None, elapsed_s: float) -> str:
    """``label  step 40/100  loss 5.8123  val 5.9011  (52 s)``; before the first step,
    ``label  starting  (12 s)``."""
    if record is None:
        return f"{label}  starting  ({elapsed_s:.0f} s)"
    parts = [label, f"step {record['step'] + 1}/{steps}"]
    if isinstance(record.get("loss"), (int, float)):
        parts.append(f"loss {record['loss']:.4f}")
    if val_loss is not None:
        parts.append(f"val {val_loss:.4f}")
    parts.append(f"({elapsed_s:.0f} s)")
    return "  ".join(parts)


class EntryProgress:
    """A thread that follows one entry's ``metrics.jsonl`` while it trains.

    On a terminal the status line is rewritten in place every ``poll_s`` seconds; elsewhere (a
    log file) it is printed as a new line every ``every_s`` seconds, so a log shows the run's
    pace without one line per step. The line is cleared on exit, where the caller prints the
    entry's result.

    Args:
        metrics: the entry's ``metrics.jsonl`` (it may not exist yet).
        label: the entry's name.
        steps: the run's steps.
        stream: where the line goes (standard error by default).
        poll_s: seconds between reads of the file.
        every_s: seconds between lines when ``stream`` is not a terminal.
        clock: the time source (tests pass their own).
    """

    def __init__(self, metrics: str | Path, label: str, steps: int, *, stream: TextIO | None = None,
                 poll_s: float = 1.0, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.tail = MetricsTail(metrics)
        self.label, self.steps = label, steps
        self.stream = stream if stream is not None else sys.stderr
        self.poll_s, self.every_s, self.clock = poll_s, every_s, clock
        self.record: dict[str, Any] | None = None
        self.val_loss: float | None = None
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="compare-progress", daemon=True)
        self._start = self._last_line = 0.0

    def __enter__(self) -> EntryProgress:
        self._start = self._last_line = self.clock()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._tty:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def update(self) -> str:
        """Read what the run appended; returns the status line."""
        for record in self.tail.read():
            if isinstance(record.get("step"), int):
                self.record = record
                if isinstance(record.get("val_loss"), (int, float)):
                    self.val_loss = float(record["val_loss"])
        return status_line(self.label, self.steps, self.record, self.val_loss, self.clock() - self._start)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            line = self.update()
            if self._tty:
                self.stream.write("\r\033[K" + line)
                self.stream.flush()
            elif self.clock() - self._last_line >= self.every_s:
                self._last_line = self.clock()
                print(line, file=self.stream, flush=True)
