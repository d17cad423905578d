"""``--compressor edgc``: EDGC, PowerSGD's rank from the trend of the gradient's entropy.

EDGC (Yi et al., "EDGC: Entropy-driven Dynamic Gradient Compression for Efficient LLM Training",
arXiv 2511.10333; code github.com/xiaoao-666/EDGC) compresses with PowerSGD and moves its rank
with the gradient's entropy. As the reference code does it, in four parts:

1. **Entropy, down-sampled.** Every ``sample_every`` steps (its iteration sampling rate 0.1),
   the entropy of the averaged gradient is estimated from every ``stride``-th element (its
   gradient sampling rate 0.25) in a ``bins``-bin histogram (1000) between the sample's min and
   max, in nats, summed over the buckets (:func:`entropy`).
2. **The largest useful rank, probed by timing.** The exchange is timed dense for
   ``probe_steps`` steps, then at rank 2, 4, 8, ... for ``probe_steps`` steps each (the first
   step of each left out, the others averaged), until a rank's exchange is slower than dense;
   ``r_max`` is the rank at which the measured rank-time line reaches the dense time, rounded
   down to a multiple of 4 (linear interpolation of the probed ranks, as ``time_predict_rank``).
3. **Warm-up.** Training stays dense until both ``warmup_steps`` (by default ``warmup_fraction``
   = 10% of ``total_steps``, its ``grad_comp_warm_up``) have passed and the low-rank error has
   settled: every ``window`` steps the error of the rank-``r_max/4`` approximation of the current
   gradient is compared with that of the rank-``r_max`` approximation measured right after the
   probe, and the warm-up may end once the first is the smaller.
4. **The windowed controller.** Compression starts at ``r_max``; then every ``window`` steps
   (1000) the change of the mean entropy between the last two windows, divided by the change
   between the first two windows of the run, maps linearly onto ``[r_max/4, r_max]``, rounded to
   an even rank; the rank moves at most ``rank_step`` (4) per window, and the first move from
   ``r_max`` at most that far too (``map_entropy_change_to_rank``).

Reproduced: all four parts with the reference code's constants as defaults. Different: the
probe times the whole exchange of a step (encoding, collectives in flight, decoding; max over
ranks) where the code times the all_reduce call with a barrier; the low-rank errors are L2
norms of one power iteration from a seeded ``Q`` on each matrix (the code takes an L1 sum over the
flat buffer); the error and entropy figures are all-reduced so every rank decides alike, where
the code has rank 0 decide and broadcasts; the rank is one for the whole model (the paper adjusts
it per pipeline stage; DDP has one stage). If even rank 2 is slower than dense, or the probe
reaches the largest rank that still compresses, ``r_max`` is that rank rounded down to a multiple
of 4, at least 4. Set ``max_rank`` to skip the probe.

Spec: ``edgc[:max_rank=0,window=1000,sample_every=10,stride=4,bins=1000,rank_step=4,
warmup_steps=N,warmup_fraction=0.1,total_steps=N,probe_steps=3]``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradzip.compressors.lowrank import matrix_view_shape
from gradzip.compressors.values import check_number
from gradzip.control.figures import Plan, WindowFigures
from gradzip.control.layers import Ladder, LayerSchedule, settings_from

NAME = "edgc"


@dataclass
class EDGCConfig:
    """Settings of ``--compressor edgc`` (see the module docstring)."""

    max_rank: int = 0
    """``r_max``; 0 probes it by timing the exchange."""

    window: int = 1000
    """Steps per window of the controller (and between warm-up error checks)."""

    sample_every: int = 10
    """Steps between entropy samples."""

    stride: int = 4
    """Every this many elements of a gradient enter the entropy's sample."""

    bins: int = 1000
    """Histogram bins of the entropy estimate."""

    rank_step: int = 4
    """The most ranks the controller moves per window."""

    warmup_steps: int | None = None
    """Dense steps at least; None: ``warmup_fraction`` of ``total_steps`` (0 without it)."""

    warmup_fraction: float = 0.1
    """The warm-up's share of the run when ``warmup_steps`` is not given."""

    total_steps: int | None = None
    """The run's steps (``gradzip train`` fills it in from ``--steps``)."""

    probe_steps: int = 3
    """Steps per probed rank; the first of each is left out of its time."""

    def validate(self) -> EDGCConfig:
        # a window of the per-layer exchange holds at least 3 steps (LayerSchedule.min_window_steps)
        for name, low in (("max_rank", 0), ("window", 3), ("sample_every", 1), ("stride", 1), ("bins", 2),
                          ("rank_step", 2), ("probe_steps", 3)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
        if self.max_rank and self.max_rank < 4:
            raise ValueError(f"max_rank must be 0 (probe it) or an integer >= 4; got {self.max_rank!r}")
        if self.window < 2 * self.sample_every:
            raise ValueError(f"window must hold at least two entropy samples (2 x sample_every); got {self.window}")
        for name in ("warmup_steps", "total_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}")
        check_number(self.warmup_fraction, name="warmup_fraction", low=0, high=1)
        return self

    @property
    def warmup(self) -> int:
        """The warm-up's least length in steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return int(self.total_steps * self.warmup_fraction) if self.total_steps else 0


def entropy(x: Tensor, *, stride: int = 4, bins: int = 1000) -> float:
    """EDGC's down-sampled entropy of ``x`` in nats: every ``stride``-th finite element, a
    ``bins``-bin histogram between their min and max (0 for fewer than two distinct values)."""
    flat = x.reshape(-1)
    flat = flat[torch.isfinite(flat)]
    sample = flat[::stride].float()
    if sample.numel() < 2:
        return 0.0
    low, high = float(sample.min()), float(sample.max())
    if high <= low:
        return 0.0
    hist = torch.histc(sample, bins=bins, min=low, max=high)
    p = hist[hist > 0] / hist.sum()
    return float(-(p * p.log()).sum())


class EDGCController(LayerSchedule):
    """EDGC (see the module docstring)."""

    name = NAME

    def __init__(self, cfg: EDGCConfig) -> None:
        self.cfg = cfg.validate()
        self.entropy_every = cfg.sample_every
        self.ladder = Ladder("powersgd")
        self.phase = "probe" if cfg.max_rank == 0 else "warmup"
        self.max_rank = cfg.max_rank
        self.times: dict[int, float] = {}  # rank (0: dense) -> seconds of a step's exchange
        self.probing: int | None = None  # the rank under test; None: the dense baseline
        self.max_error: float | None = None  # rank-r_max error right after the probe
        self.settled_at: int | None = None  # the step the warm-up's error test passed
        self.rank: int | None = None  # the running rank once compressing
        self.ranks: list[int] = []  # every rank the controller mapped, as the code's Utils.mapped_rank
        self.series: list[float] = []  # every entropy sample of the run
        self.shapes: dict[Hashable, list[torch.Size]] = {}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> EDGCController:
        return cls(settings_from(EDGCConfig, params, schedule=NAME))

    def entropy(self, averaged: Tensor) -> float:
        return entropy(averaged, stride=self.cfg.stride, bins=self.cfg.bins)

    # -- plans ---------------------------------------------------------------------------------

    def running_rank(self) -> int | None:
        """The rank every matrix takes now; None: dense."""
        if self.phase == "probe":
            return self.probing
        return self.rank if self.phase == "compress" else None

    def layer_plan(self, key: Hashable, shapes: Sequence[torch.Size], dtype: torch.dtype, step: int) -> tuple[str, ...]:
        self.shapes[key] = [torch.Size(s) for s in shapes]
        rank = self.running_rank()
        return tuple(self.ladder.spec(rank, s, dtype) for s in self.shapes[key])

    def probe_specs(self, key: Hashable, shapes: Sequence[torch.Size]) -> list[list[str]]:
        if self.phase != "warmup" or not self.max_rank:
            return [[] for _ in shapes]
        rank = self.max_rank if self.max_error is None else self.max_rank // 4
        return [[self.ladder.build(rank).spec] if matrix_view_shape(s) is not None else [] for s in shapes]

    def largest_compressing_rank(self) -> int:
        """The largest rank at which some matrix of the model still compresses."""
        best = 1
        for shapes in self.shapes.values():
            for s in shapes:
                view = matrix_view_shape(s)
                if view is not None:
                    n, m = view
                    best = max(best, (n * m - 1) // (n + m))
        return best

    # -- decisions -----------------------------------------------------------------------------

    def decide(self, window: WindowFigures) -> Plan:
        self.series.extend(window.entropy)
        if self.phase == "probe":
            return self._probe(window)
        if self.phase == "warmup":
            return self._warmup(window)
        return self._compress(window)

    def _probe(self, window: WindowFigures) -> Plan:
        seconds = window.exchange_s
        if self.probing is None:
            self.times[0] = seconds
            self.probing = 2
            return Plan({}, self.cfg.probe_steps, {}, f"edgc probe: dense exchange {seconds * 1e3:.1f} ms", False)
        self.times[self.probing] = seconds
        note = f"edgc probe: rank {self.probing} exchange {seconds * 1e3:.1f} ms against dense {self.times[0] * 1e3:.1f} ms"
        cap = self.largest_compressing_rank()
        if seconds <= self.times[0] and self.probing * 2 <= cap:
            self.probing *= 2
            return Plan({}, self.cfg.probe_steps, {}, note, False)
        self.max_rank = predict_rank(self.times, self.times[0], cap)
        self.phase = "warmup"
        self.probing = None
        # The rank-r_max error is measured at once (the code's max_rank_error), on a short window.
        return Plan({}, self.cfg.probe_steps, {}, f"{note}; r_max = {self.max_rank}", True)

    def _warmup(self, window: WindowFigures) -> Plan:
        errors = [e for b in window.buckets for layer in (b.layers or []) for e in layer.errors]
        note = "edgc warm-up"
        if errors and self.max_error is None:
            self.max_error = math.sqrt(sum(errors))
            note += f": rank-{self.max_rank} error {self.max_error:.4g}"
        elif errors and self.settled_at is None:
            error = math.sqrt(sum(errors))
            note += f": rank-{self.max_rank // 4} error {error:.4g} against {self.max_error:.4g}"
            if error < self.max_error:
                self.settled_at = window.end
        if self.settled_at is not None and window.end >= self.cfg.warmup:
            self.phase, self.rank = "compress", self.max_rank
            self.ranks.append(self.rank)
            return Plan({}, self.cfg.window, {}, f"{note}; compressing at rank {self.rank}", False)
        if self.settled_at is not None:
            return Plan({}, max(1, self.cfg.warmup - window.end), {}, f"{note}; dense until step {self.cfg.warmup}", False)
        return Plan({}, self.cfg.window, {}, note, True)

    def _compress(self, window: WindowFigures) -> Plan:
        before = self.rank
        self.rank = map_entropy_change_to_rank(
            self.series, self.ranks, min_rank=self.max_rank // 4, max_rank=self.max_rank,
            samples_per_window=self.cfg.window // self.cfg.sample_every, step=self.cfg.rank_step,
        )
        note = f"edgc: rank {before} -> {self.rank}" if self.rank != before else f"edgc: rank stays {self.rank}"
        return Plan({}, self.cfg.window, {}, note, False)

    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "max_rank": self.max_rank, "times": dict(self.times), "probing": self.probing,
                "max_error": self.max_error, "settled_at": self.settled_at, "rank": self.rank,
                "ranks": list(self.ranks), "series": list(self.series)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phase, self.max_rank, self.probing = state["phase"], state["max_rank"], state["probing"]
        self.times = {int(k): v for k, v in state["times"].items()}
        self.max_error, self.settled_at, self.rank = state["max_error"], state["settled_at"], state["rank"]
        self.ranks, self.series = list(state["ranks"]), list(state["series"])


def predict_rank(times: dict[int, float], dense_s: float, cap: int) -> int:
    """The rank at which the probed rank-time line reaches ``dense_s``, rounded down to a
    multiple of 4 (at least 4, at most ``cap`` rounded down): linear interpolation between the
    probed ranks, extrapolated past them, as the reference code's ``time_predict_rank``."""
    points = sorted((r, t) for r, t in times.items() if r > 0)
    if len(points) >= 2:
        # the segment that crosses dense_s, or the last one extrapolated
        (r0, t0), (r1, t1) = points[-2], points[-1]
        for a, b in zip(points, points[1:]):
            if (a[1] - dense_s) * (b[1] - dense_s) <= 0:
                (r0, t0), (r1, t1) = a, b
                break
        rank = r0 + (dense_s - t0) * (r1 - r0) / (t1 - t0) if t1 != t0 else r1
    else:
        rank = points[0][0] if points else cap
    rank = min(rank, cap)
    return max(4, int(rank // 4) * 4)


def map_entropy_change_to_rank(
    series: Sequence[float], ranks: list[int], *, min_rank: int, max_rank: int, samples_per_window: int, step: int
) -> int:
    """EDGC's ``map_entropy_change_to_rank``: the next rank from the entropy series, appended to
    ``ranks`` (the ranks so far, first one ``max_rank``).

    With fewer than two windows of samples the rank is ``max_rank``. Otherwise the change of the
    mean entropy between the last two windows, over the change between the run's first two
    windows, maps linearly onto ``[min_rank, max_rank]``, is rounded, clamped and made even (but
    not below ``min_rank``, which the code's rounding could cross when it is odd); it moves at
    most ``step`` from the previous rank (the first mapping: from ``max_rank``).
    """
    n = samples_per_window
    if len(series) < 2 * n:
        ranks.append(max_rank)
        return max_rank
    curr = sum(series[-n:]) / n
    prev = sum(series[-2 * n : -n]) / n
    change = abs(curr - prev)
    largest = abs(sum(series[:n]) / n - sum(series[n : 2 * n]) / n)
    if largest > 0:
        norm = change / largest
    else:  # the code would divide by zero; no change at the start maps any change to the top
        norm = 0.0 if change == 0 else 1.0
    mapped = round(min_rank + (max_rank - min_rank) * norm)
    mapped = max(min_rank, min(mapped, max_rank))
    mapped = max((mapped // 2) * 2, min_rank)  # even, as the code rounds; never under min_rank (it can be 1)
    previous = ranks[-1] if ranks else None
    if previous is None:
        final = mapped if max_rank - mapped <= step else max_rank - step
    elif abs(mapped - previous) > step:
        final = previous + step if mapped > previous else previous - step
    else:
        final = mapped
    ranks.append(final)
    return final

