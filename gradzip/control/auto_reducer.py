"""A reducer that picks a codec per bucket and changes its mind only between windows of steps.

Used by ``--compressor auto``. It holds one reducer per candidate codec (the first is always
``none``, the dense all_reduce) and, per bucket, the index of the candidate in use. Steps are
grouped in windows ``[start, end)``; over a window it gathers, per bucket, the bytes and seconds
of its collectives, the sum of its gradients (for schedules that read it), and at the window's
last step a local probe of every candidate (encode, decode: seconds, payload, relative error; no
collective). At the first call of step ``end`` it all-reduces these figures with ``MAX``
(figures wanted as a minimum are negated), through the group's
:class:`~gradzip.comm.queue.CollectiveQueue`, so the extra collective takes the same place in
the order on every rank, and waits for it: one small all_reduce per window, issued where every
rank has finished the previous step. The controller turns the reduced figures (identical on
every rank) into a :class:`Plan`, which applies from step ``end`` on: every rank makes the same
decisions, at the same step, with no step of delay. A controller that decides every step
(``decides_late``: Kimad) has the all_reduce launched there and not waited for: it goes ahead of
the step's exchange in the queue, and is read back when step ``end + 1`` starts, from which its plan
applies. Waiting for it every step would hold every rank's exchange until the slowest rank's
backward pass had ended, instead of letting each rank encode as soon as its own had. Such a
controller still waits at its first decision, and at the step a plan asks for it
(``Plan.meet_next``): every rank meets there and leaves together, so the link probe sent right
after (and the window's exchange that follows, ``met``) time the link free of the ranks' skew.

When a bucket changes codec its error-feedback residual is taken from the old reducer and added
to the bucket's next gradient before the new codec sees it, so nothing compression dropped is
lost, whatever the new codec keeps (a dense exchange sends it whole).

The candidate reducers share one :class:`~gradzip.comm.nonfinite.StepLedger`: a step skipped for a
non-finite gradient in any bucket is put back in every candidate's state, and a non-finite
gradient does not enter the window's gradient sums.

Besides the buckets' figures, each window reports what a link estimate needs whatever codec runs
(:meth:`WindowFigures.link_samples`): the seconds with a collective in flight in the window's
least-disturbed step against the bytes and collectives of a step, and the seconds of the previous window's own figure
all_reduce, a sample of the latency at almost no bytes. A controller that estimates the link
(``link_estimate``) has its estimate put in :attr:`StepMetrics.link` after every decision, so that
every step's record carries the estimate in force. Schedules that read the gradient's
entropy (``entropy_every`` > 0) get the entropy of the averaged result at every such step.

:class:`~gradzip.control.layer_reducer.LayerAutoReducer` runs the per-layer schedules (Kimad,
LEGACY, EDGC) on the same windows.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import nonfinite, own_reducer
from gradzip.comm.devices import collective_device
from gradzip.comm.powersgd import PowerSGDReducer
from gradzip.comm.queue import CollectiveQueue
from gradzip.comm.reducer import CompressedReducer
from gradzip.comm.traffic import allreduce_bytes
from gradzip.compressors import Compressor, build
from gradzip.control.auto import runnable
from gradzip.control.figures import BucketFigures, CandidateFigures, Plan, WindowFigures
from gradzip.keys import label, regroup, tensor_key
from gradzip.metrics import StepMetrics, quality_figures

# numel, itemsize, payload_bytes, sent_bytes, -communicate_s, collectives, gradient_sum_norm,
# running_error
_BUCKET_FIELDS = 8
# compress_s, decompress_s, payload_bytes, sent_bytes, collectives, relative_error
_CANDIDATE_FIELDS = 6
MIN_WINDOW_STEPS = 3
#: rounds of a link probe; each of its two all_reduces is timed by its fastest round
PROBE_ROUNDS = 2


class Controller(Protocol):
    """Turns a window's figures into a plan; must be a deterministic function of what it saw."""

    needs_gradient_sum: bool
    #: measure the running codec's error on every window's last step, not only when probing all
    checks_running_error: bool
    #: sample the averaged gradient's entropy every this many steps (0: never)
    entropy_every: int

    def first_window_steps(self) -> int: ...

    def decide(self, window: WindowFigures) -> Plan: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class AutoReducer:
    """Per-bucket choice among ``candidates``, decided by ``controller`` between windows.

    Args:
        candidates: codec specs or codecs; ``none`` is put first if absent. Lossy single-round
            codecs run with error feedback (non-aggregatable ones through all_gather, whose
            residual is all worker-side and so moves with a switch); PowerSGD and ``int8`` keep their
            own and hand it over at a switch.
            Nothing is held back for a fused exchange (``min_compress_bytes`` is 0).
        controller: see :class:`Controller` (``gradzip.control.auto`` builds them).
        group: the process group (None: the default group).
        queue: the group's ordered launch queue, shared with every reducer of the group.
        metrics: where bytes, times and decision events go.

    Raises:
        ValueError: for a bad spec or fewer than two candidates.
    """

    def __init__(
        self,
        candidates: Sequence[str | Compressor],
        controller: Controller,
        *,
        group: dist.ProcessGroup | None = None,
        queue: CollectiveQueue | None = None,
        metrics: StepMetrics | None = None,
    ) -> None:
        named = [(c if isinstance(c, str) else c.spec, build(c)) for c in candidates]
        named = [("none", build("none"))] + [(n, c) for n, c in named if c.name != "none"]
        codecs = [c for _, c in named]
        if len(codecs) < 2:
            raise ValueError("auto needs at least one candidate besides none")
        specs = [c.spec for c in codecs]
        if len(set(specs)) != len(specs):
            raise ValueError(f"auto candidates repeat a codec: {', '.join(specs)}")
        self.codecs = codecs
        self.specs = specs
        #: the candidates as the user wrote them, for decisions and reasons
        self.names = [n.strip() for n, _ in named]
        self._start(controller, group, queue, metrics)
        self.reducers = [self._make(c) for c in codecs]

    def _start(
        self, controller: Controller, group: dist.ProcessGroup | None, queue: CollectiveQueue | None,
        metrics: StepMetrics | None,
    ) -> None:
        """The state every auto reducer keeps: controller, group, choices and the window."""
        self.controller = controller
        self.group = group
        self.queue = queue or CollectiveQueue()
        self.metrics = metrics or StepMetrics()
        self.ledger = nonfinite.StepLedger()
        self.choices: dict[Hashable, int] = {}
        self.carry: dict[Hashable, Tensor] = {}
        # the carries this step handed to its buckets (and what of each did not fit the gradient's
        # dtype): given back if the step turns out non-finite, when the next step starts
        self._spent: dict[Hashable, tuple[Tensor, Tensor | None]] = {}
        self._spent_step: int | None = None
        self.shapes: dict[Hashable, list[torch.Size]] = {}
        self._itemsize: dict[Hashable, int] = {}
        self.forced: dict[int, dict[Hashable, int]] = {}
        # Window state. Step 0 is left out: DDP rebuilds its buckets after it.
        self.window_start = 1
        self.window_end = 1 + max(self._min_window_steps(), controller.first_window_steps())
        self.probe_this_window = getattr(controller, "probe_first_window", True)
        self._first_decision = self.window_end
        self._meet_next = False  # the last plan asked the next decision to wait (Plan.meet_next)
        # whether the window's first exchange followed a figure all_reduce every rank waited for
        # (the first window's follows DDP's construction, where the ranks met)
        self._window_met = True
        # a decision a step late: the figures launched at the last window's end, and the next
        # window's length and probe as the last decision asked
        self._pending: dict[str, Any] | None = None
        self._next_window: tuple[int, bool] = (0, False)
        self._order: list[Hashable] = []
        self._seen: set[Hashable] = set()  # buckets hooked in this window (DDP's layout may change)
        self._periods: list[float] = []
        self._sums: dict[Hashable, Tensor] = {}
        self._step_sums: dict[Hashable, tuple[int, Tensor]] = {}  # this step's gradients, not yet settled
        self._probes: dict[Hashable, list[dict[str, float]]] = {}
        # ||x|| of what the running codec was handed on the window's last step, per bucket
        self._handed_norms: dict[Hashable, float] = {}
        self._totals_at_start: dict[Hashable, dict[str, float]] = {}
        self._step: int | None = None
        self._step_first_s: float | None = None
        self.last_plan: Plan | None = None
        self._in_flight_at_start = 0.0
        self._exchange: list[float] = []  # per step of the window: encode + in flight + decode seconds
        self._in_flight: list[float] = []  # per step of the window: seconds with a collective in flight
        self._exchange_mark: float | None = None
        self._in_flight_mark = 0.0
        self._entropy_steps: dict[int, float] = {}
        self._figures_s = 0.0  # the previous window's figure all_reduce
        self._figures_bytes = 0.0
        self._probe_bytes = 0  # the link probe the controller asked for, sent at the next decision
        self._entropy_lock = threading.Lock()

    def _make(self, codec: Compressor):
        if not runnable(codec):
            raise ValueError(f"auto candidates take powersgd, int8 and single-round codecs, not {codec.name}")
        if codec.multi_round:
            return own_reducer(codec, group=self.group, queue=self.queue, metrics=self.metrics, ledger=self.ledger)
        return CompressedReducer(
            codec, group=self.group, error_feedback=codec.name != "none",
            collective="auto" if codec.aggregatable else "allgather", queue=self.queue, metrics=self.metrics,
            ledger=self.ledger,
        )

    # -- the hook's entry point ------------------------------------------------------------

    def reduce(
        self, key: Hashable, grad: Tensor, *, step: int, shapes: Sequence[torch.Size] | None = None,
        flush: bool = True,
    ) -> Future:
        """Average ``grad`` over the group with the codec currently chosen for ``key``.

        Args, Returns: as :meth:`gradzip.comm.reducer.CompressedReducer.reduce`.
        """
        if step != self._step:
            self._start_step(step)
        shapes = [torch.Size(s) for s in shapes] if shapes is not None else [grad.shape]
        if self.shapes.get(key) != shapes and key in self.shapes:
            # DDP rebuilt its buckets: a residual of the old layout means nothing in the new one.
            self.carry.pop(key, None)
        in_window = self._track(key, grad, step, shapes)
        if in_window and self.controller.needs_gradient_sum and nonfinite.is_finite(grad):
            # held until the step is settled: a step some rank skipped (a non-finite gradient
            # there) must not enter the window's sums
            self._step_sums[key] = (step, grad.detach().float().clone())
        if in_window and step == self.window_end - 1:
            checks = getattr(self.controller, "checks_running_error", False) and self.choices.get(key, 0) != 0
            if self.probe_this_window or checks:
                x = self._handed(key, grad)
                if self.probe_this_window:
                    self._probe(key, x, step, shapes)
                if checks:
                    self._handed_norms[key] = float(torch.linalg.vector_norm(x.float()))
        carry = self.carry.pop(key, None)
        if carry is None and regroup(self.carry, key) is not None:  # DDP laid its parameters out anew
            carry = self.carry.pop(key)
        if carry is not None and carry.numel() == grad.numel():
            grad, excess = with_carry(grad, carry)
            self._spent[key], self._spent_step = (carry, excess), step
        fut = self.reducers[self.choices.get(key, 0)].reduce(key, grad, step=step, shapes=shapes, flush=flush)
        return self._sample_entropy(fut, step)

    def _track(self, key: Hashable, grad: Tensor, step: int, shapes: list[torch.Size]) -> bool:
        """Note that bucket ``key`` was hooked at ``step`` (its layout, and that the window saw
        it, so that its figures go into the window's all_reduce); returns whether ``step`` is in
        the open window."""
        self.shapes[key] = shapes
        self._itemsize[key] = grad.element_size()
        if key not in self._order:
            self._order.append(key)
        in_window = self.window_start <= step < self.window_end
        if in_window:
            self._seen.add(key)
        return in_window

    def _sample_entropy(self, fut: Future, step: int) -> Future:
        """At the steps the controller samples, add the entropy of the averaged bucket (the same
        tensor on every rank) to the step's sum when it arrives."""
        every = getattr(self.controller, "entropy_every", 0)
        if not every or step % every or not self.window_start <= step < self.window_end:
            return fut

        def sample(done: Future) -> Tensor:
            value = done.value()
            entropy = self.controller.entropy(value)
            with self._entropy_lock:
                self._entropy_steps[step] = self._entropy_steps.get(step, 0.0) + entropy
            return value

        return fut.then(sample)

    def flush(self) -> None:
        """Nothing is held back (see the constructor); kept for the reducer interface."""
        for reducer in self.reducers:
            reducer.flush()

    def settle(self) -> None:
        """Settle every candidate's open step (see :meth:`CompressedReducer.settle`), the
        carries the step spent and the gradients it adds to the window's sums."""
        for reducer in self.reducers:
            reducer.settle()
        self._settle_carry()
        self._settle_sums()

    def _settle_sums(self) -> None:
        """Add the gradients of the step just ended to the window's sums, unless some rank
        skipped it (called between steps: at the next step's start, or before a state_dict)."""
        step_sums, self._step_sums = self._step_sums, {}
        for key, (step, grad) in step_sums.items():
            if not self.ledger.finite(step):
                continue
            total = self._sums.get(key)
            if total is None or total.shape != grad.shape:
                self._sums[key] = grad
            else:
                total += grad

    def force(self, at_step: int, choices: dict[Hashable, str | int]) -> None:
        """Make buckets use given candidates from ``at_step`` on (call identically on every rank).

        Raises:
            ValueError: for a candidate that is not in the list.
        """
        resolved = {}
        for key, choice in choices.items():
            index = choice if isinstance(choice, int) else self._index(choice)
            if not 0 <= index < len(self.codecs):
                raise ValueError(f"candidate index must be in [0, {len(self.codecs) - 1}]; got {index}")
            resolved[key] = index
        self.forced.setdefault(at_step, {}).update(resolved)

    def _index(self, spec: str) -> int:
        canonical = build(spec).spec
        if canonical not in self.specs:
            raise ValueError(f"{spec!r} is not an auto candidate; candidates: {', '.join(self.specs)}")
        return self.specs.index(canonical)

    # -- windows ---------------------------------------------------------------------------

    def _settle_carry(self) -> None:
        """Once the step that spent carries is over: keep what of each did not fit the gradient's
        dtype for the next step, or give the whole carry back if the step was skipped (a
        non-finite gradient on some rank), so that a skipped step loses nothing."""
        if self._spent_step is None:
            return
        kept = self.ledger.finite(self._spent_step)
        for key, (spent, excess) in self._spent.items():
            back = excess if kept else spent
            if back is not None:
                previous = self.carry.get(key)
                self.carry[key] = back if previous is None else previous + back.to(previous.dtype)
        self._spent, self._spent_step = {}, None

    def _start_step(self, step: int) -> None:
        self._settle_carry()
        self._settle_sums()
        now = time.perf_counter()
        previous = self._step
        if previous is not None and step == previous + 1 and self._step_first_s is not None:
            # The period of step `previous`: counted unless it opened the window (a switch, and
            # the wait for the figures) or closed a window that probes (the probe's encoding).
            # A window of one step (Kimad's, every step) counts its step unless it probes: a
            # switch there is rare (a re-plan), and nothing else would ever be measured.
            last = self.window_end - 1 if self.probe_this_window else self.window_end
            if self.window_start < previous < last or (self._one_step_window() and not self.probe_this_window):
                self._periods.append(now - self._step_first_s)
        self._step, self._step_first_s = step, now
        if step == self.window_start == 1:
            # The first window's figures start here, not at construction (step 0 is left out).
            self._totals_at_start = {k: dict(v) for k, v in self.metrics.totals.items()}
            self._in_flight_at_start = self.metrics.in_flight_total_s
        mark, flight = self._exchange_total(), self.metrics.in_flight_total_s
        if previous is not None and step == previous + 1 and self._exchange_mark is not None:
            if self.window_start < previous or self._one_step_window():  # the first step carries a switch
                self._exchange.append(mark - self._exchange_mark)
                self._in_flight.append(flight - self._in_flight_mark)
        self._exchange_mark, self._in_flight_mark = mark, flight
        if self._pending is not None and self._pending["step"] < step:
            pending, self._pending = self._pending, None
            self._resolve(pending, step, together=False)
        if step >= self.window_end:
            self._decide(step)
        if step in self.forced:
            for key, index in self.forced.pop(step).items():
                self._switch(key, index, step, reason="forced")

    def _exchange_total(self) -> float:
        """Seconds spent exchanging since construction: collectives in flight, encoding, decoding."""
        totals = self.metrics.totals.values()
        return self.metrics.in_flight_total_s + sum(t["compress_s"] + t["decompress_s"] for t in totals)

    def _decide(self, step: int) -> None:
        """Reduce the window's figures over the group, let the controller decide, and apply
        its plan from ``step`` on; with a controller that decides a step late
        (``decides_late``), launch the reduction and decide when the next step starts."""
        gathered = self._gather(step)
        if self._late() and not self._meets(step):
            self._pending = gathered
            self._open_window(step, *self._next_window, met=False)
            return
        plan = self._resolve(gathered, step, together=True)
        self._open_window(step, plan.window_steps, plan.probe_next, met=True)

    def _late(self) -> bool:
        return getattr(self.controller, "decides_late", False)

    def _meets(self, step: int) -> bool:
        """Whether the decision at ``step`` of a controller that decides late waits for its
        figures (every rank meets there): the first decision, and one the last plan asked for."""
        return step == self._first_decision or self._meet_next

    def _gather(self, step: int) -> dict[str, Any]:
        """The window's figures, their all_reduce launched (MAX over ranks): what
        :meth:`_resolve` reads back, waiting for it."""
        order = [k for k in self._order if k in self._seen]
        # a list of its own: a late decision reads `order` back a step later, by when _track may
        # have added buckets (a fresh DDP's first layout) to self._order
        self._order = list(order)
        probed = self.probe_this_window and all(k in self._probes for k in order)
        steps = max(1, self.window_end - self.window_start)
        values: list[float] = []
        for key in order:
            now = self.metrics.totals.get(key, {})
            start = self._totals_at_start.get(key, {})

            def delta(name: str, now=now, start=start) -> float:
                return (now.get(name, 0.0) - start.get(name, 0.0)) / steps

            numel = sum(s.numel() for s in self.shapes[key])
            total = self._sums.get(key)
            values += [
                float(numel),
                float(self._itemsize.get(key, 4)),
                delta("payload_bytes"),
                delta("sent_bytes"),
                -delta("communicate_s"),
                delta("collectives"),
                float(total.norm()) if total is not None else 0.0,
                self._running_error(key),
            ]
            values += self._probe_values(key, probed)
        sampled = self._sampled_steps()
        values += [self._entropy_steps.get(t, 0.0) for t in sampled]
        period = statistics.median(self._periods) if self._periods else 0.0
        in_flight = self._window_in_flight(steps)
        exchange = statistics.fmean(self._exchange) if self._exchange else 0.0
        values += [period, -in_flight, exchange, -self._figures_s]
        # On the device the group's collectives take (CUDA for NCCL): the decision reads the
        # reduced figures on the host anyway, once per window.
        stats = torch.tensor(values, dtype=torch.float64).to(collective_device(self.group))
        # Under DDP every collective of the previous step has completed before this step's
        # first bucket is hooked, so this one launches at once: waited for, it is one small
        # all_reduce issued where all ranks meet anyway (a barrier); not waited for, it goes
        # ahead of this step's exchange in the group's queue and is back before the next step.
        began = time.perf_counter()
        done_at: list[float] = []

        def launch() -> Future:
            fut = dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=self.group, async_op=True).get_future()
            fut.add_done_callback(lambda _fut: done_at.append(time.perf_counter()))
            return fut

        return {"stats": stats, "future": self.queue.submit(launch, device=stats.device), "began": began,
                "done_at": done_at, "order": order, "probed": probed, "n_sampled": len(sampled),
                "window": (self.window_start, self.window_end), "step": step, "extra": self._gather_extra(),
                "met": self._window_met}

    def _resolve(self, gathered: dict[str, Any], step: int, *, together: bool) -> Plan:
        """Read back what :meth:`_gather` launched (waiting for it), let the controller decide
        and apply its plan from ``step`` on. ``together``: every rank has just left the
        figures' all_reduce, so the link probe asked for is sent now (else it waits for such
        a decision)."""
        if "values" not in gathered:
            _settle_gathered(gathered)
        order, device = gathered["order"], collective_device(self.group)
        window = self._unpack(gathered["values"], order, gathered["probed"], gathered["n_sampled"], *gathered["window"],
                              gathered["extra"])
        self._figures_s = gathered["figures_s"]
        self._figures_bytes = float(allreduce_bytes(8 * len(gathered["values"]), window.world_size))
        window.met = bool(gathered.get("met", True))
        if together:
            self._send_probe(window, device)
            self._probe_bytes = 0
        plan = self.controller.decide(window)
        self.last_plan = plan
        self._meet_next = plan.meet_next
        self._probe_bytes = max(self._probe_bytes, getattr(self.controller, "probe_bytes", lambda: 0)())
        self._apply(plan, order, step)
        link = getattr(self.controller, "link_estimate", lambda: None)()
        if link is not None:  # in every step's record from here on (StepMetrics.pop)
            self.metrics.link = {"mbit": link.mbit, "latency_ms": link.latency_s * 1e3, "step": step}
        if not plan.quiet:
            self.metrics.add_event({
                "kind": "auto", "schedule": getattr(self.controller, "name", "auto"), "step": step,
                "window": [window.start, window.end], "period_s": window.period_s,
                "figures_s": window.figures_s, "probe_s": window.probe_s, "probe_bytes": window.probe_bytes,
                "probe_latency_s": window.probe_latency_s,
                "note": plan.note, "choices": self._event_choices(order),
                "reasons": {label(k): r for k, r in plan.reasons.items()},
            })
        self._next_window = (plan.window_steps, plan.probe_next)
        return plan

    def _gather_extra(self) -> dict[str, Any]:
        """What a subclass's :meth:`_probe_figures` reads besides the reduced values, as the
        window ended (kept with them)."""
        return {}

    def _open_window(self, step: int, window_steps: int, probe: bool, *, met: bool) -> None:
        """Start the window ``[step, step + window_steps)`` (at least the controller's minimum);
        ``met``: its first exchange follows a figure all_reduce that every rank waited for."""
        self._window_met = met
        self.window_start = step
        self.window_end = step + max(self._min_window_steps(), window_steps)
        self.probe_this_window = probe
        self._periods = []
        self._seen = set()
        self._sums = {}
        self._probes = {}
        self._handed_norms = {}
        self._entropy_steps = {}
        self._exchange = []
        self._in_flight = []
        self._totals_at_start = {k: dict(v) for k, v in self.metrics.totals.items()}
        self._in_flight_at_start = self.metrics.in_flight_total_s

    def _send_probe(self, window: WindowFigures, device: torch.device) -> None:
        """The link probe the controller asked for at the last decision (none if it asked for 0
        bytes; a controller with ``size_probe`` may size it down from this window's figures):
        :data:`PROBE_ROUNDS` rounds of an all_reduce of one element (the latency) and
        one of the asked bytes (the bandwidth), each timed by its fastest round, then those
        times' minimum over ranks (one more small all_reduce), written into ``window``.

        It is issued right after the figure all_reduce, which every rank has just left: the
        ranks issue it together, so its seconds are the link's. (An exchange of the step is
        issued when each rank's bucket is ready; a rank that issues tens of ms after its peer
        makes gloo's collective take longer on both, beyond the wait itself, so the exchange's
        own seconds read the link slow when the ranks' encodes differ.) A rank descheduled
        during a round only adds time, hence the fastest round."""
        size = getattr(self.controller, "size_probe", None)
        nbytes = size(window, self._probe_bytes) if size is not None else self._probe_bytes
        if nbytes <= 0:
            return
        timed = [torch.zeros(1, dtype=torch.float64, device=device),
                 torch.zeros(max(1, nbytes // 8), dtype=torch.float64, device=device)]
        seconds: list[list[float]] = [[], []]
        for _ in range(PROBE_ROUNDS):
            for zeros, times in zip(timed, seconds):
                began = time.perf_counter()
                self._all_reduce(zeros, dist.ReduceOp.SUM)
                times.append(time.perf_counter() - began)
        fastest = torch.tensor([-min(t) for t in seconds], dtype=torch.float64, device=device)
        self._all_reduce(fastest, dist.ReduceOp.MAX)
        small_s, big_s = (-float(x) for x in fastest.tolist())
        window.probe_latency_s, window.probe_s = small_s, big_s
        window.probe_latency_bytes, window.probe_bytes = (
            float(allreduce_bytes(z.numel() * z.element_size(), window.world_size)) for z in timed)

    def _all_reduce(self, tensor: Tensor, op: dist.ReduceOp) -> None:
        """An all_reduce through the group's ordered queue, waited for."""

        def launch() -> Future:
            return dist.all_reduce(tensor, op=op, group=self.group, async_op=True).get_future()

        self.queue.submit(launch, device=tensor.device).wait()

    def _window_in_flight(self, steps: int) -> float:
        """Seconds with a collective in flight in the window's least-disturbed step (its steps
        less the first; the mean over ``steps`` when there are none, a window of one step).

        The least-disturbed step times the link: a rank descheduled while its collective is in
        flight only adds to the step's seconds (on a loaded machine, tens of ms to an exchange
        of one)."""
        if self._in_flight:
            return min(self._in_flight)
        return (self.metrics.in_flight_total_s - self._in_flight_at_start) / steps

    def _one_step_window(self) -> bool:
        return self.window_end - self.window_start == 1

    def _min_window_steps(self) -> int:
        return getattr(self.controller, "min_window_steps", MIN_WINDOW_STEPS)

    def _sampled_steps(self) -> list[int]:
        every = getattr(self.controller, "entropy_every", 0)
        return [t for t in range(self.window_start, self.window_end) if every and t % every == 0]

    def _apply(self, plan: Plan, order: list[Hashable], step: int) -> None:
        for key in order:
            index = plan.choices.get(key, self.choices.get(key, 0))
            self._switch(key, index, step, reason=plan.reasons.get(key, ""))

    def _event_choices(self, order: list[Hashable]) -> dict[str, Any]:
        return {label(k): self.names[self.choices.get(k, 0)] for k in order}

    def _probe_values(self, key: Hashable, probed: bool) -> list[float]:
        """The probe figures of bucket ``key`` for the window's all_reduce (zeros if not probed)."""
        probes = self._probes.get(key) if probed else None
        values: list[float] = []
        for c in range(len(self.codecs)):
            if probes is None:
                values += [0.0] * _CANDIDATE_FIELDS
            else:
                p = probes[c]
                values += [p["compress_s"], p["decompress_s"], p["payload_bytes"], p["sent_bytes"],
                           p["collectives"], p["relative_error"]]
        return values

    def _probe_figures(
        self, values: list[float], i: int, key: Hashable, probed: bool, extra: dict[str, Any],
    ) -> tuple[int, dict[str, Any]]:
        """Read back what :meth:`_probe_values` packed; returns the next index and the
        :class:`BucketFigures` fields it gives."""
        cands = []
        for c in range(len(self.codecs)):
            cs, ds, pb, sb, nc, err = values[i : i + _CANDIDATE_FIELDS]
            i += _CANDIDATE_FIELDS
            cands.append(CandidateFigures(self.names[c], cs, ds, pb, sb, nc, err))
        return i, {"candidates": cands if probed else None}

    def _unpack(
        self, values: list[float], order: list[Hashable], probed: bool, n_sampled: int, start: int, end: int,
        extra: dict[str, Any],
    ) -> WindowFigures:
        world_size = dist.get_world_size(self.group)
        buckets, i = [], 0
        for key in order:
            numel, itemsize, payload, sent, neg_comm, colls, sum_norm, running_error = values[i : i + _BUCKET_FIELDS]
            i += _BUCKET_FIELDS
            i, fields = self._probe_figures(values, i, key, probed, extra)
            current = self.choices.get(key, 0)
            buckets.append(BucketFigures(
                key=key, numel=int(numel), itemsize=int(itemsize), current=current, payload_bytes=payload,
                sent_bytes=sent, communicate_s=-neg_comm, collectives=colls, gradient_sum_norm=sum_norm,
                running_error=running_error, **fields,
            ))
        entropy_samples = values[i : i + n_sampled]
        i += n_sampled
        period, neg_in_flight, exchange, neg_figures = values[i : i + 4]
        return WindowFigures(start, end, world_size, period, buckets,
                             in_flight_s=-neg_in_flight, exchange_s=exchange, figures_s=-neg_figures,
                             figures_bytes=self._figures_bytes, entropy=entropy_samples)

    def _handed(self, key: Hashable, grad: Tensor) -> Tensor:
        """``x``: the bucket plus what it still owes (carried and the running codec's residual),
        the tensor a codec is handed, whose relative error the monitor logs."""
        owed = self.residual(key)
        if owed is not None and owed.numel() == grad.numel():
            grad = (grad.reshape(-1).float() + owed.to(grad.device)).to(grad.dtype).view(grad.shape)
        return grad

    def _running_error(self, key: Hashable) -> float:
        """The running codec's relative error ``||x - D(C(x))|| / ||x||`` on the window's last
        step, 0 where it was not measured. Every candidate but ``none`` keeps error feedback, so
        what the bucket owes after that step is exactly ``x - D(C(x))`` (PowerSGD's: ``M - P
        Q_local^T`` with the all-reduced ``P``, the figure its monitor logs; a local probe, which
        fits ``P`` to this rank's gradient alone, would read lower)."""
        norm = self._handed_norms.get(key)
        if not norm:
            return 0.0
        owed = self.residual(key)
        return 0.0 if owed is None else float(torch.linalg.vector_norm(owed)) / norm

    def _probe(self, key: Hashable, x: Tensor, step: int, shapes: list[torch.Size]) -> None:
        """Price every candidate on ``x``, the tensor a codec is handed (see :meth:`_handed`)."""
        world_size = dist.get_world_size(self.group)
        results = []
        for c, reducer in enumerate(self.reducers):
            if c == 0:
                raw = x.numel() * x.element_size()
                results.append({"compress_s": 0.0, "decompress_s": 0.0, "collectives": 1.0, "relative_error": 0.0,
                                "payload_bytes": float(raw), "sent_bytes": float(allreduce_bytes(raw, world_size))})
                continue
            out = reducer.probe(key, x, step=step, shapes=shapes)
            figures = quality_figures(x, out["decoded"])
            results.append({
                "compress_s": out["compress_s"], "decompress_s": out["decompress_s"],
                "payload_bytes": float(out["payload_bytes"]), "sent_bytes": float(out["sent_bytes"]),
                "collectives": float(out["collectives"]),
                "relative_error": 0.0 if figures is None else figures["relative_error"],
            })
        self._probes[key] = results

    def _switch(self, key: Hashable, index: int, step: int, *, reason: str) -> None:
        old = self.choices.get(key, 0)
        if index == old:
            return
        # Settled first, so that what a skipped step changed is put back before it moves.
        self.reducers[old].settle()
        residual = self.reducers[old].take_residual(key, self.shapes.get(key))
        if residual is not None:
            previous = self.carry.get(key)
            self.carry[key] = residual if previous is None else previous + residual.to(previous.dtype)
        self.choices[key] = index
        self.metrics.add_event({"kind": "switch", "step": step, "bucket": label(key), "from": self.names[old],
                                "to": self.names[index], "reason": reason})

    # -- state -----------------------------------------------------------------------------

    def residual(self, key: Hashable) -> Tensor | None:
        """The error this rank still owes bucket ``key`` (flat): the current codec's residual plus
        any carried over from a codec it left; None if nothing is owed."""
        reducer = self.reducers[self.choices.get(key, 0)]
        parts = []
        if key in self.carry:
            parts.append(self.carry[key].float())
        feedback = getattr(reducer, "feedback", None)
        if feedback is not None:
            if isinstance(reducer, PowerSGDReducer):
                shapes = self.shapes.get(key, [])
                numel = sum(s.numel() for s in shapes)
                flat, offset, any_found = torch.zeros(numel), 0, False
                for i, s in enumerate(shapes):
                    r = feedback.residuals.get(tensor_key(key, i))
                    if r is not None:
                        flat[offset : offset + s.numel()] = r.reshape(-1).float()
                        any_found = True
                    offset += s.numel()
                if any_found:
                    parts.append(flat)
            elif key in feedback.residuals:
                parts.append(feedback.residuals[key].reshape(-1).float())
        if not parts:
            return None
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total

    def state_dict(self) -> dict[str, Any]:
        """Choices, carried residuals, window position and what the window gathered, each
        candidate reducer's state and the controller's, after settling the step in progress."""
        self.settle()
        return {
            "specs": list(self.specs),
            "choices": dict(self.choices),
            "carry": {k: v.clone() for k, v in self.carry.items()},
            "window": [self.window_start, self.window_end, self.probe_this_window, self._window_met],
            "window_figures": self._window_state(),
            "pending": _kept(self._pending),
            "next_window": list(self._next_window),
            "meet_next": self._meet_next,
            "reducers": [r.state_dict() for r in self.reducers],
            "controller": self.controller.state_dict(),
        }

    def _window_state(self) -> dict[str, Any]:
        """What the open window gathered that is not timing (a resumed run keeps sampling it)."""
        with self._entropy_lock:
            return {"entropy_steps": dict(self._entropy_steps),
                    "figures": [self._figures_s, self._figures_bytes, self._probe_bytes],
                    "handed_norms": dict(self._handed_norms),
                    # the buckets, their layouts, gradient sums and probes: a deterministic
                    # schedule (accordion) decides from them at the window's end
                    "order": list(self._order), "seen": list(self._seen),
                    "shapes": {k: list(v) for k, v in self.shapes.items()}, "itemsize": dict(self._itemsize),
                    "sums": {k: v.clone() for k, v in self._sums.items()},
                    "probes": {k: [dict(p) for p in v] for k, v in self._probes.items()}}

    def _load_window_state(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self._entropy_steps = dict(state["entropy_steps"])
            self._figures_s, self._figures_bytes, self._probe_bytes = state["figures"]
            self._handed_norms = dict(state.get("handed_norms", {}))
            self._order = list(state.get("order", self._order))
            self._seen = set(state.get("seen", self._seen))
            self.shapes.update({k: [torch.Size(s) for s in v] for k, v in state.get("shapes", {}).items()})
            self._itemsize.update(state.get("itemsize", {}))
            self._sums = {k: v.clone() for k, v in state.get("sums", {}).items()}
            self._step_sums = {}
            self._probes = {k: [dict(p) for p in v] for k, v in state.get("probes", {}).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: if the candidates differ.
        """
        if list(state["specs"]) != self.specs:
            raise ValueError(f"checkpoint holds auto candidates {state['specs']}, not {self.specs}")
        # forget the step in progress: the carries it spent are in the loaded carry already, and
        # the step numbers restart from the save, so the next reduce starts its step afresh (a
        # rollback over a skipped step would otherwise give its carry back a second time, or
        # discard the clean retake's, and a retake under the same number would not start at all)
        self._spent, self._spent_step = {}, None
        self._step = self._step_first_s = self._exchange_mark = None
        self.ledger.clear()
        self.choices = dict(state["choices"])
        self.carry = {k: v.clone() for k, v in state["carry"].items()}
        self.window_start, self.window_end, self.probe_this_window, *met = state["window"]
        self._window_met = bool(met[0]) if met else True
        self._pending = state.get("pending")
        steps, probe = state.get("next_window", (0, False))
        self._next_window = (int(steps), bool(probe))
        self._meet_next = bool(state.get("meet_next", False))
        self._load_window_state(state.get("window_figures"))
        for reducer, sub in zip(self.reducers, state["reducers"]):
            reducer.load_state_dict(sub)
        self.controller.load_state_dict(state["controller"])


def _settle_gathered(gathered: dict[str, Any]) -> None:
    """Wait for the figures :meth:`AutoReducer._gather` launched; keep them as plain values
    (the same on every rank) and the all_reduce's seconds on this rank."""
    gathered["future"].wait()
    done = gathered["done_at"][0] if gathered["done_at"] else time.perf_counter()
    gathered["values"] = gathered["stats"].tolist()
    gathered["figures_s"] = done - gathered["began"]
    for name in ("stats", "future", "done_at", "began"):
        del gathered[name]


def _kept(gathered: dict[str, Any] | None) -> dict[str, Any] | None:
    """A pending decision's figures as a checkpoint keeps them (waited for; plain values)."""
    if gathered is None:
        return None
    if "values" not in gathered:
        _settle_gathered(gathered)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in gathered.items()}


def with_carry(grad: Tensor, carry: Tensor) -> tuple[Tensor, Tensor | None]:
    """``grad`` plus the residual ``carry`` a bucket brought from the codec it left, in
    ``grad``'s dtype, and what of the sum lies beyond that dtype's range (None if nothing): a
    half-precision gradient plus an fp32 carry can overflow, and a finite step must not turn
    into a skipped one; the part beyond is kept for the next step instead. A non-finite
    ``grad`` stays non-finite."""
    flat = grad.reshape(-1)
    wide = torch.promote_types(torch.promote_types(grad.dtype, carry.dtype), torch.float32)
    total = flat.to(wide) + carry.to(wide)
    if wide == grad.dtype or not nonfinite.is_finite(flat):
        return total.view(grad.shape), None
    limit = torch.finfo(grad.dtype).max
    sent = total.clamp(-limit, limit)
    excess = total - sent
    return sent.to(grad.dtype).view(grad.shape), excess.to(carry.dtype) if bool(excess.any()) else None
