"""``--compressor legacy``: LEGACY's policy matrix of layer-size groups by training phases.

LEGACY ("LEGACY: A Lightweight Dynamic Gradient Compression Strategy for Distributed Deep
Learning", ICLR 2026, openreview.net/forum?id=DsBYEO3B8O, no arXiv id; code
github.com/LEGACY-compression/LEGACY) sets each
layer's compression from two signals that cost nothing to read: the layer's size and the phase of
training. Layers are grouped by size thresholds ``splits`` (group ``j`` is the first with
``numel < splits[j]``; layers at or above the last threshold form the last group); training is
cut into as many equal slices of the run's steps as the policy has rows (phase ``i`` is the first
with ``step < (i + 1) * total_steps / phases``); cell ``policy[i][j]`` is the codec's parameter for
that phase and group, a ratio for Top-K and the other sparsifiers, a rank for PowerSGD, bits for
the quantizers ("for any compressor").

Reproduced exactly: the grouping and phase rules of the reference code
(``size_iteration_classification``: strict ``<`` against the thresholds, equal slices of the run),
one codec parameter per cell, decisions per layer. Its defaults are the reference code's
(``dawn.py``): one threshold at 10,000 elements, Top-K keeping 1% of the small layers and 0.1% of
the others (its ``group_compressions`` of ``1,0.1`` percent), one phase; give several phases with
``|`` between rows.

Not reproduced or different: the reference code slices training by epochs and takes percentages;
here the run's steps (``total_steps``, which ``gradzip train`` fills in from ``--steps``) and kept
fractions. The paper's per-experiment tables of thresholds and ratios are not shipped as presets.
A cell whose codec would send more than the raw layer (a ratio of 1) sends it dense. The reference
applies the codec per parameter tensor with its own all_reduce or all_gather; here the layers of
a DDP bucket travel in one exchange (:mod:`gradzip.comm.layered`), with error feedback per layer.

Spec: ``legacy[:codec=topk,splits=10000,policy=0.01/0.001,total_steps=N]``; ``policy`` rows
(phases) separated by ``|``, cells (groups, one more than ``splits``) by ``/``; ``splits`` by ``/``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradzip.control.figures import Plan, WindowFigures
from gradzip.control.layers import Ladder, LayerSchedule, knob_of, levels_text, settings_from

NAME = "legacy"


@dataclass
class LegacyConfig:
    """Settings of ``--compressor legacy`` (see the module docstring)."""

    codec: str = "topk"
    """The codec every layer uses; the cells set its ratio (rank for powersgd, bits for quantizers)."""

    splits: Any = "10000"
    """Layer-size thresholds in elements, increasing, ``/``-separated."""

    policy: Any = "0.01/0.001"
    """Rows (training phases) separated by ``|``, each a ``/``-separated cell per size group."""

    total_steps: int | None = None
    """The run's steps, sliced into equal phases; needed with more than one phase."""

    def validate(self) -> LegacyConfig:
        knob = knob_of(self.codec)
        kind = float if knob == "ratio" else int
        self.splits = levels_text(self.splits, name="splits", kind=int)
        if any(b <= a for a, b in zip(self.splits, self.splits[1:])) or self.splits[0] < 1:
            raise ValueError(f"splits must be increasing integers >= 1; got {'/'.join(map(str, self.splits))}")
        rows = self.policy if isinstance(self.policy, (tuple, list)) else str(self.policy).split("|")
        self.policy = tuple(levels_text(row, name="policy", kind=kind) for row in rows)
        for row in self.policy:
            if len(row) != len(self.splits) + 1:
                raise ValueError(f"policy rows need one cell per size group ({len(self.splits) + 1}); got {len(row)}")
        ladder = Ladder(self.codec)
        for row in self.policy:
            for cell in row:
                ladder.build(cell)  # the codec's own range check
        if self.total_steps is not None and (isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int)
                                             or self.total_steps < 1):
            raise ValueError(f"total_steps must be an integer >= 1; got {self.total_steps!r}")
        if len(self.policy) > 1 and self.total_steps is None:
            raise ValueError("total_steps must be an integer >= 1 with several phases; got None")
        return self


class LegacyController(LayerSchedule):
    """LEGACY's table lookup (see the module docstring). Needs no figures: every plan is a
    function of the step and the layer's size, the same on every rank."""

    name = NAME

    def __init__(self, cfg: LegacyConfig) -> None:
        self.cfg = cfg.validate()
        self.ladder = Ladder(cfg.codec)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> LegacyController:
        return cls(settings_from(LegacyConfig, params, schedule=NAME))

    def phase(self, step: int) -> int:
        """The policy row of ``step``: the first ``i`` with ``step < (i + 1) * total_steps / phases``."""
        phases = len(self.cfg.policy)
        if phases == 1:
            return 0
        portion = self.cfg.total_steps / phases
        for i in range(phases):
            if step < (i + 1) * portion:
                return i
        return phases - 1

    def group(self, numel: int) -> int:
        """The size group of a layer: the first ``j`` with ``numel < splits[j]``, else the last."""
        for j, split in enumerate(self.cfg.splits):
            if numel < split:
                return j
        return len(self.cfg.splits)

    def level(self, step: int, numel: int) -> Any:
        return self.cfg.policy[self.phase(step)][self.group(numel)]

    def layer_plan(self, key: Hashable, shapes: Sequence[torch.Size], dtype: torch.dtype, step: int) -> tuple[str, ...]:
        return tuple(self.ladder.spec(self.level(step, torch.Size(s).numel()), s, dtype) for s in shapes)

    def decide(self, window: WindowFigures) -> Plan:
        # Nothing to measure: the next window lasts until the next phase starts (or for good).
        phase = self.phase(window.end)
        if phase + 1 < len(self.cfg.policy):
            next_start = -(-(phase + 1) * self.cfg.total_steps // len(self.cfg.policy))
            steps = max(1, next_start - window.end)
        else:
            steps = 1 << 40
        note = f"legacy phase {phase + 1} of {len(self.cfg.policy)}: {'/'.join(map(str, self.cfg.policy[phase]))}"
        return Plan({}, steps, {}, note, False)
