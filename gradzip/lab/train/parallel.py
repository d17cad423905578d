"""How the main job spreads the model over its ranks: replicated with DDP and a compression
hook (the default), sharded with FSDP2 and a compressed reduce-scatter (``--fsdp``), or, under
``--outer`` with one rank per replica, not at all (each rank trains its own copy; the outer loop
exchanges)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradzip.lab.train.config import TrainConfig
from gradzip.lab.train.hooks import is_torch_hook, make_hook
from gradzip.metrics import StepMetrics


@dataclass
class LocalState:
    """The exchange state of a rank that exchanges no gradients (a replica of one rank under
    ``--outer``): empty metrics and nothing to save."""

    metrics: StepMetrics = field(default_factory=StepMetrics)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@dataclass
class Parallel:
    """A model made data-parallel.

    Attributes:
        module: what the loop calls for forward and backward.
        state: the compression state; has ``metrics`` (a :class:`~gradzip.metrics.StepMetrics`)
            and ``state_dict()`` (per rank, for checkpoints).
        kind: ``ddp``, ``fsdp`` or ``local`` (no gradient exchange: one rank per replica).
        hook: ``gradzip``, ``torch`` (PyTorch's own DDP hooks, as anchors) or ``none``.
        no_exchange: a context manager factory; inside, gradients are not exchanged.
    """

    module: nn.Module
    state: Any
    kind: str
    hook: str
    no_exchange: Callable[[], AbstractContextManager]

    @property
    def unwrapped(self) -> nn.Module:
        """The model itself, without its DDP wrapper."""
        return self.module.module if self.kind == "ddp" else self.module

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """Full (unsharded) model and optimizer state dicts, for rank 0 to save.

        Under FSDP this is a collective (every rank must call it); the tensors arrive on rank 0
        only, on the CPU, and the optimizer state is keyed by parameter name.
        """
        if self.kind != "fsdp":
            return self.unwrapped.state_dict(), optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (
            get_model_state_dict(self.module, options=options),
            get_optimizer_state_dict(self.module, optimizer, options=options),
        )


    def load_checkpoint_state(self, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None:
        """Load what :meth:`checkpoint_state` saved. Under FSDP every rank calls it with the full
        state and keeps its own shards."""
        if self.kind != "fsdp":
            self.unwrapped.load_state_dict(model_state)
            optimizer.load_state_dict(optimizer_state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.module, model_state, options=options)
        set_optimizer_state_dict(self.module, optimizer, optimizer_state, options=options)


def shard_blocks(model: nn.Module) -> nn.Module:
    """Apply ``fully_shard`` to every transformer block of a ``transformers`` causal LM (the
    modules its ``_no_split_modules`` names: ``GPT2Block``, ``LlamaDecoderLayer``), then to the
    root (embeddings, final norm and the head); returns the same object, now sharded."""
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(model)
    return model


def make_parallel(
    model: nn.Module, cfg: TrainConfig, settle: Callable[[DDP], None] | None = None, group: Any = None
) -> Parallel:
    """Wrap ``model`` (on its device, process group initialised) for ``cfg``; DDP runs on
    ``group`` (None: the default group; the replica's group under ``--outer``).

    ``settle`` runs on the DDP model before the hook is registered (one synced step lets DDP
    rebuild its buckets, so bucket-keyed compressor state meets its final layout).

    Raises:
        ValueError: for a bad compressor spec (``cfg.validate()`` refuses PyTorch's DDP hooks
            with ``--fsdp``).
    """
    if cfg.outer is not None and cfg.replica_size == 1:
        return Parallel(model, LocalState(), "local", "none", nullcontext)
    if not cfg.fsdp:
        ddp = DDP(model, bucket_cap_mb=cfg.bucket_cap_mb, process_group=group)
        if settle is not None:
            settle(ddp)
        state, hook = make_hook(cfg, group)
        if cfg.choice.kind == "codec" and cfg.choice.embeddings:
            state.bind(ddp.module)  # finds the embedding tables the option names
        ddp.register_comm_hook(state, hook)
        return Parallel(ddp, state, "ddp", "torch" if is_torch_hook(state) else "gradzip", ddp.no_sync)
    from gradzip.fsdp import compress_reduce_scatter

    shard_blocks(model)
    state = compress_reduce_scatter(model, cfg.choice.codec)
    return Parallel(model, state, "fsdp", "gradzip", state.paused)
