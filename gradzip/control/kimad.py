"""``--compressor kimad``: Kimad and Kimad+, a byte budget per step from the measured link,
split across layers to lose the least.

Kimad (Xin, Ilin, Zhang, Canini, Richtárik, "Kimad: Adaptive Gradient Compression with Bandwidth
Awareness", DistributedML 2023, arXiv 2312.08053) watches the bandwidth and, every step, sets the
compression so that the step's communication takes a target time: a byte budget
``B = bandwidth * target``. Kimad+ splits that budget across layers: each layer ``l`` takes one
of its candidate levels ``c`` (a ratio for Top-K), which costs ``bytes[l][c]`` and leaves the error
``||x_l - C_c(x_l)||^2``; the split minimises the summed error within ``B``, a multiple-choice
knapsack solved by dynamic programming over a discretised budget as L-GreCo does for PowerSGD
ranks (Markov et al., arXiv 2210.17357; :mod:`gradzip.control.knapsack`).

Here, every step (a window of one step of the auto reducer):

1. the link is re-estimated from the last link probes (see below;
   :class:`~gradzip.control.link.LinkEstimator`: latency and bandwidth kept apart by the probe's
   all_reduce of one element beside its sized one, following the link both ways with a
   half-life of ``half_life`` steps);
2. the budget is ``(target - latency * collectives) * bandwidth`` bytes per rank, where the
   target is the step's compute time (``target_ms=compute``, the default: the median over the
   last :data:`COMPUTE_STEPS` steps of the step period less its exchange, a lower bound of the
   computation each step, so the exchange is sized to take as long as the computation it can
   overlap; the median leaves out the validation pauses) or a fixed time in milliseconds;
3. while every layer sent at the *floor* fits the budget, every layer takes the floor: ``fp16``
   by default (half the bytes at a relative error near ``2^-11``: the light compression an idle
   link calls for), ``none`` with ``floor=none`` and always with ``codec=powersgd`` (whose
   low-rank exchange mixes only with dense layers), and ``none`` for a layer whose gradient is
   already fp16 or bf16 (a cast would save nothing). No layer's error is needed for that plan,
   so none is measured while it holds;
4. otherwise, while every layer sent at the ``light`` codec (``int8`` by default: 8-bit codes
   summed by all_reduce, about half of ``fp16``'s bytes at a relative error of a few percent)
   fits the budget, every layer takes it (``light_floor=true``, the default: a second floor).
   A plan that mixed floor and light layers to fill the budget would lower an error that is
   already small, and pay for it in bytes that cost time whenever the exchange is not hidden
   behind computation (a job whose gradients are one DDP bucket overlaps none of it). No error
   is measured on this tier either;
5. otherwise, ``layerwise=true`` (Kimad+, the default): the knapsack over every layer of every
   bucket, each with the floor, the ``light`` codec and the codec at each of ``levels`` (a
   choice that would send no fewer bytes than the raw layer counts as the floor);
   ``layerwise=false`` (Kimad): the gentlest single level (floor, ``light``, then ``levels``)
   whose total fits. When nothing fits, every layer takes its strongest level.

The errors are measured every ``error_every`` steps while the budget is split (at once the
first time it must be; on a later return to the split the last errors serve its first plan and a
probe follows), by a local probe of every layer at every level
(on the layer plus its error-feedback residual, the tensor its codec is handed), max over ranks;
between probes the last ones stand, and only the budget moves. Hysteresis: a new budget within
``hysteresis`` (relative) of the one the running plan was solved for keeps the plan, so noise in
the timing does not flap it; within the split, any larger move, either way, re-solves at once.
Between tiers (floor, light, split): a budget under the running tier's bytes leaves it at once,
whatever the hysteresis; a gentler tier is taken once the budget holds its bytes with
``hysteresis`` to spare, and until then a split plan sends less than that tier's plan would
(the knapsack's budget is capped a byte under it). So a budget hovering at a tier's bytes (the
compute time it is sized from varies from step to step) flaps neither the tier nor the plan,
and the plan goes back to gentler tiers when the link recovers as it goes to stronger ones when
it drops, once the recovery is larger than the hysteresis.
Every rank decides from the same all-reduced figures, so all reach the same plan at the same step.
A decision is made one step after its figures: the all_reduce of a window's figures is launched
when the next step's first bucket is hooked, ahead of that step's exchange, and read back when the
step after starts, by which time it has long completed. Waiting for it at once would put a barrier
before every step's exchange: every rank would wait there for the slowest and only then encode,
where each could otherwise encode as soon as its own backward pass ends (measured on 4 emulated
hosts at 100 Mbit/s: 0.06 s a step). So a plan applies two steps after the step its figures end
with. The link is timed by a probe that the ranks send together: a decision waits for its
figures (the plan then applies at once) when the last one asked for it (``Plan.meet_next``),
every rank meets there, and right after it they send the probe
(:meth:`gradzip.control.auto_reducer.AutoReducer._send_probe`: two rounds of an all_reduce of one
element and of 20 ms of the link at the estimate, 64 KiB at least, at least the dense exchange
when the last probe was mostly latency; sized down when the exchange since shows the link fell,
:func:`~gradzip.control.link.probe_after`). A probe is asked for right after the first decision
(which waits, and reads the first window's exchange, issued together after DDP's construction),
whenever a step's exchange took more than :data:`STRAY` times, or less than its inverse, what the
estimate predicts for it (and more than :data:`STRAY_S` away from it), after a probe that read
the link more than :data:`SETTLED` times away from the estimate it left (older probes still
weigh in it: the link moved), and at least every ``link_every`` steps. An exchange's seconds
hold the ranks' skew (a rank that issues its collective late finds part of its peers' bytes
already sent; one that issues early waits for the late one): they tell that the link moved, not
by how much. Read from every step's exchange with no meeting, the estimate of a 20 Mbit/s link
on two emulated hosts spread from 14.8 to 27.5 Mbit/s; from the exchange after a meeting every
step, 18.8 to 21.4; from the probes, 20.1 to 20.8 (``tests/test_link_follow.py``, six runs). A
meeting costs
what waiting for the slowest rank costs, plus the probe: meeting every 4 steps to probe, the
meeting steps took 0.09 s longer than the others on 4 emulated hosts at 100 Mbit/s.
The first decision comes at step 2, from step 1's compute time and exchange (step 0 is left
out); until then every layer takes the floor. Starting at the light codec cost more on a fast
link than the floor's bytes cost on a slow one: on 4 emulated hosts, with a first window of 5
steps at ``int8``, steps 0 to 5 took 2.6 s longer than ``fp16``'s at 1 Gbit/s (the ``int8``
encode and decode of the first steps take up to 1.3 s a step on that loaded machine, against
0.03 s later), while at 100 Mbit/s the fixed ``int8`` codec pays the same in its own first steps.

Reproduced: the per-step budget from the bandwidth estimate and a target time, the per-layer
split minimising summed squared error by dynamic programming, and Kimad's uniform variant.
Added: the ``light`` choice between the floor and the codec's levels, which the paper does not
have (its candidates are one codec's ratios), and the tier that sends every layer at it before
the budget is split (``light_floor``): Kimad+ as the paper states it spends the whole budget.
Different: the paper's bandwidth monitor is not specified beyond the last transfers; here it is
the latency-aware fit above. The paper takes the target time as a setting; here it defaults to
the measured compute time per step (a fixed ``target_ms`` is still taken). The paper's lightest
choice is the uncompressed gradient; here it is the floor (``fp16`` unless ``floor=none``). The
paper's error feedback is EF21; here the plain residual of gradzip's reducers. Errors are
re-measured every ``error_every`` steps, not every step, since pricing every level costs one
encode per level and layer.

Spec: ``kimad[:codec=topk,levels=0.001/0.01/0.1,floor=fp16,light=int8,light_floor=true,target_ms=compute,
layerwise=true,error_every=10,units=1000,hysteresis=0.1,half_life=1,link_every=20]``; ``light=none`` leaves the
light codec out (it is left out past ``int8``'s 127 ranks, and always with ``codec=powersgd``);
``codec=powersgd`` splits ranks (levels ``1/2/4/8`` unless given; its floor is ``none``), a
quantizer bits (``2/4/8``). Codecs with an
exchange of their own other than PowerSGD's (``separate``, ``radius``, ``countsketch``) are
refused: the per-layer exchange does not run them.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradzip.comm.layered import INT8
from gradzip.compressors import REGISTRY, build
from gradzip.compressors.values import check_number
from gradzip.control import knapsack
from gradzip.control.figures import Plan, WindowFigures
from gradzip.control.layers import (
    DEFAULT_LEVELS,
    DENSE,
    Ladder,
    LayerSchedule,
    knob_of,
    levels_text,
    sent_bytes,
    settings_from,
)
from gradzip.control.link import Link, LinkEstimator, probe_after

NAME = "kimad"

#: the tiers of a plan: every layer at the floor, every layer at the light codec, the budget split
FLOOR, LIGHT, SPLIT = "floor", "light", "split"
ORDER = (FLOOR, LIGHT, SPLIT)  # gentlest first

#: an exchange that took more than this many times what the estimate predicts, or less than its
#: inverse, asks for a link probe
STRAY = 2.0
#: ... and by more than this many seconds (an exchange of a few ms on a fast link strays by more
#: than STRAY from its prediction with scheduling noise alone, and moves no budget)
STRAY_S = 0.01

#: a probe that read the link more than this factor away from the estimate it left (still
#: weighing older probes) asks for another
SETTLED = 1.1

#: steps over which the compute time per step is the median (``target_ms=compute``)
COMPUTE_STEPS = 9

#: what ``floor`` may be: the lightest choice of a layer
FLOORS = (DENSE, "fp16", "bf16")

#: the finest budget resolution: the dynamic programme holds layers x units numbers
MAX_UNITS = 100_000


@dataclass
class KimadConfig:
    """Settings of ``--compressor kimad`` (see the module docstring)."""

    codec: str = "topk"
    """The codec of every compressed layer; ``levels`` are its ratio (rank for powersgd, bits for quantizers)."""

    levels: Any = None
    """The candidate levels of every layer, ``/``-separated, besides the floor; unset:
    ``0.001/0.01/0.1`` for a ratio, ``1/2/4/8`` for a rank, ``2/4/8`` for bits."""

    floor: Any = None
    """The lightest choice of every layer: ``fp16``, ``bf16`` or ``none``; unset: ``fp16``, or
    ``none`` for a codec with its own exchange (PowerSGD), which mixes only with dense layers."""

    light: Any = None
    """A gentle codec (a registered name, at its defaults) between the floor and the levels;
    ``none`` for none; unset: ``int8``, or none with ``codec=powersgd`` (whose exchange mixes
    only with dense layers)."""

    light_floor: bool = True
    """Whether every layer takes the ``light`` codec while that fits the budget, before the
    knapsack splits it (a second floor); false: the knapsack as soon as the floor does not fit."""

    target_ms: Any = "compute"
    """The communication time per step the budget is sized for: milliseconds (> 0), or
    ``compute``, the step's measured compute time (step period less exchange, per window)."""

    layerwise: bool = True
    """Kimad+ (the budget split per layer by the knapsack); false: Kimad, one level for all layers."""

    error_every: int = 10
    """Steps between probes of every layer's error at every level."""

    units: int = 1000
    """Resolution of the budget in the dynamic programme."""

    hysteresis: float = 0.1
    """A budget within this fraction of the running plan's keeps the plan; a gentler tier (floor,
    light) is taken once the budget holds its bytes with this fraction to spare."""

    half_life: float = 1.0
    """Steps after which a link sample counts half."""

    link_every: int = 20
    """The most steps from one link probe to the next (one also comes whenever an exchange strays
    from the estimate; see the module docstring)."""

    def validate(self) -> KimadConfig:
        knob = knob_of(self.codec)
        ladder = Ladder(self.codec)
        kind = float if knob == "ratio" else int
        if self.levels is None:
            self.levels = DEFAULT_LEVELS[knob]
        # gentlest first: the largest ratio, rank or bits
        self.levels = tuple(sorted(set(levels_text(self.levels, name="levels", kind=kind)), reverse=True))
        for level in self.levels:
            ladder.build(level)
        own_exchange = ladder.build(self.levels[0]).multi_round
        if self.floor is None:
            self.floor = DENSE if own_exchange else "fp16"
        if self.floor not in FLOORS:
            raise ValueError(f"floor must be one of {', '.join(FLOORS)}; got {self.floor!r}")
        if own_exchange and self.floor != DENSE:
            raise ValueError(f"floor must be none with codec={self.codec}: its exchange mixes only with dense layers")
        # built apart from ``light`` itself, so that validating twice reads the user's value again
        self.light_codec = _light_codec(self.light, own_exchange=own_exchange, codec=self.codec)
        if self.target_ms != "compute":
            if isinstance(self.target_ms, str):
                raise ValueError(f"target_ms must be compute or a number of milliseconds > 0; got {self.target_ms!r}")
            check_number(self.target_ms, name="target_ms", low=0, low_open=True)
        check_number(self.hysteresis, name="hysteresis", low=0)
        check_number(self.half_life, name="half_life", low=0, low_open=True)
        for name in ("layerwise", "light_floor"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false; got {getattr(self, name)!r}")
        for name, low, high in (("error_every", 1, None), ("units", 10, MAX_UNITS), ("link_every", 1, 1000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                limit = f"between {low} and {high:,}" if high else f">= {low}"
                raise ValueError(f"{name} must be an integer {limit}; got {value!r}")
        return self


class KimadController(LayerSchedule):
    """Kimad and Kimad+ (see the module docstring)."""

    name = NAME
    min_window_steps = 1
    #: each decision applies one step after its figures are all-reduced (see the module docstring)
    decides_late = True
    #: the first window prices no layer: while the floor fits no error is needed
    probe_first_window = False

    def __init__(self, cfg: KimadConfig) -> None:
        self.cfg = cfg.validate()
        self.ladder = Ladder(cfg.codec)
        # a batch per probe, weighed by the step it was taken at
        self.link = LinkEstimator(half_life=cfg.half_life, keep=max(4, int(8 * cfg.half_life)), probe_every=1)
        self.probed_at: int | None = None  # the window that last carried a probe
        self._meet_next = False  # the last decision asked for a probe at the next
        self.layout: dict[Hashable, tuple[list[torch.Size], torch.dtype]] = {}
        self.errors: dict[Hashable, list[dict[str, float]]] = {}  # per layer: spec -> squared error
        self.plans: dict[Hashable, tuple[str, ...]] = {}
        self.budget: float | None = None  # bytes the running plan was solved for
        self.tier: str | None = None  # the running plan's tier: FLOOR, LIGHT or SPLIT
        self.since_probe = 0
        self.compute: list[float] = []  # the last steps' compute time (period less exchange), s
        self.world_size = 1  # the group's, from the first window's figures

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> KimadController:
        return cls(settings_from(KimadConfig, params, schedule=NAME))

    def floor(self, dtype: torch.dtype) -> str:
        """The floor of a layer whose gradient is ``dtype``: ``none`` where the floor would send
        no fewer bytes than the raw gradient (an fp16 or bf16 gradient)."""
        return _floor_for(self.cfg.floor, dtype)

    def candidates(self, shape: torch.Size, dtype: torch.dtype) -> list[str]:
        """A layer's candidate specs: the floor first, then the levels gentlest first (a level
        that would not send fewer bytes than the raw layer counts as the floor; repeats dropped)."""
        specs = []
        for spec in self._by_level(shape, dtype):
            if spec not in specs:
                specs.append(spec)
        return specs

    def _by_level(self, shape: torch.Size, dtype: torch.dtype) -> list[str]:
        """A layer's spec at each level, gentlest first: the floor, the light codec (where the
        world size allows it), then ``levels``; a choice that would not send fewer bytes than the
        raw layer is the floor."""
        floor = self.floor(dtype)
        out = [floor]
        light = self.cfg.light_codec
        if self._light_usable():
            numel = torch.Size(shape).numel()
            out.append(light.spec if light.payload_nbytes(numel, dtype) < numel * dtype.itemsize else floor)
        return out + [self._level_spec(level, shape, dtype) for level in self.cfg.levels]

    def _level_spec(self, level: Any, shape: torch.Size, dtype: torch.dtype) -> str:
        spec = self.ladder.spec(level, shape, dtype)
        return self.floor(dtype) if spec == DENSE else spec

    def first_window_steps(self) -> int:
        """The first decision comes at step 2, from step 1 alone (step 0 is left out)."""
        return 1

    def begin(self, world_size: int) -> None:
        """Start on the floor, unless resumed in a tier; a resumed run on a group the light
        codec cannot sum over drops the plans that use it."""
        resumed = self.tier is not None
        self.world_size = world_size
        if not resumed:
            self.tier = FLOOR
        elif not self._light_usable() and self.cfg.light_codec is not None:
            light = self.cfg.light_codec.spec
            self.plans = {k: p for k, p in self.plans.items() if light not in p}
            if self.tier == LIGHT:
                self.tier = FLOOR

    def layer_plan(self, key: Hashable, shapes: Sequence[torch.Size], dtype: torch.dtype, step: int) -> tuple[str, ...]:
        self.layout[key] = ([torch.Size(s) for s in shapes], dtype)
        plan = self.plans.get(key)
        if plan is not None and len(plan) == len(shapes):
            return plan
        # a bucket not planned yet: the running tier's plan (the floor's while the split runs)
        return self._light_plan(key) if self.tier == LIGHT else self._floor_plan(key)

    def probe_specs(self, key: Hashable, shapes: Sequence[torch.Size]) -> list[list[str]]:
        """Every candidate of every layer but ``none`` (whose error is 0)."""
        dtype = self.layout.get(key, (None, torch.float32))[1]
        return [[s for s in self.candidates(torch.Size(shape), dtype) if s != DENSE] for shape in shapes]

    def decide(self, window: WindowFigures) -> Plan:
        self.world_size = window.world_size
        # the link is timed by the probe the ranks send together where they meet, and by the
        # first window's exchange (issued together after DDP's construction) until there is one
        probed = window.probe_s > 0
        timed = probed or (window.met and self.link.link is None)
        link = self.link.add(window.link_samples(), at=window.start) if timed else self.link.link
        if probed:
            self.probed_at = window.start
        self._meet_next = self._wants_probe(window, link, probed=probed)
        plan = self._plan(window, link)
        plan.meet_next = self._meet_next
        return plan

    def _plan(self, window: WindowFigures, link: Link | None) -> Plan:
        """The plan from this window's figures and the current link estimate."""
        refreshed = False
        for b in window.buckets:
            if b.layers and any(layer.errors for layer in b.layers):
                probed = self.probe_specs(b.key, [layer.shape for layer in b.layers])
                self.errors[b.key] = [dict(zip(specs, layer.errors)) for specs, layer in zip(probed, b.layers)]
                refreshed = True
        self.since_probe = 0 if refreshed else self.since_probe + 1
        keys = [b.key for b in window.buckets if b.key in self.layout]
        if link is None or not keys:
            return Plan({}, 1, {}, "measuring the link", False, quiet=True)
        collectives = sum(b.collectives for b in window.buckets)
        target_s = self.target_s(window)
        if target_s is None:
            return Plan({}, 1, {}, "measuring the compute time per step", False, quiet=True)
        budget = link.bytes_within(target_s, collectives)
        head = (f"link {link.mbit:,.1f} Mbit/s, {link.latency_s * 1e3:.2f} ms per collective, "
                f"target {target_s * 1e3:,.0f} ms, budget {budget / 1e6:,.3f} MB")
        tier = self._tier(keys, budget, window.world_size)
        probe_next = tier == SPLIT and self.since_probe + 1 >= self.cfg.error_every
        crossed = self.tier is not None and tier != self.tier  # hysteresis holds no plan across tiers
        if not refreshed and not crossed and self.budget is not None and _within(budget, self.budget, self.cfg.hysteresis):
            return Plan({}, 1, {}, f"{head}: within {self.cfg.hysteresis:.0%} of the plan's; kept", probe_next, quiet=True)
        for k in keys:  # a bucket with no candidate to price (1-D tensors under powersgd) waits for none
            if k not in self.errors and not any(self.probe_specs(k, self.layout[k][0])):
                self.errors[k] = [{} for _ in self.layout[k][0]]
        if tier == SPLIT and any(k not in self.errors for k in keys):
            return Plan({}, 1, {}, f"{head}: the budget must be split; pricing the layers", True, quiet=True)
        before = {k: self.plans.get(k) for k in keys}
        self.tier = tier
        if tier == FLOOR:
            self.plans.update({k: self._floor_plan(k) for k in keys})
        elif tier == LIGHT:
            self.plans.update({k: self._light_plan(k) for k in keys})
        else:
            # under the next gentler tier's bytes while the split holds: a budget in that tier's
            # hysteresis band must not buy the gentler plan (or a mix sending more) without it
            self._solve(keys, min(budget, self._split_cap(keys, window.world_size)), window.world_size)
        self.budget = budget
        if all(self.plans[k] == before[k] for k in keys):
            return Plan({}, 1, {}, f"{head}: re-planned, unchanged", probe_next, quiet=True)
        reasons = {k: f"bucket {k}: {_summary(self.plans[k])}" for k in keys}
        return Plan({}, 1, reasons, f"{head}: re-planned", probe_next)

    def _floor_plan(self, key: Hashable) -> tuple[str, ...]:
        """Every layer of bucket ``key`` at its floor."""
        shapes, dtype = self.layout[key]
        return (self.floor(dtype),) * len(shapes)

    def _light_plan(self, key: Hashable) -> tuple[str, ...]:
        """Every layer of bucket ``key`` at the light codec (the floor where it would not send
        fewer bytes than the raw layer)."""
        shapes, dtype = self.layout[key]
        return tuple(self._by_level(s, dtype)[1] for s in shapes)

    def _tier(self, keys: list[Hashable], budget: float, world_size: int) -> str:
        """FLOOR while every layer at the floor fits ``budget``, else LIGHT while every layer
        at the light codec does (``light_floor``, where the light codec is a candidate), else SPLIT.

        A tier gentler than the running one needs its bytes with ``hysteresis`` to spare; the
        running tier and stronger ones need only to fit. So the plan leaves a tier at once when
        the budget falls under it, and a budget hovering at a tier's bytes does not flap."""

        def fits(tier: str, plan_of) -> bool:
            spare = 1.0 if self.tier is None or ORDER.index(tier) >= ORDER.index(self.tier) else 1.0 + self.cfg.hysteresis
            return budget >= spare * self._plan_bytes(keys, plan_of, world_size)

        if fits(FLOOR, self._floor_plan):
            return FLOOR
        if self._light_tier() and fits(LIGHT, self._light_plan):
            return LIGHT
        return SPLIT

    def _light_usable(self) -> bool:
        """Whether the light codec is a candidate: set, and summing over the group's ranks."""
        light = self.cfg.light_codec
        return light is not None and self.world_size <= (light.max_world_size or self.world_size)

    def _light_tier(self) -> bool:
        """Whether the light tier is taken: ``light_floor`` and a usable light codec."""
        return self.cfg.light_floor and self._light_usable()

    def _split_cap(self, keys: list[Hashable], world_size: int) -> float:
        """The most a split plan may send: a byte less than every layer at the light codec
        (where that tier is taken), else than every layer at the floor."""
        gentler = self._plan_bytes(keys, self._light_plan if self._light_tier() else self._floor_plan, world_size)
        return max(gentler - 1, 0)

    def _plan_bytes(self, keys: list[Hashable], plan_of, world_size: int) -> int:
        """Bytes one rank sends per step with the layers of ``keys`` planned by ``plan_of(key)``."""
        total = 0
        for k in keys:
            shapes, dtype = self.layout[k]
            total += sum(sent_bytes(spec, s, dtype, world_size) for spec, s in zip(plan_of(k), shapes))
        return total

    def target_s(self, window: WindowFigures) -> float | None:
        """Seconds of communication per step the budget is sized for: ``target_ms``, or the
        compute time per step, the median of the last :data:`COMPUTE_STEPS` windows' step period
        less their exchange (at least 0; windows without a period are left out); None until
        one is measured. Call once per window."""
        if self.cfg.target_ms != "compute":
            return self.cfg.target_ms / 1e3
        if window.period_s > 0:
            self.compute = [*self.compute, max(0.0, window.period_s - window.exchange_s)][-COMPUTE_STEPS:]
        return statistics.median(self.compute) if self.compute else None

    def _solve(self, keys: list[Hashable], budget: float, world_size: int) -> None:
        items = []  # (key, layer, specs, errors, bytes, the spec of each level, dense first)
        for key in keys:
            shapes, dtype = self.layout[key]
            errors = self.errors[key]
            if len(errors) != len(shapes):
                continue
            for i, shape in enumerate(shapes):
                specs = self.candidates(shape, dtype)
                errs = [0.0 if s == DENSE else errors[i].get(s, 0.0) for s in specs]
                sizes = [sent_bytes(s, shape, dtype, world_size) for s in specs]
                by_level = self._by_level(shape, dtype)
                items.append((key, i, specs, errs, sizes, by_level))
        choice = self._choose(items, budget)
        plans = {key: list(self._floor_plan(key)) for key in keys}
        for (key, i, specs, *_), c in zip(items, choice):
            plans[key][i] = specs[c]
        self.plans.update({key: tuple(plan) for key, plan in plans.items()})

    def _choose(self, items: list, budget: float) -> list[int]:
        """The candidate index of every item within ``budget`` bytes (see the module docstring)."""
        strongest = [min(range(len(sizes)), key=lambda c, sizes=sizes: (sizes[c], -c)) for *_, sizes, _ in items]
        if budget <= 0 or not items:
            return strongest
        if not self.cfg.layerwise:
            # Kimad: one level for every layer, the gentlest whose bytes fit (the floor first).
            for level in range(len(items[0][5])):
                pick = [specs.index(by_level[level]) for _, _, specs, _, _, by_level in items]
                if sum(sizes[c] for (*_, sizes, _), c in zip(items, pick)) <= budget:
                    return pick
            return strongest
        weights, capacity = knapsack.discretise([sizes for *_, sizes, _ in items], budget, self.cfg.units)
        choice = knapsack.solve([errs for _, _, _, errs, _, _ in items], weights, capacity)
        return strongest if choice is None else choice

    def _wants_probe(self, window: WindowFigures, link: Link | None, *, probed: bool) -> bool:
        """Whether the next decision should meet and probe the link (see the module docstring)."""
        if link is None:
            return False
        if self.probed_at is None or window.start - self.probed_at >= self.cfg.link_every:
            return True
        rate = self.link.last_rate
        if probed and rate is not None and not link.bytes_per_s / SETTLED <= rate <= link.bytes_per_s * SETTLED:
            return True  # the estimate is still moving towards what the probe read
        exchange = window.exchange_sample()
        if exchange is None:
            return False
        collectives, sent, seconds = exchange
        predicted = link.seconds(sent, collectives)
        return abs(seconds - predicted) > STRAY_S and not predicted / STRAY <= seconds <= predicted * STRAY

    def probe_bytes(self) -> int:
        """The link probe for the next decision, when the last asked to meet there (a
        calibration; at least the buckets' dense bytes when the last probe was mostly latency;
        see :meth:`LinkEstimator.probe_bytes`)."""
        if not self._meet_next:
            return 0
        dense = sum(sum(s.numel() for s in shapes) * dtype.itemsize for shapes, dtype in self.layout.values())
        return self.link.probe_bytes(dense, calibrate=True)

    def size_probe(self, window: WindowFigures, asked: int) -> int:
        """The probe to send now (:func:`~gradzip.control.link.probe_after`: sized down when
        this window's exchange shows that the link fell since ``asked`` was sized)."""
        return probe_after(self.link.link, window.exchange_sample(), asked)

    def link_estimate(self) -> Link | None:
        """The current estimate of the link (what the reducer records each window)."""
        return self.link.link

    def state_dict(self) -> dict[str, Any]:
        return {"link": self.link.state_dict(), "errors": {k: [dict(e) for e in v] for k, v in self.errors.items()},
                "plans": {k: list(v) for k, v in self.plans.items()}, "budget": self.budget,
                "since_probe": self.since_probe, "compute": list(self.compute), "tier": self.tier,
                "world_size": self.world_size, "probed_at": self.probed_at, "meet_next": self._meet_next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.link.load_state_dict(state["link"])
        self.errors = {k: [dict(e) for e in v] for k, v in state["errors"].items()}
        self.plans = {k: tuple(v) for k, v in state["plans"].items()}
        self.budget, self.since_probe = state["budget"], state["since_probe"]
        self.compute = list(state["compute"])
        # a state saved before the tiers: on_floor true was the floor, false the split
        self.tier = state.get("tier", {True: FLOOR, False: SPLIT}.get(state.get("on_floor")))
        self.world_size = state.get("world_size", 1)
        self.probed_at = state.get("probed_at")
        self._meet_next = bool(state.get("meet_next", False))


def _light_codec(light: Any, *, own_exchange: bool, codec: str):
    """The built ``light`` codec of a Kimad config (unset: ``int8``), or None (``none``; unset
    beside a ladder codec with its own exchange).

    Raises:
        ValueError: for an unknown name, the ladder's own codec, a codec the per-layer exchange
            does not run, or a light codec beside ``codec=powersgd``.
    """
    if light is None:
        light = DENSE if own_exchange else INT8
    if light == DENSE:
        return None
    if own_exchange:
        raise ValueError(f"light must be none with codec={codec}: its exchange mixes only with dense layers")
    if not isinstance(light, str) or light not in REGISTRY:
        raise ValueError(f"light must be a registered codec name or none; got {light!r}")
    if light == codec:
        raise ValueError(f"light must be another codec than {codec}, whose strengths are the levels")
    built = build(light)
    if built.multi_round and built.name != INT8:
        raise ValueError(f"light must be int8 or a single-round codec; {light} has its own exchange")
    return built


@functools.lru_cache(maxsize=64)
def _floor_for(floor: str, dtype: torch.dtype) -> str:
    # cached: every plan asks it for every layer
    if floor == DENSE or build(floor).payload_nbytes(1, dtype) >= dtype.itemsize:
        return DENSE
    return floor


def _within(value: float, reference: float, fraction: float) -> bool:
    if reference <= 0:
        return value <= 0
    return abs(value / reference - 1) <= fraction


def _summary(plan: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for spec in plan:
        counts[spec] = counts.get(spec, 0) + 1
    return ", ".join(f"{spec} x{n}" for spec, n in counts.items())

