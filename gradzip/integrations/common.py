"""What the framework integrations share (no framework imported here): registering the hook on a
DDP model, the figures they hand to their framework's logger, and the per-rank compressor state
they put in its checkpoints.

Error-feedback residuals and warm-start factors differ from rank to rank, while frameworks write
most of a checkpoint from rank 0 alone; :func:`gather_state` collects every rank's
:meth:`~gradzip.CompressionState.state_dict` on rank 0 (moved to the CPU), and
:func:`load_gathered` gives each rank its own back. The checkpoint then holds ``world_size``
copies of the per-rank state (for PowerSGD and the error-feedback codecs, about the size of the
gradients each).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradzip.ddp import CompressionState, compression_hook

#: prefix of the logged figures' names
PREFIX = "gradzip/"


def register(ddp_model: nn.Module, state: CompressionState) -> CompressionState:
    """Bind ``state`` to ``ddp_model``'s parameters and register gradzip's hook on it; returns ``state``.

    Raises:
        TypeError: if ``ddp_model`` is not a ``DistributedDataParallel`` model.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"gradzip's hook needs a DistributedDataParallel model; got {type(ddp_model).__name__}")
    ddp_model.register_comm_hook(state.bind(ddp_model), compression_hook)
    return state


def figures(metrics: dict[str, Any]) -> dict[str, float]:
    """The figures to log from one step's :meth:`gradzip.metrics.StepMetrics.pop`.

    Returns:
        ``gradzip/payload_bytes`` (what this rank's codec payloads held, bytes),
        ``gradzip/dense_bytes`` (the raw gradient bytes), ``gradzip/compression_ratio``
        (dense over payload) and, on steps with quality figures (``monitor_every``),
        ``gradzip/norm_ratio``: ``||D(C(x))|| / ||x||`` per bucket, averaged over the buckets
        weighted by their dense bytes. Empty if no bucket was reduced (a step under ``no_sync``).
    """
    if not metrics["dense_bytes"]:
        return {}
    out = {
        PREFIX + "payload_bytes": float(metrics["payload_bytes"]),
        PREFIX + "dense_bytes": float(metrics["dense_bytes"]),
        PREFIX + "compression_ratio": float(metrics["compression_ratio"]),
    }
    weighted = [
        (entry["quality"]["norm_ratio"], entry["dense_bytes"])
        for entry in metrics["buckets"].values() if entry.get("quality") and entry["dense_bytes"]
    ]
    if weighted:
        out[PREFIX + "norm_ratio"] = sum(r * w for r, w in weighted) / sum(w for _, w in weighted)
    return out


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in its dicts, lists and tuples copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def gather_state(state: CompressionState) -> dict[str, Any] | None:
    """Every rank's state on the group's rank 0 (a collective: call it on every rank).

    Returns:
        on rank 0, ``{"world_size": n, "ranks": [state_dict of rank 0, ..., of rank n - 1]}``
        with every tensor on the CPU; None on the other ranks.
    """
    group = state.process_group
    mine = to_cpu(state.state_dict())
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered = [None] * world_size if rank == 0 else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.gather_object(mine, gathered, dst=dst, group=group)
    return {"world_size": world_size, "ranks": gathered} if rank == 0 else None


def load_gathered(state: CompressionState, saved: dict[str, Any]) -> None:
    """Load this rank's entry of what :func:`gather_state` returned on rank 0.

    Raises:
        ValueError: if the checkpoint was made with another world size or codec spec.
    """
    world_size, rank = dist.get_world_size(state.process_group), dist.get_rank(state.process_group)
    if saved["world_size"] != world_size:
        raise ValueError(
            f"checkpoint holds compressor state for {saved['world_size']} ranks, this run has {world_size}"
        )
    state.load_state_dict(saved["ranks"][rank])
