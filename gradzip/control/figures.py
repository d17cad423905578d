"""What an auto controller sees and answers: per-candidate probe figures, per-layer probe
figures, per-bucket and per-window figures (identical on every rank: the auto reducer
all-reduces them before a controller reads them) and the controller's :class:`Plan`."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch


@dataclass
class CandidateFigures:
    """One candidate codec priced on one bucket by a local probe (no collective).

    Attributes:
        spec: the codec spec.
        compress_s: seconds to encode the bucket (max over ranks).
        decompress_s: seconds to decode what arrives (every rank's payload for gathered codecs).
        payload_bytes: the codec's payload of the bucket.
        sent_bytes: bytes this rank sends for the bucket by the route it would take.
        collectives: collectives per step (PowerSGD and the two-phase route: 2).
        relative_error: ``||g - D(C(g))|| / ||g||`` of one step's gradient, no error feedback
            (max over ranks); 0 for dense.
    """

    spec: str
    compress_s: float
    decompress_s: float
    payload_bytes: float
    sent_bytes: float
    collectives: float
    relative_error: float


@dataclass
class LayerFigures:
    """One layer of a bucket priced by a local probe under a per-layer schedule.

    Attributes:
        shape: the layer's gradient shape.
        errors: ``||x - D(C(x))||^2`` per probed spec (the controller's list for this layer, in
            order), ``x`` the layer's gradient plus the residual it carries (the tensor its codec
            is handed), max over ranks; empty when this window did not probe.
        norm_sq: ``||x||^2`` (max over ranks).
    """

    shape: torch.Size
    errors: list[float]
    norm_sq: float


@dataclass
class BucketFigures:
    """One bucket over a window.

    Attributes:
        key: the bucket's key (its index).
        numel: elements in the bucket.
        itemsize: bytes per element of the gradient.
        current: index of the candidate the bucket used in the window.
        payload_bytes: the codec's payload per step in the window.
        sent_bytes: bytes this rank sent per step in the window.
        communicate_s: seconds per step from launch to completion of its collectives (min over
            ranks: the last rank to arrive waits least, so its figure is closest to the transfer).
        collectives: collectives per step.
        gradient_sum_norm: norm of the bucket's gradient summed over the window (max over ranks).
        running_error: the running codec's relative error ``||x - D(C(x))|| / ||x||`` on the
            window's last step, ``x`` the tensor it was handed (gradient plus residual), read
            from the residual it left (the figure the monitor logs), max over ranks; 0 for
            dense, or where the controller does not ask for it.
        candidates: probe figures per candidate (same order as the reducer's candidates), or
            None when this window did not probe.
        layers: per-layer figures under a per-layer schedule (None otherwise).
    """

    key: Hashable
    numel: int
    itemsize: int
    current: int
    payload_bytes: float
    sent_bytes: float
    communicate_s: float
    collectives: float
    gradient_sum_norm: float
    running_error: float = 0.0
    candidates: list[CandidateFigures] | None = None
    layers: list[LayerFigures] | None = None


@dataclass
class WindowFigures:
    """Everything a controller sees at the end of a window of steps ``[start, end)``.

    Attributes:
        start, end: the window's steps.
        world_size: ranks in the group.
        period_s: median seconds from one step's first bucket to the next step's (max over
            ranks), over the window's steps less its first (a switch) and last (the probe); a
            window of one step: that step, unless it probes (0 then).
        buckets: per-bucket figures, in hook order.
        in_flight_s: wall seconds with some collective of the hook in flight in the window's
            least-disturbed step (the fewest of its steps less its first; a window of one step:
            that step), min over ranks (the last rank to arrive waits least): a rank descheduled
            while its collective is in flight only adds to a step's seconds.
        exchange_s: seconds per step of the whole exchange, encoding, collectives in flight and
            decoding (max over ranks), over the window's steps less its first (a window of one
            step: that step).
        figures_s: seconds of the previous window's figure all_reduce (min over ranks), 0 for
            the first window; ``figures_bytes`` what it sent per rank. A sample of the link's
            latency at almost no bytes.
        entropy: per sampled step of the window (the controller's ``entropy_every``), the
            entropy of the averaged gradient summed over buckets (identical on every rank).
    """

    start: int
    end: int
    world_size: int
    period_s: float
    buckets: list[BucketFigures] = field(default_factory=list)
    in_flight_s: float = 0.0
    exchange_s: float = 0.0
    figures_s: float = 0.0
    figures_bytes: float = 0.0
    entropy: list[float] = field(default_factory=list)

    def link_samples(self) -> list[tuple[float, float, float]]:
        """``(collectives, sent_bytes, seconds)`` per step of the whole exchange, and of the
        figure all_reduce, for :class:`gradzip.control.link.LinkEstimator`."""
        rows = []
        collectives = sum(b.collectives for b in self.buckets)
        sent = sum(b.sent_bytes for b in self.buckets)
        if collectives > 0 and self.in_flight_s > 0:
            rows.append((collectives, sent, self.in_flight_s))
        if self.figures_s > 0:
            rows.append((1.0, self.figures_bytes, self.figures_s))
        return rows


@dataclass
class Plan:
    """A controller's answer: the candidate of each bucket for the next window.

    Attributes:
        choices: candidate index per bucket key.
        window_steps: length of the next window in steps.
        reasons: a sentence per bucket whose choice changed or was examined.
        note: a sentence about the whole decision (a trial started, accepted or rejected).
        probe_next: whether the next window should probe candidates at its last step.
        quiet: nothing changed worth an ``auto`` event (a per-step schedule keeping its plan).
    """

    choices: dict[Hashable, int]
    window_steps: int
    reasons: dict[Hashable, str] = field(default_factory=dict)
    note: str = ""
    probe_next: bool = True
    quiet: bool = False
