"""FSDP2 adapter: compressed gradient reduce-scatter for ``fully_shard`` models.

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    state = gradzip.fsdp.compress_reduce_scatter(model, "topk:ratio=0.01")
    ...  # train as usual; state.metrics.pop() after each step, state.state_dict() in checkpoints

The codec may differ per module: pass a function of the module's name and the module instead
of a spec, as TAGC's policy sketches the large MLP and embedding layers and sends attention
dense (``lambda name, module: "none" if name.endswith("attn") else "countsketch"``).

In every backward pass FSDP copies each module's gradients into one flat padded buffer and
reduce-scatters it. :func:`compress_reduce_scatter` installs, per FSDP module with parameters, a
:class:`~gradzip.comm.reduce_scatter.CompressedReduceScatter` in its place
(``FSDPModule.set_custom_reduce_scatter``); that object and the shard routes of
:mod:`gradzip.comm.routes` do the compression and the collectives (the exchanges, the reduce ops
and the non-finite rule are described in :mod:`gradzip.comm.reduce_scatter`).

When error feedback is on, every module's parameters without a gradient this step are
reduce-scattered as zeros (``set_reduce_scatter_unused_params``): the buffer layout stays the
same every step, so each residual stays aligned with its parameters and is still sent out
when a parameter gets no gradient. Such parameters then get a gradient (zeros plus what
error feedback releases) instead of ``None``.

FSDP never calls the reduce-scatter at world size 1 or on micro-steps without gradient sync
(``set_requires_gradient_sync(False)``); the accumulated gradient is compressed once, on the
step that syncs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from gradzip.comm.queue import CollectiveQueue
from gradzip.comm.reduce_scatter import CompressedReduceScatter, ReduceScatterBase
from gradzip.comm.routes import REGISTRY, SHARD
from gradzip.compressors import Compressor, build
from gradzip.metrics import StepMetrics

try:  # public since torch 2.6; under torch.distributed._composable.fsdp before
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._composable.fsdp import FSDPModule

#: what ``CompressedReduceScatter.last_exchange`` may say: a shard route's label, PowerSGD's, or
#: ``allreduce`` for the other codecs that bring a reducer of their own (their payloads add up)
EXCHANGES = (*(r.metric_name for r in REGISTRY.values() if r.family == SHARD), "powersgd", "allreduce")


def _shard_shapes(module: nn.Module) -> list[torch.Size] | None:
    """Shapes of the module's parameters within one chunk of its reduce-scatter buffer, in
    buffer order; ``[]`` for a module with no parameters; None where FSDP's private state
    cannot be read.

    Raises:
        ValueError: for a module with several parameter groups (FSDP refuses a custom
            reduce-scatter there).
    """
    try:
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = state._fsdp_param_group
            groups = [] if group is None else [group]
        if len(groups) > 1:
            raise ValueError("a module with several FSDP parameter groups cannot take a custom reduce-scatter")
        if not groups:
            return []
        return [torch.Size(p.padded_sharded_param_size) for p in groups[0].fsdp_params]
    except AttributeError:
        return None


class _Discard(ReduceScatterBase):
    """A reduce-scatter that sends nothing and returns zeros (see :meth:`FSDPCompression.paused`)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group, op: Any, async_op: bool = False) -> Any:
        output_tensor.zero_()
        return None


class FSDPCompression:
    """What :func:`compress_reduce_scatter` installed: one :class:`CompressedReduceScatter` per
    FSDP module with parameters, the shared metrics, and their state for checkpoints.

    Attributes:
        compressor: the codec spec, or module name -> spec when a function chose them per module.
        comms: module name (``""`` for the root) -> its reduce-scatter.
        metrics: per-step bytes (keyed by module name) and compress / communicate /
            decompress seconds; :meth:`StepMetrics.pop` after each optimizer step.
    """

    def __init__(self, spec: str | dict[str, str], comms: dict[str, CompressedReduceScatter], modules: dict[str, nn.Module],
                 metrics: StepMetrics) -> None:
        self.compressor = spec
        self.comms = comms
        self.modules = modules
        self.metrics = metrics

    def install(self) -> None:
        """(Re)install every module's compressed reduce-scatter."""
        for name, module in self.modules.items():
            module.set_custom_reduce_scatter(self.comms[name])

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Inside, reduce-scatters send nothing and leave zero gradients: for measuring
        forward + backward alone. Compressor state and step counters are untouched."""
        discard = _Discard()
        for module in self.modules.values():
            module.set_custom_reduce_scatter(discard)
        try:
            yield
        finally:
            self.install()

    def state_dict(self) -> dict[str, Any]:
        """Spec (or specs per module) and every module's step, codec state and residuals."""
        return {"compressor": self.compressor, "modules": {n: c.state_dict() for n, c in self.comms.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: if the checkpoint was made with other codec specs or other modules.
        """
        if state["compressor"] != self.compressor:
            raise ValueError(f"checkpoint holds compressor state for {state['compressor']!r}, not {self.compressor!r}")
        if set(state["modules"]) != set(self.comms):
            raise ValueError(
                f"checkpoint holds compressor state for modules {sorted(state['modules'])}, "
                f"this model shards {sorted(self.comms)}"
            )
        for name, comm in self.comms.items():
            comm.load_state_dict(state["modules"][name])


def compress_reduce_scatter(
    model: nn.Module,
    compressor: str | Compressor | Callable[[str, nn.Module], str | Compressor] = "powersgd:approx_rank=4",
    *,
    error_feedback: bool | None = None,
    reduce_scatter_unused_params: bool | None = None,
    metrics: StepMetrics | None = None,
) -> FSDPCompression:
    """Compress the gradient reduce-scatter of every ``fully_shard`` module of ``model``.

    Args:
        model: a module on which ``fully_shard`` was applied (to it and/or its submodules).
        compressor: a codec spec such as ``"topk:ratio=0.01"`` (see ``gradzip list``) or a built
            codec; every module gets its own instance, built from the (canonical) spec. Or a
            function of each FSDP module's name (``""`` for the root) and the module, returning
            that module's spec or codec: a codec per module.
        error_feedback: override the codec's default (single-round codecs; the codecs with a
            reducer of their own, PowerSGD, SEPARATE, Radius and the count sketch, keep theirs).
        reduce_scatter_unused_params: reduce-scatter zeros for parameters without a gradient
            so the buffer layout never changes; None turns it on exactly when residuals are kept.
        metrics: where bytes and times go; a new :class:`~gradzip.metrics.StepMetrics` if None.

    Returns:
        the installed state; keep it for metrics and checkpoints.

    Raises:
        ValueError: for a bad spec (naming the module whose spec it is, for a function), a
            model without ``fully_shard`` modules, or a module with several parameter groups.
    """
    if reduce_scatter_unused_params is not None and not isinstance(reduce_scatter_unused_params, bool):
        # a string such as "no" would read as true
        raise ValueError(f"reduce_scatter_unused_params must be True, False or None (on exactly when residuals are "
                         f"kept); got {reduce_scatter_unused_params!r}")
    policy = compressor if callable(compressor) and not isinstance(compressor, Compressor) else None
    spec = build(compressor).spec if policy is None else None
    specs: dict[str, str] = {}
    metrics = metrics or StepMetrics()
    queue = CollectiveQueue()
    fsdp_modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise ValueError("model has no fully_shard modules; apply torch.distributed.fsdp.fully_shard first")
    comms: dict[str, CompressedReduceScatter] = {}
    modules: dict[str, nn.Module] = {}
    for name, module in fsdp_modules:
        shapes = _shard_shapes(module)
        if shapes == []:
            continue  # no parameters of its own, so FSDP never reduce-scatters for it
        specs[name] = spec if policy is None else _module_spec(policy, name, module)
        comms[name] = CompressedReduceScatter(
            build(specs[name]), name=name, shard_shapes=shapes,
            error_feedback=error_feedback, metrics=metrics, queue=queue,
        )
        modules[name] = module
    # Installed only once every module's codec is built, so a bad spec leaves the model as it was.
    for name, module in modules.items():
        comm = comms[name]
        unused = comm.keeps_residuals if reduce_scatter_unused_params is None else reduce_scatter_unused_params
        if unused and hasattr(module, "set_reduce_scatter_unused_params"):
            module.set_reduce_scatter_unused_params(True, recurse=False)
        module.set_custom_reduce_scatter(comm)
    return FSDPCompression(spec if policy is None else specs, comms, modules, metrics)


def _module_spec(policy: Callable[[str, nn.Module], str | Compressor], name: str, module: nn.Module) -> str:
    """The canonical spec ``policy`` gives the module ``name``.

    Raises:
        ValueError: for a bad spec, naming the module.
    """
    try:
        return build(policy(name, module)).spec
    except ValueError as exc:
        raise ValueError(f"compressor for module {name!r}: {exc}") from None


__all__ = ["CompressedReduceScatter", "EXCHANGES", "FSDPCompression", "compress_reduce_scatter"]
