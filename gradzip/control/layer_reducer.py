"""The reducer of the per-layer schedules (Kimad, LEGACY, EDGC): a codec per layer of every
bucket, decided on the auto reducer's windows.

It keeps :class:`~gradzip.control.auto_reducer.AutoReducer`'s machinery (windows of steps, one
all_reduce of the window's figures through the group's ordered queue, a controller that is a
deterministic function of those identical figures, the link samples, the entropy samples) and
replaces the per-bucket choice among candidate reducers by one
:class:`~gradzip.comm.layered.LayeredReducer`, whose plan for a bucket (a codec spec per layer) the
controller gives at every step through ``layer_plan``. Error feedback stays with each layer when
its codec or ratio changes, so a new plan moves nothing.

At the last step of a window the controller may ask for a probe (``plan.probe_next``): each layer
is priced locally with the specs ``probe_specs`` lists for it (squared error of the layer plus its
residual, no collective), and the figures travel in the window's all_reduce (max over ranks).
Every plan change of a bucket is recorded as a ``plan`` event in the metrics; the per-step
bucket records carry each layer's codec and bytes (``layers``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm.layered import LayeredReducer
from gradzip.comm.queue import CollectiveQueue
from gradzip.control.auto_reducer import AutoReducer
from gradzip.control.figures import LayerFigures, Plan, WindowFigures
from gradzip.metrics import StepMetrics


class LayerController(Protocol):
    """What a per-layer schedule answers; deterministic in what it has seen."""

    per_layer: bool
    entropy_every: int
    min_window_steps: int

    def first_window_steps(self) -> int: ...

    def begin(self, world_size: int) -> None: ...

    def layer_plan(self, key: Hashable, shapes: Sequence[torch.Size], dtype: torch.dtype, step: int) -> tuple[str, ...]: ...

    def probe_specs(self, key: Hashable, shapes: Sequence[torch.Size]) -> list[list[str]]: ...

    def decide(self, window: WindowFigures) -> Plan: ...

    def entropy(self, averaged: Tensor) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LayerAutoReducer(AutoReducer):
    """A codec per layer, as ``controller`` plans it (see the module docstring).

    Args:
        controller: a per-layer schedule (:mod:`gradzip.control.kimad`, :mod:`.legacy`, :mod:`.edgc`).
        group: the process group (None: the default group).
        queue: the group's ordered launch queue, shared with every reducer of the group.
        metrics: where bytes (per layer), times and decisions go.
    """

    def __init__(
        self,
        controller: LayerController,
        *,
        group: dist.ProcessGroup | None = None,
        queue: CollectiveQueue | None = None,
        metrics: StepMetrics | None = None,
    ) -> None:
        self.codecs, self.specs, self.names = [], [], []
        self._start(controller, group, queue, metrics)
        self.layered = LayeredReducer(group=group, queue=self.queue, metrics=self.metrics, ledger=self.ledger)
        self.reducers = [self.layered]
        self._probe_lists: dict[Hashable, list[list[str]]] = {}
        self._layer_probes: dict[Hashable, list[tuple[float, list[float]]]] = {}

    def reduce(
        self, key: Hashable, grad: Tensor, *, step: int, shapes: Sequence[torch.Size] | None = None,
        flush: bool = True,
    ) -> Future:
        """Average ``grad`` over the group with the controller's plan for ``key`` at ``step``.

        Args, Returns: as :meth:`gradzip.comm.layered.LayeredReducer.reduce`.
        """
        if self._step is None:  # the first step of this run, fresh or resumed
            self.controller.begin(dist.get_world_size(self.group))
        if step != self._step:
            self._start_step(step)
        shapes = [torch.Size(s) for s in shapes] if shapes is not None else [grad.shape]
        self._track(key, grad, step, shapes)
        plan = tuple(self.controller.layer_plan(key, shapes, grad.dtype, step))
        if len(plan) != len(shapes):
            raise ValueError(f"the schedule planned {len(plan)} layers for bucket {key!r}, which holds {len(shapes)}")
        if self.layered.plans.get(key) != plan:
            self.layered.set_plan(key, plan)
            self.metrics.add_event({"kind": "plan", "step": step, "bucket": str(key), "layers": list(plan)})
        if self.probe_this_window and step == self.window_end - 1 and self.window_start <= step:
            specs = self.controller.probe_specs(key, shapes)
            self._probe_lists[key] = specs
            self._layer_probes[key] = self.layered.probe_errors(key, grad, shapes, specs, step=step)
        fut = self.layered.reduce(key, grad, step=step, shapes=shapes, flush=flush)
        return self._sample_entropy(fut, step)

    def _decide(self, step: int) -> None:
        if self._layer_probes and not self.ledger.finite(self.window_end - 1):
            # the probed step was skipped on every rank (a non-finite gradient on some rank):
            # its errors are of a step that, for training, never ran
            self._layer_probes, self._probe_lists = {}, {}
        self._probes = {k: [] for k in self._layer_probes}  # marks the probed buckets for the base
        super()._decide(step)
        self._layer_probes = {}
        self._probe_lists = {}

    def _gather_extra(self) -> dict[str, Any]:
        return {"probe_lists": {k: [list(specs) for specs in v] for k, v in self._probe_lists.items()}}

    def _probe_values(self, key: Hashable, probed: bool) -> list[float]:
        if not probed:
            return []
        values: list[float] = []
        for norm_sq, errors in self._layer_probes[key]:
            values += [norm_sq, *errors]
        return values

    def _probe_figures(
        self, values: list[float], i: int, key: Hashable, probed: bool, extra: dict[str, Any],
    ) -> tuple[int, dict[str, Any]]:
        shapes = self.shapes[key]
        if not probed:
            return i, {"layers": [LayerFigures(s, [], 0.0) for s in shapes]}
        layers = []
        for shape, specs in zip(shapes, extra["probe_lists"][key]):
            layers.append(LayerFigures(shape, values[i + 1 : i + 1 + len(specs)], values[i]))
            i += 1 + len(specs)
        return i, {"layers": layers}

    def _apply(self, plan: Plan, order: list[Hashable], step: int) -> None:
        """Per-layer plans come from the controller at every step; nothing to switch here."""

    def _event_choices(self, order: list[Hashable]) -> dict[str, Any]:
        out = {}
        for key in order:
            counts = Counter(self.layered.plan(key, len(self.shapes[key])))
            out[str(key)] = ", ".join(f"{spec} x{n}" for spec, n in counts.items())
        return out

    def force(self, at_step: int, choices: dict[Hashable, str | int]) -> None:
        raise TypeError("a per-layer schedule plans every layer itself; force applies to auto's candidates")

    def residual(self, key: Hashable) -> Tensor | None:
        """The error this rank still owes bucket ``key``, laid out flat (None if nothing)."""
        return self.layered.residual(key, self.shapes.get(key, []))

    def state_dict(self) -> dict[str, Any]:
        """Window position, per-layer plans and residuals, and the controller's state."""
        return {
            "per_layer": True,
            "window": [self.window_start, self.window_end, self.probe_this_window],
            "window_figures": self._window_state(),
            "probes": [self._probe_lists, self._layer_probes],
            "layered": self.layered.state_dict(),
            "controller": self.controller.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: for a checkpoint of ``auto``'s per-bucket choice.
        """
        if not state.get("per_layer"):
            raise ValueError("checkpoint holds auto's per-bucket state, not a per-layer schedule's")
        self.window_start, self.window_end, self.probe_this_window = state["window"]
        self._load_window_state(state.get("window_figures"))
        self._probe_lists, self._layer_probes = (dict(d) for d in state["probes"])
        self.layered.load_state_dict(state["layered"])
        self.controller.load_state_dict(state["controller"])
