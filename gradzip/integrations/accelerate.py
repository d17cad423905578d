"""Hugging Face Accelerate: one call after ``prepare`` puts gradzip's hook on the prepared model.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = gradzip.integrations.accelerate.register(accelerator, model, "powersgd:approx_rank=4")
    ...
    accelerator.log(figures(state), step=step)   # after each optimizer step, if you log

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own list of
PyTorch's hooks. :func:`register` registers gradzip's on the ``DistributedDataParallel`` model
``prepare`` returned (bound to its parameters), and registers the compressor state with
``accelerator.register_for_checkpointing``: ``accelerator.save_state`` writes every rank's state
(gathered on the main process, see :mod:`gradzip.integrations.common`) and
``accelerator.load_state`` gives each rank its own back. Gradient accumulation under
``accelerator.accumulate`` works as with plain DDP: the hook runs on the steps that synchronise.

Needs ``accelerate`` (``pip install 'gradzip[accelerate]'``) for the accelerator; this module
itself imports nothing of it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from gradzip.choice import Choice
from gradzip.compressors import Compressor
from gradzip.ddp import CompressionState
from gradzip.integrations import common


class CheckpointedState:
    """``state_dict`` / ``load_state_dict`` of every rank's compressor state, for
    ``accelerator.register_for_checkpointing`` (which calls them on every process and writes
    the main process's value)."""

    def __init__(self, state: CompressionState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any] | None:
        """Every rank's state on the group's rank 0, None elsewhere (a collective)."""
        return common.gather_state(self.state)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """This rank's entry of what :meth:`state_dict` returned.

        Raises:
            ValueError: for a checkpoint of another world size or codec.
        """
        common.load_gathered(self.state, saved)


def register(
    accelerator: Any,
    model: nn.Module,
    compressor: str | Compressor | Choice | CompressionState = "powersgd:approx_rank=4",
    *,
    monitor_every: int = 0,
) -> CompressionState:
    """Register gradzip's hook on ``model`` (what ``accelerator.prepare`` returned) and its state
    for ``accelerator.save_state`` / ``load_state``.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the prepared model, a ``DistributedDataParallel`` (launch with ``accelerate
            launch`` or ``torchrun``, two or more processes).
        compressor: a spec such as ``"powersgd:approx_rank=4"``, a codec, or a ready
            :class:`~gradzip.CompressionState` (for its other options).
        monitor_every: quality figures (the norm ratio of :func:`figures`) every this many
            steps; 0 never. Ignored for a ready state.

    Returns:
        the hook's state (its ``metrics`` fill on every synchronised backward pass).

    Raises:
        TypeError: if ``model`` is not a ``DistributedDataParallel`` model (a single process).
        ValueError: for a bad spec or option.
    """
    state = compressor if isinstance(compressor, CompressionState) else CompressionState(compressor, monitor_every=monitor_every)
    common.register(model, state)
    accelerator.register_for_checkpointing(CheckpointedState(state))
    return state


def figures(state: CompressionState) -> dict[str, float]:
    """The figures of the backward passes since the last call (:func:`gradzip.integrations.common.figures`),
    for ``accelerator.log``; empty after a step that did not synchronise."""
    return common.figures(state.metrics.pop())
