"""``--compressor auto``: which codec each bucket uses, re-decided every ``adapt_every`` steps.

Controllers read :class:`~gradzip.metrics.WindowFigures` (figures over a window of steps,
all-reduced so that every rank sees the same numbers) and return a
:class:`~gradzip.metrics.Plan`. They are deterministic functions of what they have seen, so every
rank reaches the same decisions. :class:`~gradzip.control.auto_reducer.AutoReducer` carries them out.

Schedules (``--auto-schedule``):

- ``cost`` (default): bandwidth-aware. Estimates the link's latency and bandwidth from a link
  probe sent at every decision, right after the window's figure all_reduce, so that the ranks
  issue it together (:class:`~gradzip.control.auto_reducer.AutoReducer`,
  :class:`~gradzip.control.link.LinkEstimator`: right whatever codec runs, following the link
  up as fast as down; the window's exchange times the link too slow when the ranks issue it
  apart), prices every candidate on every bucket from a local probe (encode and
  decode seconds, bytes it would send), keeps the candidates whose relative error
  ``||x - D(C(x))|| / ||x||`` is within ``max_error``, and picks the cheapest, dense unless a
  codec saves at least ``min_gain`` of the dense cost. A candidate's encode and decode seconds
  are the least of its last :data:`PROBE_MEMORY` probes on the bucket: they depend on the codec
  and the bucket, not on the link, and a probe that lost the CPU for a while only reads longer
  (one probe that read twice the usual encode once sent a slow link's first trial to a gentler
  codec than it called for). ``x`` is the bucket's gradient plus the
  residual the bucket carries (the tensor the codec is handed), so the error is the figure the
  monitor logs as ``relative_error``. The running codec's error is measured again on the last
  step of every window (one encode and decode of the bucket), because an error-feedback codec's
  error grows with the residual it builds, which a probe from a clean start cannot see: a running
  codec over the budget is replaced at once, without a trial, by the cheapest candidate still
  within it (dense when none is), and is not proposed on that bucket again for the rest of the
  run (its error is a property of the codec on the bucket's gradients, not of the link, and a
  clean-start probe would read it under the budget again); the replacement's own error is
  checked after :data:`CHECK_STEPS` steps.
  The budget is per bucket, in the spirit of L-GreCo (Markov et al., arXiv 2210.17357) and Kimad
  (Xin et al., arXiv 2312.08053); their optimisers are ``--compressor kimad``.
  A proposal that differs from the running choice is then tried for ``trial_steps`` steps and
  kept only if the measured step period beats the running one. Hysteresis: a gentler proposal
  is kept unless slower by more than ``trial_margin``, a stronger one only when faster by that
  much, and a stronger one is not tried for a predicted saving under ``trial_margin`` of the
  step; so a recovered link brings the gentler codec back as readily as a slow one takes it
  away, and noise does not flap between them. Every change must win against what runs, and the
  run starts dense, so measured steps are never slower than dense by more than the noise of one
  comparison. One exception: when the link estimate changed by a factor of
  :data:`TRIAL_RELINKED` or more, up or down, between the proposal and the end of its trial (the
  link changed while the window that measured the running period closed), the two periods were
  measured on different links and say nothing of each other; the trial is then kept if its
  predicted cost on the current link is below the running choice's. (A smaller change is within
  the noise of the estimate on a fast link, where an exchange's seconds are mostly latency.)
- ``accordion``: Accordion (Agarwal et al., "Adaptive Gradient Communication via Critical
  Learning Regime Identification", MLSys 2021, arXiv 2010.16248): a bucket is in a critical
  regime when the norm of its gradient summed over a window changed by at least
  ``critical_change`` (Accordion's eta, 0.5) relative to the previous window; critical buckets
  use the gentlest candidate, the others the strongest. Accordion's batch-size variant is not
  implemented.
The per-layer schedules Kimad, LEGACY and EDGC are compressors of their own
(``--compressor kimad``, ``legacy``, ``edgc``; :mod:`gradzip.control.schedules`).

Candidates are listed gentlest first (``none`` is always candidate 0 and is added if missing).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from gradzip.compressors.values import check_number
from gradzip.control.figures import BucketFigures, CandidateFigures, Plan, WindowFigures
from gradzip.control.link import Link, LinkEstimator, probe_after
from gradzip.keys import label

SCHEDULES = ("cost", "accordion")

#: a link estimate that moved by this fraction (either way) is taken for another link
LINK_MOVED = 0.25
#: a trial whose link estimate changed by this factor (up or down) since its proposal ran on another link
TRIAL_RELINKED = 2.0
#: steps after which the codec that replaced one over the error budget has its own error checked
#: (soon: the codec it replaced already ran a trial's steps over the budget)
CHECK_STEPS = 4

#: probes of a candidate whose fastest encode and decode prices it (see the module docstring)
PROBE_MEMORY = 3

FIRST_WINDOW_STEPS = 5
"""Steps of the first window (after step 0): enough for a median step period of three steps
and one probe, short so that a run on a slow link leaves dense early."""

DEFAULT_CANDIDATES = {
    "cost": ("none", "fp16", "int8", "powersgd:approx_rank=4", "topk:ratio=0.01"),
    "accordion": ("none", "powersgd:approx_rank=4", "powersgd:approx_rank=1"),
}


@dataclass
class AutoConfig:
    """Settings of ``--compressor auto``; :meth:`validate` raises ``ValueError`` on bad values."""

    schedule: str = "cost"
    """``cost`` or ``accordion`` (see the module docstring)."""

    candidates: tuple[str, ...] | None = None
    """Codec specs, gentlest first; None takes the schedule's default list."""

    adapt_every: int = 50
    """Steps between decisions. The first decision comes after a short measuring window of
    ``min(adapt_every, FIRST_WINDOW_STEPS)`` steps after step 0 (dense, with ``cost``), the
    later ones every ``adapt_every`` steps (a trial of ``cost`` is shorter)."""

    max_error: float = 0.6
    """Quality budget of ``cost``: the largest one-step relative error a bucket may have."""

    min_gain: float = 0.1
    """``cost``: a codec replaces dense only if its predicted cost is this fraction below dense's."""

    trial_steps: int | None = None
    """``cost``: steps a proposal is tried before it is kept; None: ``max(4, adapt_every // 4)``."""

    trial_margin: float = 0.05
    """``cost``: the measured step period must beat the running one by this fraction (a noisy
    machine needs a wide margin: at 1 Gbit/s a 2% margin kept a codec that did not pay)."""

    reprobe_every: int = 4
    """``cost``: windows between probes of every candidate (probing costs one step's worth of encoding)."""

    critical_change: float = 0.5
    """``accordion``: relative change of the summed gradient's norm that marks a critical regime."""

    def validate(self) -> AutoConfig:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--auto-schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        for name, low in (("adapt_every", 4), ("reprobe_every", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
        if self.trial_steps is not None and (not isinstance(self.trial_steps, int) or self.trial_steps < 3):
            raise ValueError(f"trial_steps must be an integer >= 3; got {self.trial_steps!r}")
        for name in ("max_error", "min_gain", "trial_margin", "critical_change"):
            value = getattr(self, name)
            check_number(value, name=name, low=0, low_open=True)
        if self.min_gain >= 1 or self.trial_margin >= 1:
            raise ValueError("min_gain and trial_margin must be below 1")
        if self.candidates is not None:
            named = [c.strip() for c in self.candidates if c.strip()]
            if not [c for c in named if c != "none"]:
                raise ValueError("--auto-candidates must name at least one codec besides none")
            for spec in named:
                check_candidate(spec)
        return self

    def candidate_specs(self, world_size: int | None = None) -> list[str]:
        """The candidates, ``none`` first; from the default list, those that sum over at most
        fewer ranks than ``world_size`` (``int8`` past 127) are left out."""
        if self.candidates is not None:
            specs = list(self.candidates)
        else:
            specs = [s for s in DEFAULT_CANDIDATES[self.schedule] if world_size is None or sums_over(s, world_size)]
        specs = [s.strip() for s in specs if s.strip()]
        return ["none"] + [s for s in specs if s != "none"]


def sums_over(spec: str, world_size: int) -> bool:
    """Whether codec ``spec`` runs at ``world_size`` ranks (``int8`` and 8-bit PowerSGD factors
    sum over at most 127)."""
    from gradzip.compressors import build

    limit = build(spec).max_world_size
    return limit is None or world_size <= limit


#: the multi-round codecs whose reducers auto can probe and move residuals into and out of
MULTI_ROUND_CANDIDATES = ("powersgd", "int8")


def runnable(codec) -> bool:
    """Whether auto can run ``codec``: single-round codecs, PowerSGD and ``int8`` (auto probes
    every candidate and moves residuals between them, which of the multi-round reducers only
    theirs support)."""
    return not codec.multi_round or codec.name in MULTI_ROUND_CANDIDATES


def check_candidate(spec: str) -> None:
    """Raise ``ValueError`` (naming ``--auto-candidates``) for a spec that is not a codec auto can
    run: an unknown or out-of-range codec, or a multi-round one other than PowerSGD and ``int8``
    (auto probes every candidate and moves residuals between them, which only their reducers
    support)."""
    from gradzip.compressors import build

    try:
        codec = build(spec)
    except ValueError as exc:
        raise ValueError(f"--auto-candidates: {spec!r}: {exc}") from None
    if not runnable(codec):
        raise ValueError(f"--auto-candidates take powersgd, int8 and single-round codecs, not {codec.name} ({spec!r})")


def parse_candidates(text: str) -> tuple[str, ...]:
    """``"none,fp16,powersgd:approx_rank=4"`` (or ``;``-separated) -> a tuple of specs, by the
    list rule of every option (:func:`gradzip.compressors.spec.split_spec_list`)."""
    from gradzip.compressors.spec import split_spec_list

    return tuple(split_spec_list(text, name="--auto-candidates"))


def make_controller(cfg: AutoConfig, specs: Sequence[str]):
    """The controller of ``cfg.schedule`` for candidates ``specs`` (``none`` first)."""
    cfg.validate()
    cls = {"cost": CostController, "accordion": AccordionController}[cfg.schedule]
    return cls(cfg, list(specs))


# -- schedules ---------------------------------------------------------------------------------


class _Base:
    needs_gradient_sum = False
    entropy_every = 0

    def __init__(self, cfg: AutoConfig, specs: list[str]) -> None:
        self.cfg = cfg
        self.specs = specs

    def first_window_steps(self) -> int:
        return min(self.cfg.adapt_every, FIRST_WINDOW_STEPS)

    def _reason(self, b: BucketFigures, new: int, why: str) -> str:
        old = self.specs[b.current]
        arrow = f"{old} -> {self.specs[new]}" if new != b.current else f"stays {old}"
        return f"bucket {label(b.key)}: {arrow}, {why}"

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class CostController(_Base):
    """The ``cost`` schedule (see the module docstring)."""

    checks_running_error = True

    def __init__(self, cfg: AutoConfig, specs: list[str]) -> None:
        super().__init__(cfg, specs)
        self.trial_steps = cfg.trial_steps or max(4, cfg.adapt_every // 4)
        # a window averages many steps: the last one counts most (an older one a sixteenth)
        self.estimator = LinkEstimator(half_life=0.25)
        self.probes: dict[Hashable, list[CandidateFigures]] = {}
        #: (bucket, candidate) -> encode plus decode seconds of its last PROBE_MEMORY probes
        self.codec_s: dict[tuple[Hashable, int], deque[float]] = {}
        #: (bucket, candidate) -> the link rate at which it ran over the error budget (kept aside
        #: for the rest of the run; the rate is for the record)
        self.over_budget: dict[tuple[Hashable, int], float] = {}
        self.windows_since_probe = 0
        self.running_period_s: float | None = None
        self.running: dict[Hashable, int] | None = None
        self.trial: dict[Hashable, int] | None = None
        self.trial_bytes_per_s = 0.0
        self.rejected: list[tuple[dict[Hashable, int], float]] = []
        #: the last window's exchange: its wire seconds over its seconds (None: not measured)
        self.exchange_share: float | None = None

    def _payload(self, choices: dict[Hashable, int]) -> float:
        total = 0.0
        for key, index in choices.items():
            cands = self.probes.get(key)
            if cands is not None:
                total += cands[index].payload_bytes
        return total

    def decide(self, window: WindowFigures) -> Plan:
        for b in window.buckets:
            if b.candidates is not None:
                self.probes[b.key] = b.candidates
                for c, cand in enumerate(b.candidates):
                    seen = self.codec_s.setdefault((b.key, c), deque(maxlen=PROBE_MEMORY))
                    seen.append(cand.compress_s + cand.decompress_s)
        probed = any(b.candidates is not None for b in window.buckets)
        self.windows_since_probe = 0 if probed else self.windows_since_probe + 1
        self.estimator.add(window.link_samples())
        self.exchange_share = _wire_share(window, self.estimator.link)
        current = {b.key: b.current for b in window.buckets}
        bandwidth = self.estimator.link.bytes_per_s if self.estimator.link else 0.0
        for b in window.buckets:
            # the running codec's error on what it was handed: over the budget, it is set aside
            if b.candidates is not None and b.current and self._over(b.candidates[b.current].relative_error):
                self.over_budget[(b.key, b.current)] = bandwidth
        probe_next = self.windows_since_probe + 1 >= self.cfg.reprobe_every
        over = [b for b in window.buckets if b.current and self._over(b.running_error)]
        if over:
            return self._leave_over_budget(window, over, current, bandwidth)

        if self.trial is not None:
            trial, self.trial = self.trial, None
            before, after = self.running_period_s or 0.0, window.period_s
            then = self.trial_bytes_per_s
            if then > 0 and bandwidth > 0 and max(bandwidth / then, then / bandwidth) >= TRIAL_RELINKED:
                # the running period was measured on another link: the model judges
                trial_s, running_s = self._cost(trial), self._cost(self.running or {})
                kept = trial_s < running_s
                verdict = (f"the link moved from {then * 8e-6:,.0f} to {bandwidth * 8e-6:,.0f} Mbit/s; predicted "
                           f"{trial_s * 1e3:.1f} ms against {running_s * 1e3:.1f} ms")
            else:
                gentler = self._payload(trial) >= self._payload(self.running or {})
                bound = before * (1 + self.cfg.trial_margin) if gentler else before * (1 - self.cfg.trial_margin)
                kept = before > 0 and after > 0 and after <= bound
                verdict = f"step period {after * 1e3:.0f} ms against {before * 1e3:.0f} ms"
            if kept:
                self.running, self.running_period_s = dict(trial), after
                return Plan(dict(trial), self.cfg.adapt_every, {}, f"trial kept: {verdict}", probe_next)
            self.rejected.append((dict(trial), bandwidth))
            choices = dict(self.running or {})
            reasons = {k: self._reason(_bucket(window, k), v, "trial slower") for k, v in choices.items()
                       if v != current.get(k)}
            return Plan(choices, self.cfg.adapt_every, reasons, f"trial rejected: {verdict}", probe_next)

        self.running, self.running_period_s = dict(current), window.period_s
        proposal, reasons = self._propose(window)
        if proposal == current:
            return Plan(current, self.cfg.adapt_every, reasons, "no change", probe_next)
        saving_s = self._cost(current) - self._cost(proposal)
        stronger = self._payload(proposal) < self._payload(current)
        if stronger and window.period_s > 0 and saving_s < self.cfg.trial_margin * window.period_s:
            # A trial keeps a stronger codec only for a step period shorter by trial_margin: a
            # smaller predicted saving could win it only through noise, and would cost accuracy.
            note = (f"predicted saving {saving_s * 1e3:.1f} ms under {self.cfg.trial_margin:.0%} of the "
                    f"{window.period_s * 1e3:.0f} ms step; no change")
            return Plan(current, self.cfg.adapt_every, reasons, note, probe_next)
        bandwidth = self.estimator.link.bytes_per_s if self.estimator.link else 0.0
        for choices, at_bandwidth in self.rejected:
            if choices == proposal and at_bandwidth > 0 and not _moved(bandwidth, at_bandwidth):
                note = "proposal lost a trial before at a similar link rate; no change"
                return Plan(current, self.cfg.adapt_every, reasons, note, probe_next)
        self.trial, self.trial_bytes_per_s = dict(proposal), bandwidth
        return Plan(dict(proposal), self.trial_steps, reasons, f"trial for {self.trial_steps} steps", False)

    def _over(self, error: float) -> bool:
        """Whether a relative error breaks the budget; NaN does (a gradient holding NaN or inf
        gives it, and no codec is known to be within the budget on it)."""
        return not error <= self.cfg.max_error

    def _leave_over_budget(self, window: WindowFigures, over: list[BucketFigures], current: dict[Hashable, int],
                           bandwidth: float) -> Plan:
        """The running codec of the buckets in ``over`` measured above the error budget on what
        it was handed: each moves at once, without a trial, to the cheapest candidate still
        within the budget by the last probes (dense when none is); a trial under way ends, and
        the other buckets keep their codec. Every candidate is priced again in the next window,
        which lasts :data:`CHECK_STEPS` (at most ``trial_steps``): the replacement was judged by a
        probe from a clean start, which an error-feedback codec's running error can exceed, so it
        is checked soon (a replacement whose error crosses the budget later is caught at the end
        of a later window, as any running codec is)."""
        for b in over:
            self.over_budget[(b.key, b.current)] = bandwidth
        self.trial = None
        proposal, why = self._propose(window)
        choices, reasons = dict(current), {}
        for b in over:
            choices[b.key] = proposal.get(b.key, 0)
            head = f"{self.specs[b.current]} error {b.running_error:.2f} over the budget {self.cfg.max_error:g}"
            reasons[b.key] = f"{head}; {why[b.key]}" if b.key in why else head
        self.running, self.running_period_s = dict(choices), None
        note = f"over the error budget on {len(over)} bucket{'s' if len(over) > 1 else ''}; moved without a trial"
        return Plan(choices, min(CHECK_STEPS, self.trial_steps), reasons, note, True)

    def _candidate_s(self, key: Hashable, c: int) -> float:
        """Predicted seconds of bucket ``key``'s exchange with candidate ``c``: its fastest
        recent encode and decode, and its wire time on the estimated link."""
        assert self.estimator.link is not None
        cand = self.probes[key][c]
        codec_s = min(self.codec_s.get((key, c), ()), default=cand.compress_s + cand.decompress_s)
        return codec_s + self.estimator.link.seconds(cand.sent_bytes, cand.collectives)

    def _cost(self, choices: dict[Hashable, int]) -> float:
        """Predicted seconds per step of the probed buckets' exchanges under ``choices``."""
        if self.estimator.link is None:
            return 0.0
        return sum(self._candidate_s(k, c) for k, c in choices.items() if k in self.probes)

    def _propose(self, window: WindowFigures) -> tuple[dict[Hashable, int], dict[Hashable, str]]:
        choices, reasons = {}, {}
        link = self.estimator.link
        for b in window.buckets:
            cands = self.probes.get(b.key)
            if cands is None or link is None:
                choices[b.key] = b.current
                continue
            dense_s = self._candidate_s(b.key, 0)
            best, best_s, over_budget = 0, dense_s, []
            for c, cand in enumerate(cands[1:], start=1):
                if self._over(cand.relative_error):
                    over_budget.append(f"{cand.spec} error {cand.relative_error:.2f}")
                    continue
                # The error is the codec's on this bucket's gradients, whatever the link: one that
                # ran over the budget stays aside (a clean-start probe would read it under again).
                if (b.key, c) in self.over_budget:
                    over_budget.append(f"{cand.spec} ran over it")
                    continue
                cost = self._candidate_s(b.key, c)
                if cost < best_s:
                    best, best_s = c, cost
            head = f"link {link.mbit:,.0f} Mbit/s"
            if best != 0 and best_s > dense_s * (1 - self.cfg.min_gain):
                why = f"{head}, compress cost above saving ({self.specs[best]} {best_s * 1e3:.1f} ms vs dense {dense_s * 1e3:.1f} ms)"
                best = 0
            elif best == 0:
                why = f"{head}, no codec cheaper than dense {dense_s * 1e3:.1f} ms"
            else:
                why = f"{head}, est. {best_s * 1e3:.1f} ms vs dense {dense_s * 1e3:.1f} ms"
            if over_budget:
                why += f"; over the error budget {self.cfg.max_error:g}: {', '.join(over_budget)}"
            choices[b.key] = best
            reasons[b.key] = self._reason(b, best, why)
        return choices, reasons

    def link_estimate(self) -> Link | None:
        """The current estimate of the link (what the reducer records each window)."""
        return self.estimator.link

    def probe_bytes(self) -> int:
        """The link probe sent after the next window's figure all_reduce: one every window (a
        calibration), at least the probed buckets' dense payload when the running exchange was
        mostly latency (see :meth:`LinkEstimator.probe_bytes`)."""
        dense = self._payload({key: 0 for key in self.probes})
        return self.estimator.probe_bytes(dense, share=self.exchange_share, calibrate=True)

    def size_probe(self, window: WindowFigures, asked: int) -> int:
        """The probe to send now (:func:`~gradzip.control.link.probe_after`: sized down when
        this window's exchange shows that the link fell since ``asked`` was sized)."""
        return probe_after(self.estimator.link, window.exchange_sample(), asked)

    def state_dict(self) -> dict[str, Any]:
        return {"running": self.running, "running_period_s": self.running_period_s, "trial": self.trial,
                "trial_bytes_per_s": self.trial_bytes_per_s, "rejected": list(self.rejected),
                "windows_since_probe": self.windows_since_probe, "link": self.estimator.state_dict(),
                "over_budget": [[k, c, rate] for (k, c), rate in self.over_budget.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.running, self.running_period_s = state["running"], state["running_period_s"]
        self.trial, self.rejected = state["trial"], list(state["rejected"])
        self.trial_bytes_per_s = state["trial_bytes_per_s"]
        self.windows_since_probe = state["windows_since_probe"]
        self.estimator.load_state_dict(state["link"])
        self.over_budget = {(k, c): rate for k, c, rate in state["over_budget"]}


def _wire_share(window: WindowFigures, link: Link | None) -> float | None:
    """The window's exchange: its seconds on the wire over its seconds in flight, by ``link``."""
    exchange = window.exchange_sample()
    if link is None or exchange is None:
        return None
    collectives, _sent, seconds = exchange
    return max(0.0, seconds - link.latency_s * collectives) / seconds


def _moved(bytes_per_s: float, reference: float) -> bool:
    """Whether a link estimate is another link than ``reference`` (see :data:`LINK_MOVED`)."""
    return abs(bytes_per_s / reference - 1) >= LINK_MOVED


def _bucket(window: WindowFigures, key: Hashable) -> BucketFigures:
    for b in window.buckets:
        if b.key == key:
            return b
    raise KeyError(key)


class AccordionController(_Base):
    """The ``accordion`` schedule (see the module docstring)."""

    needs_gradient_sum = True

    def __init__(self, cfg: AutoConfig, specs: list[str]) -> None:
        super().__init__(cfg, specs)
        self.previous: dict[Hashable, float] = {}

    def decide(self, window: WindowFigures) -> Plan:
        gentle, strong = 1, len(self.specs) - 1
        steps = max(1, window.end - window.start)
        choices, reasons = {}, {}
        for b in window.buckets:
            norm = b.gradient_sum_norm / steps
            before = self.previous.get(b.key)
            self.previous[b.key] = norm
            if before is None or before <= 0:
                choices[b.key] = gentle
                reasons[b.key] = self._reason(b, gentle, "first window: critical until measured")
                continue
            change = abs(norm - before) / before
            critical = change >= self.cfg.critical_change
            choices[b.key] = gentle if critical else strong
            regime = "critical" if critical else "not critical"
            reasons[b.key] = self._reason(b, choices[b.key], f"gradient norm changed {change:.0%} ({regime}, eta {self.cfg.critical_change:g})")
        return Plan(choices, self.cfg.adapt_every, reasons, "accordion", False)

    def state_dict(self) -> dict[str, Any]:
        return {"previous": dict(self.previous)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous = dict(state["previous"])
