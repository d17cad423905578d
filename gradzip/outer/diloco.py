"""DiLoCo and Streaming DiLoCo: local inner steps, then an outer step on the averaged
pseudo-gradient, exchanged through any gradzip codec.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv 2311.08105): every replica takes ``H = sync_every`` steps of its own inner
optimizer from the global parameters; then the pseudo-gradient ``theta_global - theta_local``
is averaged over the replicas and the global parameters take an outer Nesterov SGD step
(:mod:`gradzip.outer.nesterov`); every replica continues from the new global parameters.

Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication",
arXiv 2501.18512): ``fragments=F`` spreads the exchange over the cycle, one fragment at a time
(:mod:`gradzip.outer.schedule`); ``delay=D >= 1`` launches a fragment's exchange and applies its
outer update ``D`` inner steps later, the collectives running in the background meanwhile
(each fragment has its own reducer, all of them issuing through one ordered
:class:`~gradzip.comm.queue.CollectiveQueue` of the group, asynchronous, so no inner step waits on
the link until an update is due, and with ``D >= H / F`` several fragments' exchanges share it).
The late update is merged with the parameters the replica reached in the meantime as the paper
does: ``theta_local = mix * theta_local + (1 - mix) * theta_global``. With ``carry=True`` (an
option of gradzip's own, in neither paper) the replica keeps instead what it did while the
exchange ran, rebased on the new global parameters:
``theta_local = theta_global + (theta_local - theta_local_at_launch)``; those inner steps then
count in the next pseudo-gradient instead of being dropped (``mix = 0``) or shrunk with the
whole replica towards the global parameters (``mix > 0``).

Eager updates (Kale, Douillard & Donchev, "Eager Updates For Overlapped Communication and
Computation in DiLoCo", arXiv 2502.12996), ``eager=True``: the whole outer exchange overlaps the
next ``H`` inner steps. Each outer step launches the exchange of this round's pseudo-gradient and
applies at once, without waiting, the mixture the paper proposes: this replica's own current
pseudo-gradient, weighted ``1 / M`` for ``M`` replicas, in place of its share of the mean that has
not arrived, plus the other replicas' share of the previous round's mean, which has:
``g_t = delta_local_t / M + (mean_{t-1} - delta_local_{t-1} / M)``.

SparseLoCo (Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo",
arXiv 2508.15706), ``method="sparseloco"``: no outer momentum; instead each replica keeps an
error-feedback accumulator decayed by ``outer_momentum`` (``e = beta * e + delta``, send
``C(e)``, keep ``e - C(e)``) and the global step is plain SGD on the averaged compressed
updates, ``theta = theta - outer_lr * mean(C(e))``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradzip.comm import Reducer, make_reducer
from gradzip.comm.queue import CollectiveQueue, completed
from gradzip.compressors import Compressor, build
from gradzip.compressors.values import check_flag
from gradzip.feedback import check_error_feedback
from gradzip.metrics import StepMetrics
from gradzip.outer.exchange import Exchange, launch, make_buckets, share_in_replica, unflatten
from gradzip.outer.nesterov import OuterNesterov
from gradzip.outer.schedule import Schedule, strided_fragments

METHODS = ("diloco", "sparseloco")


def _check_number(value: Any, *, name: str, low: float, high: float, low_open: bool, high_open: bool) -> float:
    bound = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        raise ValueError(f"{name} must be a number in {bound}; got {value!r}")
    return float(value)


def _check_carry(carry: Any, *, delay: int, mix: float, eager: bool) -> None:
    if check_flag(carry, name="carry") and (delay < 1 or mix != 0 or eager):
        raise ValueError("carry=True keeps the inner steps taken while a late update was in flight: it needs "
                         f"delay >= 1, mix=0 and eager=False; got delay={delay}, mix={mix}, eager={eager}")


def _check_eager(eager: Any, *, fragments: int, delay: int, mix: float, method: str) -> None:
    if not check_flag(eager, name="eager"):
        return
    for name, value, wanted in (("fragments", fragments, 1), ("delay", delay, 0), ("mix", mix, 0.0)):
        if value != wanted:
            raise ValueError(f"{name} must be {wanted} with eager=True (an eager exchange lands a whole cycle later, "
                             f"all fragments at once); got {value!r}")
    if method != "diloco":
        raise ValueError(f"method must be 'diloco' with eager=True; got {method!r}")


class DiLoCo:
    """An outer loop around ``inner_optimizer``: call :meth:`step` where you called
    ``inner_optimizer.step()``.

        inner = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
        opt = gradzip.DiLoCo(model, inner, "uniform:bits=8", sync_every=50)
        for x, y in data:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    Args:
        model: the replica's model (its trainable parameters are synchronised; buffers such as
            batch-norm statistics stay local). Under DDP inside a replica pass the DDP module.
        inner_optimizer: any optimizer over ``model``'s parameters (AdamW in the papers).
        compressor: codec of the pseudo-gradient exchange: a spec (``"none"``,
            ``"uniform:bits=8"``, ``"topk:ratio=0.02"``, ``"powersgd:approx_rank=4"``...) or a
            built codec. ``"auto"`` is refused.
        sync_every: ``H``, inner steps per outer step of each fragment (>= 1).
        outer_lr: outer learning rate (> 0; the DiLoCo paper: 0.7).
        outer_momentum: in [0, 1): the Nesterov momentum of the outer step (the paper: 0.9),
            or, with ``method="sparseloco"``, the decay of the error-feedback accumulator.
        fragments: ``F``, parameter fragments synchronised on a staggered schedule, in
            ``[1, min(parameter tensors, sync_every)]`` (1: all at once, DiLoCo).
        delay: ``D``, inner steps between launching a fragment's exchange and applying its
            outer update, in ``[0, sync_every - 1]`` (0: synchronous): a fragment's update
            lands before its next exchange; from ``sync_every // fragments`` on, exchanges of
            several fragments are in flight at once.
        mix: ``alpha`` in [0, 1], the weight of the replica's own parameters when an outer
            update lands (``theta_local = alpha * theta_local + (1 - alpha) * theta_global``);
            0 replaces them by the global parameters, as DiLoCo does.
        carry: with ``delay >= 1``, keep the inner steps taken while an exchange ran when its
            update lands (see the module docstring); needs ``mix=0`` and not ``eager``.
        eager: eager updates (see the module docstring): the exchange of each outer step lands
            at the next one, ``H`` inner steps later, and the outer step applies the replica's
            own pseudo-gradient at once in place of its share. Needs ``fragments=1``,
            ``delay=0`` and ``mix=0`` (the exchange is already a whole cycle late) and
            ``method="diloco"``.
        method: ``"diloco"`` (outer Nesterov momentum; error feedback as ``error_feedback``
            says) or ``"sparseloco"`` (error feedback decayed by ``outer_momentum`` in place of
            outer momentum; single-round codecs).
        error_feedback: keep the codec's residual across outer steps (None: the codec's
            default; forced on by ``"sparseloco"``).
        collective: the reducers' route (``auto``, ``allreduce``, ``allgather``, ``twophase``).
        min_compress_bytes: buckets with fewer raw bytes travel uncompressed (>= 0).
        bucket_cap_mb: a fragment's tensors travel in buckets of at most this many MiB (>= 0;
            0: one tensor per bucket).
        group: process group of the outer exchange, between replicas (None: the default
            group); see :func:`gradzip.outer.groups.replica_groups`. Its timeout bounds how long
            an exchange with a replica that stopped waits before :meth:`step` raises. On the
            default group, where the caller's own collectives go too, every round of an exchange
            is issued before :meth:`step` returns: a codec of several rounds (PowerSGD, the
            count sketch, two phases) waits at the launch for all but its last round. A group of
            its own keeps every round in the background.
        replica_group: the ranks of this replica (None: a replica is one rank). Given, the
            replica's ranks share the exchange out: each bucket is exchanged by one of them
            (bucket ``b`` of a fragment by the replica's rank ``b % replica_size``; fragments
            are cut into at least that many buckets where the tensors allow) and broadcast to
            the others when its update is applied, so the bytes between replicas are one
            rank's, not ``replica_size`` copies.
        metrics: where the exchange's bytes and times go.

    Raises:
        ValueError: naming the option and its allowed range, for any setting out of range; for
            an ``inner_optimizer`` that is not a ``torch.optim.Optimizer``, or a complex parameter.

    Payload per outer step of a fragment: the codec's payload for each of its buckets (the
    identity codec: 4 bytes per fp32 element); a full cycle of ``H`` inner steps sends every
    parameter exactly once. Biased or not, aggregatable or not: as the codec. Memory: one copy
    of the trained parameters (the global parameters, in the parameters' dtype and device) and
    one momentum buffer per tensor.

    A pseudo-gradient that is not finite on any rank is skipped on every rank: the global
    parameters and outer state stay, the fragment's local parameters go back to the global
    ones (with ``carry``, plus the steps taken since the launch where those are finite), the
    reducer's residuals are put back, and :attr:`skipped` counts it; with ``eager`` every replica
    takes back the own share it applied a round early. The inner optimizer's own state is left as
    it is. A carry that is not finite (the replica stepped on a non-finite gradient after the
    launch) is dropped even when the exchange was finite.

    What differs from the papers: fragments are strided over parameter tensors, not over
    transformer blocks; with ``eager``, the replicas' global parameters differ by their own last
    pseudo-gradient over ``M`` until :meth:`synchronize`, which lands the last exchange, and,
    under outer momentum, also after it, by how momentum weighted each own term added and taken
    back a round apart (without outer momentum they agree after it); the own term is the
    raw pseudo-gradient, so what the codec dropped from it is taken back when the mean arrives;
    ``mix`` defaults to 0 (replace, as DiLoCo and torchft's default do), while
    Streaming DiLoCo mixes the late update with the local parameters (set ``mix``, its
    ``alpha``); ``delay`` may reach ``sync_every - 1``, with several fragments in flight (torchft
    keeps it below ``sync_every // fragments``, one in flight); any gradzip codec takes the place
    of the papers' FP4 / int8 / chunked Top-K with 2-bit values. The codec compresses on the
    calling thread when the exchange is launched; what overlaps the following inner steps is the
    collectives.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        compressor: str | Compressor = "none",
        *,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        fragments: int = 1,
        delay: int = 0,
        mix: float = 0.0,
        method: str = "diloco",
        eager: bool = False,
        carry: bool = False,
        error_feedback: bool | None = None,
        collective: str = "auto",
        min_compress_bytes: int = 0,
        bucket_cap_mb: float = 25.0,
        group: dist.ProcessGroup | None = None,
        replica_group: dist.ProcessGroup | None = None,
        metrics: StepMetrics | None = None,
    ) -> None:
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise ValueError("inner_optimizer must be a torch.optim.Optimizer over the model's parameters; "
                             f"got {type(inner_optimizer).__name__}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model has no trainable parameters (none with requires_grad) for DiLoCo to synchronise")
        if any(p.is_complex() for p in self.params):
            # the exchange's non-finite guard and the codecs read real tensors
            raise ValueError("DiLoCo takes real parameters; a complex one was given (view it as real)")
        check_error_feedback(error_feedback)
        self.schedule = Schedule(sync_every=sync_every, fragments=fragments, delay=delay, n_tensors=len(self.params))
        self.outer_lr = _check_number(outer_lr, name="outer_lr", low=0, high=math.inf, low_open=True, high_open=True)
        # the outer step multiplies in the parameters' dtype: a rate past its range cannot be applied
        dtypes = {p.dtype for p in self.params if p.is_floating_point()}
        limit = min((torch.finfo(d).max for d in dtypes), default=math.inf)
        if self.outer_lr > limit:
            raise ValueError(f"outer_lr must be a number in (0, {limit:g}] for {', '.join(sorted(map(str, dtypes)))} "
                             f"parameters; got {outer_lr!r}")
        momentum = _check_number(outer_momentum, name="outer_momentum", low=0, high=1, low_open=False, high_open=True)
        self.mix = _check_number(mix, name="mix", low=0, high=1, low_open=False, high_open=False)
        cap_mb = _check_number(bucket_cap_mb, name="bucket_cap_mb", low=0, high=math.inf, low_open=False, high_open=True)
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
        _check_eager(eager, fragments=fragments, delay=delay, mix=self.mix, method=method)
        _check_carry(carry, delay=delay, mix=self.mix, eager=eager)
        self.eager = eager
        self.carry = carry
        if isinstance(compressor, str) and compressor.strip().lower() == "auto":
            raise ValueError("compressor must be a codec spec or codec; 'auto' cannot run on the outer exchange")
        codec = build(compressor)
        sparseloco = method == "sparseloco"
        if sparseloco and error_feedback is False:
            raise ValueError("error_feedback must be on (None or True) with method='sparseloco', which relies on it")
        if sparseloco and codec.multi_round:
            raise ValueError(f"method='sparseloco' needs a single-round codec; {codec.name} brings its own rounds")
        if sparseloco and momentum == 0:
            raise ValueError("outer_momentum must be in (0, 1) with method='sparseloco', where it is the decay of the "
                             f"error-feedback accumulator (0 would keep no residual); got {outer_momentum!r}")
        self.inner_optimizer = inner_optimizer
        self.method = method
        self.spec = codec.spec
        self.metrics = metrics if metrics is not None else StepMetrics()
        # One reducer per fragment: a reducer keeps one step open until its outcome is known
        # (its non-finite guard), while several fragments may be in flight; one queue keeps
        # their collectives in launch order, the same on every rank.
        queue = self.queue = CollectiveQueue()
        self.reducers: list[Reducer] = [
            make_reducer(
                copy.deepcopy(codec) if p else codec, group=group, error_feedback=True if sparseloco else error_feedback,
                collective=collective, min_compress_bytes=min_compress_bytes, queue=queue, metrics=self.metrics,
                feedback_decay=momentum if sparseloco else 1.0,
            )
            for p in range(fragments)
        ]
        with torch.no_grad():
            self.global_params = [p.detach().clone() for p in self.params]
        self.outer = OuterNesterov(self.global_params, lr=self.outer_lr, momentum=0.0 if sparseloco else momentum)
        self.fragments = strided_fragments(len(self.params), fragments)
        cap_bytes = int(cap_mb * 2**20)
        self.replica_group = replica_group
        share = 1 if replica_group is None else dist.get_world_size(replica_group)
        position = 0 if replica_group is None else dist.get_rank(replica_group)
        self.buckets = [
            make_buckets(p, idx, self.params, cap_bytes, share=share) for p, idx in enumerate(self.fragments)
        ]
        self._share = share
        self._mine = [[b % share == position for b in range(len(bs))] for bs in self.buckets]
        self.inner_steps = 0  # inner steps taken
        self.exchanges = 0  # fragment exchanges launched: the reducer's step number
        self.skipped = 0  # outer updates skipped for a non-finite pseudo-gradient
        self.pending: list[Exchange] = []
        # eager: the own pseudo-gradient of the exchange in flight (what its mean already counts
        # of this replica, applied a round early)
        self.group = group
        self.sent: list[torch.Tensor] | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; then apply the outer updates due now and launch the exchanges that
        start now (identical on every rank). Returns what the inner step returned.

        Raises:
            RuntimeError: if an outer exchange failed (a replica stopped, the link timed out), or
                torch.distributed is not initialised (checked before the inner step: without a
                process group there is no outer exchange to run).
        """
        self._check_initialized()
        loss = self.inner_optimizer.step() if closure is None else self.inner_optimizer.step(closure)
        self._advance()
        return loss

    @staticmethod
    def _check_initialized() -> None:
        # at the first step, not in __init__: a DiLoCo is also built without a group to check settings
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DiLoCo exchanges between replicas through torch.distributed: call "
                               "dist.init_process_group first (one process per replica at least)")

    def skip_step(self) -> None:
        """Count an inner step that this replica skips (say its gradient was not finite) without
        stepping the inner optimizer: the outer schedule advances as :meth:`step` advances it, so
        this replica launches and applies its exchanges at the same inner steps as the others and
        no replica waits on another between exchanges. Each replica may skip its own steps.

        Raises:
            RuntimeError: as :meth:`step`.
        """
        self._check_initialized()
        self._advance()

    def _advance(self) -> None:
        """One inner step taken: apply the outer updates due now, launch the exchanges that start now."""
        self.inner_steps += 1
        if self.eager:
            if self.schedule.sends_after(self.inner_steps):
                self._eager_step()
            return
        for exchange in [e for e in self.pending if e.due == self.inner_steps]:
            self.pending.remove(exchange)
            self._apply(exchange)
        for fragment in self.schedule.sends_after(self.inner_steps):
            exchange = self._launch(fragment)
            if self.schedule.delay == 0:
                self._apply(exchange)
            else:
                self.pending.append(exchange)

    @torch.no_grad()
    def _launch(self, fragment: int, pseudo: dict[int, torch.Tensor] | None = None) -> Exchange:
        """Start the exchange of ``fragment``'s pseudo-gradients (``pseudo``: already computed,
        per tensor index, at least for the buckets this rank exchanges)."""
        if pseudo is None:
            pseudo = {
                i: self.global_params[i] - self.params[i]
                for bucket, mine in zip(self.buckets[fragment], self._mine[fragment]) if mine
                for i in bucket.indices
            }
        exchange = launch(
            self.reducers[fragment], self.buckets[fragment], pseudo, fragment=fragment,
            due=self.inner_steps + self.schedule.delay, step=self.exchanges, mine=self._mine[fragment],
        )
        if self.carry:
            exchange.start = [self.params[i].detach().clone() for i in self.fragments[fragment]]
        if self.group is None or self.group is dist.group.WORLD:
            # The caller's own collectives (a loss all_reduced for logging) go to the default group
            # too. A later round of this exchange (two phases, the count sketch, PowerSGD) is
            # launched from a callback when the round before completes, so it would reach gloo
            # before them on one rank and after them on another: a size mismatch that aborts, or
            # a hang. Every round is issued before the step returns; on a group of its own
            # (replica_groups, as gradzip train passes) the later rounds stay in the background.
            self.queue.wait_launched()
        self.exchanges += 1
        return exchange

    @property
    def replicas(self) -> int:
        """``M``, the replicas in the outer exchange (the outer group's size)."""
        return dist.get_world_size(self.group)

    @torch.no_grad()
    def _eager_step(self) -> None:
        """One eager outer step (one fragment, holding every tensor): take the previous round's
        mean, launch this round's exchange, step on ``own / M + (previous mean - previous own / M)``."""
        indices = self.fragments[0]
        previous = self._landed(self.pending.pop(0)) if self.pending else None
        own = [self.global_params[i] - self.params[i] for i in indices]
        finite = all(bool(torch.isfinite(d).all()) for d in own)
        self.pending.append(self._launch(0, dict(zip(indices, own))))
        m = self.replicas
        grads = []
        for k, i in enumerate(indices):
            g = own[k] / m if finite else torch.zeros_like(own[k])
            if self.sent is not None:
                # the previous round's mean for the own share applied a round early; a round that
                # some rank skipped takes that share back alone, as every other replica does
                g += (previous[i] if previous is not None else 0) - self.sent[k] / m
            grads.append(g)
        self.sent = own if finite else [torch.zeros_like(d) for d in own]
        self.outer.step(indices, grads)
        for i in indices:
            self.params[i].copy_(self.global_params[i])

    def _landed(self, exchange: Exchange) -> dict[int, torch.Tensor] | None:
        """The per-tensor means of an exchange, waiting for it; None (counted in :attr:`skipped`)
        when some rank's pseudo-gradient was not finite."""
        buckets = self.buckets[exchange.fragment]
        results = exchange.result()
        if self.replica_group is not None:
            results = share_in_replica(buckets, results, self.params, self.replica_group, lambda b: b % self._share)
        means = unflatten(buckets, results, self.params)
        if means is None:
            self.skipped += 1
        return means

    @torch.no_grad()
    def _land_eager(self) -> None:
        """Land the eager exchange in flight: one outer step on the other replicas' share of it."""
        indices = self.fragments[0]
        previous = self._landed(self.pending.pop(0))
        m = self.replicas
        # a skipped round (some rank's pseudo-gradient not finite) takes back the own share alone
        self.outer.step(indices, [(previous[i] if previous is not None else 0) - self.sent[k] / m
                                  for k, i in enumerate(indices)])
        self.sent = None
        for i in indices:
            self.params[i].copy_(self.global_params[i])

    @torch.no_grad()
    def _apply(self, exchange: Exchange) -> None:
        indices = self.fragments[exchange.fragment]
        means = self._landed(exchange)
        if means is not None:
            self.outer.step(indices, [means[i] for i in indices])
        for k, i in enumerate(indices):
            carried = None if exchange.start is None else self.params[i] - exchange.start[k]
            if carried is not None and bool(torch.isfinite(carried).all()):
                # keep the inner steps taken while the exchange ran
                torch.add(self.global_params[i], carried, out=self.params[i])
            elif means is None or self.mix == 0 or carried is not None:
                # (a carry that is not finite, from a replica that stepped on a non-finite
                # gradient before or after the launch, is dropped: it would stay so for good)
                self.params[i].copy_(self.global_params[i])
            else:
                self.params[i].lerp_(self.global_params[i], 1 - self.mix)

    def synchronize(self) -> None:
        """Wait for every exchange in flight and apply it now (before evaluating or at the end
        of training, so that the model holds every update that was sent). Training may go on
        afterwards; those updates have then landed earlier than ``delay`` said. With ``eager``,
        the last exchange lands as one more outer step on the other replicas' share of it."""
        if self.eager:
            if self.pending:
                self._land_eager()
            return
        while self.pending:
            self._apply(self.pending.pop(0))

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume exactly: settings, step counters, global parameters, outer
        momentum, the reducers' residuals, the inner optimizer's state and the exchanges in
        flight. Those are waited for here (this call blocks until their collectives complete)
        and saved with their results, to be applied at the same inner step after loading. The
        model's parameters are the caller's to save (``model.state_dict()``). Residuals differ
        per rank: save every rank's own."""
        for exchange in self.pending:
            exchange.resolve()
        return {
            "settings": self._settings(),
            "inner_steps": self.inner_steps,
            "exchanges": self.exchanges,
            "skipped": self.skipped,
            "global": [g.clone() for g in self.global_params],
            "outer": self.outer.state_dict(),
            "pending": [
                {
                    "fragment": e.fragment, "due": e.due, "step": e.step,
                    "results": [None if f is None else f.wait().clone() for f in e.futures],
                    **({"start": [t.clone() for t in e.start]} if self.carry else {}),
                }
                for e in self.pending
            ],
            "reducers": [r.state_dict() for r in self.reducers],
            "inner": self.inner_optimizer.state_dict(),
            **({"sent": None if self.sent is None else [t.clone() for t in self.sent]} if self.eager else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: if it is not a DiLoCo state (missing or malformed entries), was made with
                other settings (codec, schedule, method, buckets, error feedback, number of
                replicas) or for other parameters (count, shapes); nothing is changed then.
        """
        self._check_loadable(state)
        before = self.state_dict()
        try:
            self._load(state)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError, RuntimeError) as exc:
            self._load(before)  # a part that loaded is taken back: nothing is changed
            raise ValueError(f"not a loadable DiLoCo state_dict ({type(exc).__name__}: {exc}); nothing was "
                             "changed") from None

    def _check_loadable(self, state: Any) -> None:
        missing = [k for k in ("settings", "inner_steps", "exchanges", "skipped", "global", "outer", "pending",
                               "reducers", "inner") if not isinstance(state, dict) or k not in state]
        if missing:
            raise ValueError(f"not a DiLoCo state_dict: no {', '.join(missing)} (settings: {self._settings()})")
        mine, saved = self._settings(), state["settings"]
        if saved != mine:
            keys = [k for k in {**mine, **saved} if saved.get(k) != mine.get(k)] if isinstance(saved, dict) else []
            differ = "; ".join(f"{k} {saved.get(k)!r}, now {mine.get(k)!r}" for k in keys)
            raise ValueError(f"checkpoint made with settings {saved}, not {mine}" + (f" ({differ})" if differ else ""))
        if self.carry and any("start" not in e for e in state["pending"]):
            raise ValueError("not a carry DiLoCo state_dict: an exchange in flight has no start (its parameters at launch)")
        if self.eager and "sent" not in state:
            raise ValueError("not an eager DiLoCo state_dict: no sent (the pseudo-gradient of the exchange in flight)")
        if len(state["global"]) != len(self.global_params):
            raise ValueError(f"checkpoint holds {len(state['global'])} global parameters; the model trains "
                             f"{len(self.global_params)}")
        for i, (g, saved_g) in enumerate(zip(self.global_params, state["global"])):
            if not isinstance(saved_g, torch.Tensor) or g.shape != saved_g.shape:
                shape = tuple(saved_g.shape) if isinstance(saved_g, torch.Tensor) else type(saved_g).__name__
                raise ValueError(f"checkpoint parameter {i} has shape {shape}; the model's is {tuple(g.shape)}")
        if len(state["reducers"]) != len(self.reducers):
            raise ValueError(f"checkpoint holds {len(state['reducers'])} reducers; this DiLoCo has {len(self.reducers)}")
        for e in state["pending"]:
            if not isinstance(e, dict) or any(k not in e for k in ("fragment", "due", "step", "results")) or not (
                    0 <= e["fragment"] < len(self.fragments)) or len(e["results"]) != len(self.buckets[e["fragment"]]):
                raise ValueError(f"not a DiLoCo state_dict: an exchange in flight does not fit this DiLoCo's "
                                 f"fragments and buckets: {e if not isinstance(e, dict) else sorted(e)}")

    def _load(self, state: dict[str, Any]) -> None:
        self.inner_steps = state["inner_steps"]
        self.exchanges = state["exchanges"]
        self.skipped = state["skipped"]
        with torch.no_grad():
            for g, saved in zip(self.global_params, state["global"]):
                g.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.pending = [
            Exchange(
                e["fragment"], e["due"], e["step"],
                [None if t is None else completed(t.to(self.params[0].device)) for t in e["results"]],
                [t.to(self.params[0].device).clone() for t in e["start"]] if self.carry else None,
            )
            for e in state["pending"]
        ]
        for reducer, saved in zip(self.reducers, state["reducers"]):
            reducer.load_state_dict(saved)
        self.inner_optimizer.load_state_dict(state["inner"])
        if self.eager:
            self.sent = None if state["sent"] is None else [t.to(self.params[0].device).clone() for t in state["sent"]]

    def _settings(self) -> dict[str, Any]:
        s = self.schedule
        return {
            "compressor": self.spec, "method": self.method, "sync_every": s.sync_every,
            "fragments": s.fragments, "delay": s.delay, "n_tensors": s.n_tensors, "replica_size": self._share,
            "buckets": [len(b) for b in self.buckets], "error_feedback": self.reducers[0].feedback is not None,
            "replicas": self.replicas if dist.is_initialized() else 1,
            **({"eager": True} if self.eager else {}),
            **({"carry": True} if self.carry else {}),
        }

