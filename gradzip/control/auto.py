"""``--compressor auto``: which codec each bucket uses, re-decided every ``adapt_every`` steps.

Controllers read :class:`~gradzip.metrics.WindowFigures` (figures over a window of steps,
all-reduced so that every rank sees the same numbers) and return a
:class:`~gradzip.metrics.Plan`. They are deterministic functions of what they have seen, so every
rank reaches the same decisions. :class:`~gradzip.control.auto_reducer.AutoReducer` carries them out.

Schedules (``--auto-schedule``):

- ``cost`` (default): bandwidth-aware. Fits the link (``seconds = latency * collectives +
  sent_bytes / bandwidth``) to the bytes and seconds of the collectives of the last
  ``LINK_WINDOWS`` windows, prices every
  candidate on every bucket from a local probe (encode and decode seconds, payload bytes), keeps
  the candidates whose one-step relative error ``||g - D(C(g))|| / ||g||`` is within
  ``max_error`` (a quality budget per bucket, in the spirit of L-GreCo, Markov et al., arXiv
  2210.17357, and Kimad, Xin et al., arXiv 2312.08053; neither's optimiser is reproduced: the
  choice is per bucket, the cheapest that fits, not a dynamic programme over a total budget),
  and picks the cheapest, dense unless a codec saves at least ``min_gain`` of the dense cost.
  A proposal that differs from the running choice is then tried for ``trial_steps`` steps and
  kept only if the measured step period beats the running one (a gentler proposal is kept when
  not slower by more than ``trial_margin``; a stronger one only when faster by that much). Every
  change must win against what runs, and the run starts dense, so measured steps are never
  slower than dense by more than the noise of one comparison.
- ``accordion``: Accordion (Agarwal et al., "Adaptive Gradient Communication via Critical
  Learning Regime Identification", MLSys 2021, arXiv 2010.16248): a bucket is in a critical
  regime when the norm of its gradient summed over a window changed by at least
  ``critical_change`` (Accordion's eta, 0.5) relative to the previous window; critical buckets
  use the gentlest candidate, the others the strongest. Accordion's batch-size variant is not
  implemented.
- ``legacy``: LEGACY-style ("LEGACY: A Lightweight Dynamic Gradient Compression Strategy for
  Distributed Deep Learning", ICLR 2026): compress less early in training and on small buckets. Here: the level
  along the candidate list (gentlest first) rises linearly with the step until ``ramp_steps``;
  buckets under ``small_numel`` elements stay at the gentlest candidate. The paper's exact
  per-layer formulas are not reproduced.
- ``edgc``: EDGC-style (Yi et al., arXiv 2511.10333): the entropy of a down-sampled gradient is
  estimated every window and the compression follows its trend: each drop of ``entropy_step``
  in entropy relative to the first window moves a bucket one candidate stronger (list PowerSGD
  ranks highest first). EDGC's Marchenko-Pastur model of rank against error is not reproduced.

Candidates are listed gentlest first (``none`` is always candidate 0 and is added if missing).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from gradzip.compressors.values import check_number
from gradzip.control.figures import BucketFigures, CandidateFigures, Plan, WindowFigures
from gradzip.keys import label

SCHEDULES = ("cost", "accordion", "legacy", "edgc")

FIRST_WINDOW_STEPS = 5
"""Steps of the first window (after step 0): enough for a median step period of three steps
and one probe, short so that a run on a slow link leaves dense early."""

DEFAULT_CANDIDATES = {
    "cost": ("none", "fp16", "powersgd:approx_rank=4", "topk:ratio=0.01"),
    "accordion": ("none", "powersgd:approx_rank=4", "powersgd:approx_rank=1"),
    "legacy": ("none", "fp16", "powersgd:approx_rank=8", "powersgd:approx_rank=2"),
    "edgc": ("none", "powersgd:approx_rank=8", "powersgd:approx_rank=4", "powersgd:approx_rank=2",
             "powersgd:approx_rank=1"),
}


@dataclass
class AutoConfig:
    """Settings of ``--compressor auto``; :meth:`validate` raises ``ValueError`` on bad values."""

    schedule: str = "cost"
    """One of ``cost``, ``accordion``, ``legacy``, ``edgc`` (see the module docstring)."""

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

    ramp_steps: int = 300
    """``legacy``: steps over which compression rises from the gentlest to the strongest candidate."""

    small_numel: int = 1 << 16
    """``legacy``: buckets with fewer elements stay at the gentlest candidate."""

    entropy_step: float = 0.05
    """``edgc``: entropy drop (relative to the first window) per step along the candidate list."""

    def validate(self) -> AutoConfig:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--auto-schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        for name, low in (("adapt_every", 4), ("reprobe_every", 1), ("ramp_steps", 1), ("small_numel", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
        if self.trial_steps is not None and (not isinstance(self.trial_steps, int) or self.trial_steps < 3):
            raise ValueError(f"trial_steps must be an integer >= 3; got {self.trial_steps!r}")
        for name in ("max_error", "min_gain", "trial_margin", "critical_change", "entropy_step"):
            value = getattr(self, name)
            check_number(value, name=name, low=0, low_open=True)
        if self.min_gain >= 1 or self.trial_margin >= 1:
            raise ValueError("min_gain and trial_margin must be below 1")
        if self.candidates is not None and len([c for c in self.candidates if c.strip() != "none"]) < 1:
            raise ValueError("--auto-candidates must name at least one codec besides none")
        return self

    def candidate_specs(self) -> list[str]:
        """The candidates, ``none`` first."""
        specs = list(self.candidates if self.candidates is not None else DEFAULT_CANDIDATES[self.schedule])
        specs = [s.strip() for s in specs if s.strip()]
        return ["none"] + [s for s in specs if s != "none"]


def parse_candidates(text: str) -> tuple[str, ...]:
    """``"none,fp16,powersgd:approx_rank=4"`` (or ``;``-separated) -> a tuple of specs, by the
    list rule of every option (:func:`gradzip.compressors.spec.split_spec_list`)."""
    from gradzip.compressors.spec import split_spec_list

    return tuple(split_spec_list(text, name="--auto-candidates"))


def make_controller(cfg: AutoConfig, specs: Sequence[str]):
    """The controller of ``cfg.schedule`` for candidates ``specs`` (``none`` first)."""
    cfg.validate()
    cls = {"cost": CostController, "accordion": AccordionController, "legacy": LegacyController,
           "edgc": EntropyController}[cfg.schedule]
    return cls(cfg, list(specs))


# -- the link ----------------------------------------------------------------------------------


@dataclass
class Link:
    """``seconds = latency_s * collectives + sent_bytes / bytes_per_s``, ``sent_bytes`` what one rank
    sends (:mod:`gradzip.comm.traffic` gives them per route)."""

    latency_s: float
    bytes_per_s: float

    @property
    def mbit(self) -> float:
        return self.bytes_per_s * 8 / 1e6

    def seconds(self, sent_bytes: float, collectives: float) -> float:
        return self.latency_s * collectives + sent_bytes / self.bytes_per_s


LINK_WINDOWS = 4
"""Windows whose collectives the ``cost`` schedule fits the link to: after a switch the window
before it (other payload sizes) stays in the fit, so latency and bandwidth both come out."""


def link_rows(window: WindowFigures) -> list[tuple[float, float, float]]:
    """``(collectives, sent_bytes, seconds)`` per step of each bucket that moved bytes in ``window``."""
    return [(b.collectives, b.sent_bytes, b.communicate_s) for b in window.buckets
            if b.sent_bytes > 0 and b.communicate_s > 0]


def fit_link(rows: Sequence[tuple[float, float, float]], previous: Link | None = None) -> Link | None:
    """Least-squares fit of latency and bandwidth to ``(collectives, sent bytes, seconds)`` rows.

    With one payload size (or a negative latency) the latency is 0 and the bandwidth is the
    ratio of sums. Returns ``previous`` when no row moved bytes.
    """
    if not rows:
        return previous
    s11 = sum(n * n for n, _, _ in rows)
    s12 = sum(n * w for n, w, _ in rows)
    s22 = sum(w * w for _, w, _ in rows)
    s1y = sum(n * y for n, _, y in rows)
    s2y = sum(w * y for _, w, y in rows)
    det = s11 * s22 - s12 * s12
    if len(rows) >= 2 and det > 1e-12 * s11 * s22:
        latency = (s22 * s1y - s12 * s2y) / det
        inv_bw = (s11 * s2y - s12 * s1y) / det
        if latency >= 0 and inv_bw > 0:
            return Link(latency, 1.0 / inv_bw)
    inv_bw = s2y / s22
    return Link(0.0, 1.0 / inv_bw) if inv_bw > 0 else previous


# -- schedules ---------------------------------------------------------------------------------


class _Base:
    needs_gradient_sum = False
    needs_entropy = False

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

    def __init__(self, cfg: AutoConfig, specs: list[str]) -> None:
        super().__init__(cfg, specs)
        self.trial_steps = cfg.trial_steps or max(4, cfg.adapt_every // 4)
        self.link: Link | None = None
        self.link_history: list[list[tuple[float, float, float]]] = []
        self.probes: dict[Hashable, list[CandidateFigures]] = {}
        self.windows_since_probe = 0
        self.running_period_s: float | None = None
        self.running: dict[Hashable, int] | None = None
        self.trial: dict[Hashable, int] | None = None
        self.trial_bytes_per_s = 0.0
        self.rejected: list[tuple[dict[Hashable, int], float]] = []

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
        probed = any(b.candidates is not None for b in window.buckets)
        self.windows_since_probe = 0 if probed else self.windows_since_probe + 1
        self.link_history = (self.link_history + [link_rows(window)])[-LINK_WINDOWS:]
        self.link = fit_link([row for rows in self.link_history for row in rows], self.link)
        current = {b.key: b.current for b in window.buckets}
        probe_next = self.windows_since_probe + 1 >= self.cfg.reprobe_every

        if self.trial is not None:
            trial, self.trial = self.trial, None
            before, after = self.running_period_s or 0.0, window.period_s
            gentler = self._payload(trial) >= self._payload(self.running or {})
            bound = before * (1 + self.cfg.trial_margin) if gentler else before * (1 - self.cfg.trial_margin)
            if before > 0 and after > 0 and after <= bound:
                self.running, self.running_period_s = dict(trial), after
                note = f"trial kept: step period {after * 1e3:.0f} ms against {before * 1e3:.0f} ms"
                return Plan(dict(trial), self.cfg.adapt_every, {}, note, probe_next)
            self.rejected.append((dict(trial), self.trial_bytes_per_s))
            choices = dict(self.running or {})
            reasons = {k: self._reason(_bucket(window, k), v, "trial slower") for k, v in choices.items()
                       if v != current.get(k)}
            note = f"trial rejected: step period {after * 1e3:.0f} ms against {before * 1e3:.0f} ms"
            return Plan(choices, self.cfg.adapt_every, reasons, note, probe_next)

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
        bandwidth = self.link.bytes_per_s if self.link else 0.0
        for choices, at_bandwidth in self.rejected:
            if choices == proposal and at_bandwidth > 0 and abs(bandwidth / at_bandwidth - 1) < 0.25:
                note = "proposal lost a trial before at a similar link rate; no change"
                return Plan(current, self.cfg.adapt_every, reasons, note, probe_next)
        self.trial, self.trial_bytes_per_s = dict(proposal), bandwidth
        return Plan(dict(proposal), self.trial_steps, reasons, f"trial for {self.trial_steps} steps", False)

    def _candidate_s(self, cand: CandidateFigures) -> float:
        """Predicted seconds of one bucket's exchange with ``cand``: encode, decode, wire."""
        assert self.link is not None
        return cand.compress_s + cand.decompress_s + self.link.seconds(cand.sent_bytes, cand.collectives)

    def _cost(self, choices: dict[Hashable, int]) -> float:
        """Predicted seconds per step of the probed buckets' exchanges under ``choices``."""
        if self.link is None:
            return 0.0
        return sum(self._candidate_s(self.probes[k][c]) for k, c in choices.items() if k in self.probes)

    def _propose(self, window: WindowFigures) -> tuple[dict[Hashable, int], dict[Hashable, str]]:
        choices, reasons = {}, {}
        link = self.link
        for b in window.buckets:
            cands = self.probes.get(b.key)
            if cands is None or link is None:
                choices[b.key] = b.current
                continue
            dense_s = self._candidate_s(cands[0])
            best, best_s, over_budget = 0, dense_s, []
            for c, cand in enumerate(cands[1:], start=1):
                if cand.relative_error > self.cfg.max_error:
                    over_budget.append(f"{cand.spec} error {cand.relative_error:.2f}")
                    continue
                cost = self._candidate_s(cand)
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

    def state_dict(self) -> dict[str, Any]:
        return {"running": self.running, "running_period_s": self.running_period_s, "trial": self.trial,
                "trial_bytes_per_s": self.trial_bytes_per_s, "rejected": list(self.rejected), "windows_since_probe": self.windows_since_probe,
                "link": None if self.link is None else (self.link.latency_s, self.link.bytes_per_s),
                "link_history": [list(rows) for rows in self.link_history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.running, self.running_period_s = state["running"], state["running_period_s"]
        self.trial, self.rejected = state["trial"], list(state["rejected"])
        self.trial_bytes_per_s = state["trial_bytes_per_s"]
        self.windows_since_probe = state["windows_since_probe"]
        self.link = None if state["link"] is None else Link(*state["link"])
        self.link_history = [[tuple(row) for row in rows] for rows in state.get("link_history", [])]


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


class LegacyController(_Base):
    """The ``legacy`` schedule (see the module docstring)."""

    def decide(self, window: WindowFigures) -> Plan:
        levels = len(self.specs) - 1
        progress = min(1.0, window.end / self.cfg.ramp_steps)
        level = 1 + min(levels - 1, int(progress * levels))
        choices, reasons = {}, {}
        for b in window.buckets:
            if b.numel < self.cfg.small_numel:
                choices[b.key] = 1
                why = f"small bucket ({b.numel:,} < {self.cfg.small_numel:,} elements)"
            else:
                choices[b.key] = level
                why = f"training progress {progress:.0%} of {self.cfg.ramp_steps} steps"
            reasons[b.key] = self._reason(b, choices[b.key], why)
        return Plan(choices, self.cfg.adapt_every, reasons, "legacy", False)


class EntropyController(_Base):
    """The ``edgc`` schedule (see the module docstring)."""

    needs_entropy = True

    def __init__(self, cfg: AutoConfig, specs: list[str]) -> None:
        super().__init__(cfg, specs)
        self.initial: dict[Hashable, float] = {}

    def decide(self, window: WindowFigures) -> Plan:
        levels = len(self.specs) - 1
        choices, reasons = {}, {}
        for b in window.buckets:
            first = self.initial.setdefault(b.key, b.entropy)
            drop = (first - b.entropy) / first if first > 0 else 0.0
            level = 1 + min(levels - 1, max(0, int(drop / self.cfg.entropy_step)))
            choices[b.key] = level
            reasons[b.key] = self._reason(b, level, f"entropy {b.entropy:.3f} ({-drop:+.1%} since the first window)")
        return Plan(choices, self.cfg.adapt_every, reasons, "edgc", False)

    def state_dict(self) -> dict[str, Any]:
        return {"initial": dict(self.initial)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.initial = dict(state["initial"])
