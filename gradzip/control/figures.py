"""What an auto controller sees and answers: per-candidate probe figures, per-bucket and
per-window figures (identical on every rank: the auto reducer all-reduces them before a
controller reads them), the controller's :class:`Plan`, and the sampled gradient entropy."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor


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
        entropy: normalised Shannon entropy in [0, 1] of a sample of the last gradient (max over ranks).
        candidates: probe figures per candidate (same order as the reducer's candidates), or
            None when this window did not probe.
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
