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
        probe_s: seconds of the link probe the previous window sent right after its figure
            all_reduce (its sized all_reduce, the fastest of its rounds, min over ranks; 0 when
            it sent none); ``probe_bytes`` what that sent per rank; ``probe_latency_s`` and
            ``probe_latency_bytes`` the same of its all_reduce of one element. Every rank issues
            the probe together, so it times the link free of the ranks' skew.
        entropy: per sampled step of the window (the controller's ``entropy_every``), the
            entropy of the averaged gradient summed over buckets (identical on every rank).
        met: the window's first exchange followed a figure all_reduce that every rank waited
            for, so the ranks issued it together and its seconds time the link; False after a
            decision taken a step late (``decides_late``), where each rank issued its exchange
            as its own backward pass ended and the seconds hold the ranks' skew.
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
    probe_latency_s: float = 0.0
    probe_latency_bytes: float = 0.0
    probe_s: float = 0.0
    probe_bytes: float = 0.0
    entropy: list[float] = field(default_factory=list)
    met: bool = True

    def exchange_sample(self) -> tuple[float, float, float] | None:
        """``(collectives, sent_bytes, seconds in flight)`` of the whole exchange per step, or
        None when the window saw no collective in flight."""
        collectives = sum(b.collectives for b in self.buckets)
        if collectives <= 0 or self.in_flight_s <= 0:
            return None
        return collectives, sum(b.sent_bytes for b in self.buckets), self.in_flight_s

    def link_samples(self) -> list[tuple[float, float, float]]:
        """``(collectives, sent_bytes, seconds)`` for :class:`gradzip.control.link.LinkEstimator`:
        the link probe's two all_reduces when there was a probe, else the whole exchange per
        step and the figure all_reduce.

        A probe's samples replace the others: the ranks issue the probe together, while each
        issues its exchange when its own buckets are ready, and gloo's collectives take longer
        than the link does when the ranks arrive apart (two hosts at 20 Mbit/s, an all_gather of
        300 kB: 167 ms on the rank that waited least when one rank issued 40 ms late, against
        128 ms issued together); the figure all_reduce is one sample, the probe's the fastest
        of its rounds."""
        if self.probe_s > 0 and self.probe_bytes > 0 and self.probe_latency_s > 0:
            return [(1.0, self.probe_latency_bytes, self.probe_latency_s), (1.0, self.probe_bytes, self.probe_s)]
        exchange = self.exchange_sample()
        rows = [exchange] if exchange is not None else []
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
        meet_next: a controller that decides late (``decides_late``) asks the next decision to
            wait for its figures, so that every rank leaves it together and the link probe it
            asks for (``probe_bytes``) is sent right after.
    """

    choices: dict[Hashable, int]
    window_steps: int
    reasons: dict[Hashable, str] = field(default_factory=dict)
    note: str = ""
    probe_next: bool = True
    quiet: bool = False
    meet_next: bool = False
