"""The link as controllers see it: per-exchange latency and bandwidth, fitted from measured
exchanges whatever codec runs, and following the link both ways as it changes.

Model: an exchange of ``collectives`` collectives that puts ``sent_bytes`` on the wire (per rank,
by the formulas of :mod:`gradzip.comm.traffic`) takes ``latency_s * collectives + sent_bytes /
bytes_per_s`` seconds.

A fit over exchanges that all carry the same payload cannot tell latency from bandwidth: 2 ms
for 100 kB reads the same as a 400 Mbit/s link with no latency or a 1 Gbit/s link with 1.2 ms
per collective, and a wrong split mis-prices every payload of another size (the gentler codec
looks slower than it is, and a controller never goes back to it). :class:`LinkEstimator` keeps
both apart by seeing sizes far apart:

- the auto reducer's own figure exchange (a few hundred bytes, one all_reduce per window) is a
  sample too: it measures the latency almost alone, at no cost, every window;
- the buckets of a step differ in size, and so do the layers' payloads of a per-layer plan.

Samples come in batches (a batch: the samples of one window of steps, one state of the link).
The latency is the least-squares fit of each batch whose sizes spread enough
(:data:`MIN_SPREAD`), averaged over the kept batches; otherwise the last fitted latency is kept,
but never above the time per collective of the newest batch's fastest exchange (no exchange
takes less than its latency).
The bandwidth is then each batch's bytes over its wire seconds given that latency, averaged
geometrically with weights that halve every :attr:`LinkEstimator.half_life` newer batches: it
follows a change of the link up as fast as down, whatever payload the running codec sends.

A strongly compressed exchange can be so small that its time is nearly all latency; its bytes
then say little about the bandwidth (and a recovered link would go unseen). Such a batch
(wire seconds under :data:`MIN_WIRE_SHARE` of its time) counts in proportion to its wire share,
and :meth:`LinkEstimator.probe_bytes` asks for a probe: an all_reduce that every rank issues
right after the window's figure all_reduce, of about eight latencies' worth of bytes at the
current estimate, and at least what the caller names (the controllers name the dense exchange
of their buckets, what the gentlest choice would send), 64 KiB to 8 MiB; it times the bandwidth
at the cost of two rounds of it and three small all_reduces
(:class:`gradzip.control.auto_reducer.AutoReducer`), at most every ``probe_every`` batches (its
seconds are in every ``auto`` event, ``probe_s``). The floor matters after a recovery: sized from
the slow link's estimate alone, a probe takes a small share of a latency on a link that became a
hundred times faster, and the estimate climbs only by a factor per probe; the dense exchange's
bytes on the new link take what the gentlest choice would take, which is what the decision needs
to know. A caller may also ask for a probe every batch (``calibrate``; ``auto`` does): eight
latencies' worth and :data:`CALIBRATION_S` of the link at the estimate, 64 KiB at least. (The
latency comes from an all_reduce of one element, which takes fewer hops than a ring all_reduce of
many bytes: on 4 ranks at 1 Gbit/s a 64 KiB probe took 7.9 ms and read the link as 139 Mbit/s.)
Since the ranks issue a probe together, its batch reads the link free of the ranks' skew, which
an exchange's seconds hold (see
:meth:`gradzip.control.figures.WindowFigures.link_samples`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: the largest over the smallest bytes per collective among weighted samples, above which the
#: fit separates latency from bandwidth
MIN_SPREAD = 8.0
#: a batch whose wire seconds are under this share of its seconds reads the bandwidth poorly
MIN_WIRE_SHARE = 0.25
#: the bounds of a probe's bytes
PROBE_BYTES = (64 << 10, 8 << 20)
#: the least time a calibration probe takes on the link at the estimate
CALIBRATION_S = 0.02
#: an exchange this many times slower than the estimate predicts: the link fell (:func:`probe_after`)
FELL = 4.0


@dataclass
class Link:
    """``seconds = latency_s * collectives + sent_bytes / bytes_per_s``, ``sent_bytes`` what one rank
    sends (:mod:`gradzip.comm.traffic` gives them per route)."""

    latency_s: float
    bytes_per_s: float

    @property
    def mbit(self) -> float:
        """The bandwidth in Mbit/s."""
        return self.bytes_per_s * 8 / 1e6

    def seconds(self, sent_bytes: float, collectives: float) -> float:
        """Predicted seconds of an exchange."""
        return self.latency_s * collectives + sent_bytes / self.bytes_per_s

    def bytes_within(self, seconds: float, collectives: float) -> float:
        """Bytes an exchange of ``collectives`` collectives can send in ``seconds`` (0 if the
        latency alone exceeds it)."""
        return max(0.0, (seconds - self.latency_s * collectives) * self.bytes_per_s)


Sample = tuple[float, float, float]  # (collectives, sent_bytes, seconds)


class LinkEstimator:
    """Latency and bandwidth from recent ``(collectives, sent_bytes, seconds)`` samples.

    Args:
        half_life: batches after which a sample counts half (a number > 0); with ``at`` given to
            :meth:`add`, in the units of ``at`` (steps, say), so batches may come unevenly.
        keep: batches kept (older ones would weigh under ``2 ** (-keep / half_life)``).
        probe_every: the fewest batches from one probe to the next (:meth:`probe_bytes`).

    Raises:
        ValueError: for a ``half_life`` that is not > 0, or a ``keep`` or ``probe_every`` below 1.
    """

    def __init__(self, *, half_life: float = 0.5, keep: int = 8, probe_every: int = 1) -> None:
        if isinstance(half_life, bool) or not isinstance(half_life, (int, float)) or not half_life > 0:
            raise ValueError(f"half_life must be a number > 0; got {half_life!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1; got {keep!r}")
        if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1:
            raise ValueError(f"probe_every must be an integer >= 1; got {probe_every!r}")
        self.half_life = float(half_life)
        self.keep = keep
        self.batches: list[list[Sample]] = []
        self.ats: list[float] = []  # when each batch was taken (its index when not given)
        self.latency_s: float | None = None
        self.link: Link | None = None
        self.last_share = 1.0  # the last batch's wire seconds over its seconds
        self.last_rate: float | None = None  # the last batch's bytes over its wire seconds
        self.probe_every = probe_every
        self.since_probe = probe_every

    def add(self, samples: Iterable[Sample], at: float | None = None) -> Link | None:
        """Add one batch of measured exchanges (rows with no time are skipped) and refit.

        Args:
            samples: ``(collectives, sent_bytes, seconds)`` rows.
            at: when the batch was taken, in the units of ``half_life`` (the step, say), no
                earlier than the last batch's; None: one after the last batch.

        Returns:
            the current estimate (None until some sample moved bytes).
        """
        batch = [(float(n), float(sent), float(seconds)) for n, sent, seconds in samples
                 if seconds > 0 and n > 0 and math.isfinite(seconds) and math.isfinite(n) and 0 <= sent < math.inf]
        if at is None:
            at = self.ats[-1] + 1 if self.ats else 0.0
        assert not self.ats or at >= self.ats[-1], "batches are added in order"
        self.batches = (self.batches + [batch])[-self.keep :]
        self.ats = (self.ats + [float(at)])[-self.keep :]
        self._refit()
        return self.link

    def _refit(self) -> None:
        last = self.ats[-1] if self.ats else 0.0
        weights = [0.5 ** ((last - at) / self.half_life) for at in self.ats]
        # Latency: each batch whose sizes spread enough is fitted on its own (a batch saw one
        # state of the link), and the fits are averaged with the recency weights.
        fitted = [(fit(batch), w) for batch, w in zip(self.batches, weights)]
        fitted = [(f.latency_s, w) for f, w in fitted if f is not None]
        if fitted:
            self.latency_s = sum(lat * w for lat, w in fitted) / sum(w for _, w in fitted)
        # No exchange takes less than its latency: a kept latency above what the newest batch's
        # fastest collective took (fitted on a slow, queued link, say) would leave every newer
        # sample no wire time, and the estimate would stay where the link was, never probed up.
        newest = [s / n for n, _, s in self.batches[-1]] if self.batches else []
        if self.latency_s is not None and newest:
            self.latency_s = min(self.latency_s, min(newest))
        latency = self.latency_s or 0.0
        # Bandwidth: each batch's rate given the latency (its bytes over its wire seconds), then
        # a recency-weighted geometric mean, so that a fall and a rise by the same factor move
        # the estimate equally fast.
        logs = []
        self.last_share = 0.0
        self.last_rate = None
        for batch, w in zip(self.batches, weights):
            sent = sum(b for _, b, _ in batch)
            wire_s = sum(max(0.0, s - latency * n) for n, b, s in batch if b > 0)
            share = wire_s / max(sum(s for _, b, s in batch if b > 0), 1e-12)
            self.last_share = share
            self.last_rate = sent / wire_s if sent > 0 and wire_s > 0 else None
            if sent > 0 and wire_s > 0:
                logs.append((math.log(sent / wire_s), w * min(1.0, share / MIN_WIRE_SHARE)))
        if logs:
            rate = math.exp(sum(x * w for x, w in logs) / sum(w for _, w in logs))
            self.link = Link(latency, rate)

    def probe_bytes(self, at_least: float = 0.0, *, share: float | None = None, calibrate: bool = False) -> int:
        """Bytes of the next link probe. Call once per batch.

        Args:
            at_least: the floor of a recovery probe (the controllers name their dense exchange).
            share: the running exchange's wire seconds over its seconds (None: the last batch's).
            calibrate: probe every batch, not only the batches whose exchange was mostly latency.

        Returns:
            0 when no probe was asked for in the last ``probe_every`` batches or there is no
            estimate yet; else, when ``share`` is under :data:`MIN_WIRE_SHARE` (a recovery
            probe), about eight latencies' worth at the current estimate and at least
            ``at_least``; else, with ``calibrate``, eight latencies' worth and at least
            :data:`CALIBRATION_S` at the estimate; else 0. Within :data:`PROBE_BYTES`.
        """
        self.since_probe += 1
        share = self.last_share if share is None else share
        if self.link is None or self.since_probe < self.probe_every or not (share < MIN_WIRE_SHARE or calibrate):
            return 0
        self.since_probe = 0
        low, high = PROBE_BYTES
        eight = 8 * self.link.latency_s * self.link.bytes_per_s
        if share < MIN_WIRE_SHARE:
            return int(min(high, max(low, eight, at_least)))
        return int(min(high, max(low, eight, CALIBRATION_S * self.link.bytes_per_s)))

    def state_dict(self) -> dict[str, Any]:
        return {"batches": [[list(s) for s in b] for b in self.batches], "ats": list(self.ats), "latency_s": self.latency_s,
                "last_share": self.last_share, "since_probe": self.since_probe,
                "link": None if self.link is None else [self.link.latency_s, self.link.bytes_per_s]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = [[tuple(s) for s in b] for b in state["batches"]][-self.keep :]
        # a state saved before ``ats``: its batches were one apart
        ats = state.get("ats", list(range(len(state["batches"]))))
        self.ats = [float(a) for a in ats][-self.keep :]
        self.latency_s, self.last_share = state["latency_s"], state["last_share"]
        self.since_probe = state["since_probe"]
        self.link = None if state["link"] is None else Link(*state["link"])


def fit(rows: Sequence[Sample], weights: Sequence[float] | None = None) -> Link | None:
    """Weighted least squares of ``seconds = latency * collectives + sent_bytes / bandwidth``.

    Returns:
        the fit, or None when the samples' bytes per collective do not spread by
        :data:`MIN_SPREAD` (latency and bandwidth cannot be told apart), when the system is
        singular, or when the fit is not physical (negative latency or bandwidth).
    """
    weights = [1.0] * len(rows) if weights is None else list(weights)
    sizes = [sent / n for n, sent, _ in rows if n > 0]
    if len(rows) < 2 or not sizes or max(sizes) < MIN_SPREAD * max(min(sizes), 1.0):
        return None
    # Relative errors matter, not absolute ones: a 1 ms latency sample must count as much as a
    # 2 s transfer, so each row is divided by its own seconds.
    s11 = s12 = s22 = s1y = s2y = 0.0
    for (n, sent, seconds), w in zip(rows, weights):
        a, b, w = n / seconds, sent / seconds, w
        s11 += w * a * a
        s12 += w * a * b
        s22 += w * b * b
        s1y += w * a
        s2y += w * b
    det = s11 * s22 - s12 * s12
    if not det > 1e-12 * s11 * s22:
        return None
    latency = (s22 * s1y - s12 * s2y) / det
    inv_bw = (s11 * s2y - s12 * s1y) / det
    if latency < 0 or inv_bw <= 0:
        return None
    return Link(latency, 1.0 / inv_bw)


def probe_after(link: Link | None, exchange: Sample | None, asked: int) -> int:
    """The probe to send now, ``asked`` bytes sized from ``link`` at the last decision, unless
    ``exchange`` (``(collectives, sent_bytes, seconds)`` of the exchange since) took more than
    :data:`FELL` times what ``link`` predicts for it: the link fell since, and the probe is sized
    at the rate the exchange moved its bytes (eight latencies' worth, at least 64 KiB), where
    sized from the old estimate it would take what a dense exchange takes on the slow link. A
    function of figures that are the same on every rank."""
    if asked <= 0 or link is None or exchange is None:
        return asked
    collectives, sent, seconds = exchange
    if sent <= 0 or seconds <= FELL * link.seconds(sent, collectives):
        return asked
    return int(min(asked, max(PROBE_BYTES[0], 8 * link.latency_s * sent / seconds)))

