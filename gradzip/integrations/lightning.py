"""PyTorch Lightning: a DDP strategy that trains through gradzip's hook, on CPU and GPU.

    trainer = lightning.pytorch.Trainer(
        accelerator="cpu", devices=2, strategy=CompressedDDPStrategy("powersgd:approx_rank=4"))

Lightning's own ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` registers a comm hook only
when the root device is CUDA, so on CPU it trains uncompressed without a word. This strategy
registers gradzip's hook on whatever device DDP runs, bound to the model's parameters
(:meth:`gradzip.CompressionState.bind`); passes every other argument to ``DDPStrategy``
(``find_unused_parameters``, ``bucket_cap_mb``, ``process_group_backend``, ...); writes the
figures of :func:`gradzip.integrations.common.figures` to the trainer's loggers every
``log_every_n_steps`` optimizer steps, from rank 0; and puts every rank's compressor state in
Lightning checkpoints under ``"gradzip"`` (see :mod:`gradzip.integrations.common`), restored by
``Trainer.fit(ckpt_path=...)``.

Needs ``lightning`` (``pip install 'gradzip[lightning]'``), imported the first time
``CompressedDDPStrategy`` is looked up (the class is built then, on Lightning's ``DDPStrategy``),
not when this module is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradzip.choice import Choice
from gradzip.compressors import Compressor
from gradzip.ddp import CompressionState
from gradzip.integrations.common import figures, gather_state, load_gathered, register

#: where the compressor state goes in a Lightning checkpoint
CHECKPOINT_KEY = "gradzip"


def __getattr__(name: str) -> Any:
    # PEP 562: the class needs Lightning's base class, so it is built on first use.
    if name == "CompressedDDPStrategy":
        cls = globals()[name] = _define_strategy()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _define_strategy() -> type:
    try:
        from lightning.pytorch.strategies import DDPStrategy
    except ImportError as exc:  # the optional dependency is missing
        raise ImportError("gradzip.integrations.lightning needs lightning (pip install 'gradzip[lightning]')") from exc

    class CompressedDDPStrategy(DDPStrategy):
        """``DDPStrategy`` whose gradients travel through gradzip's DDP hook.

        Args:
            compressor: a spec such as ``"powersgd:approx_rank=4"``, a codec, a
                :func:`gradzip.choice.parse_compressor` value, or a ready
                :class:`~gradzip.CompressionState` (for its other options: ``error_feedback``,
                ``collective``, ``verify_every``, ...).
            monitor_every: quality figures (the logged norm ratio) every this many steps; None uses
                the trainer's ``log_every_n_steps``, 0 never. Ignored for a ready state.
            **kwargs: ``DDPStrategy``'s arguments, except its comm-hook ones.

        Raises:
            ValueError: for a bad spec or ``monitor_every``, or a ``ddp_comm_hook``,
                ``ddp_comm_state`` or ``ddp_comm_wrapper`` argument (this strategy brings its hook).

        Attributes:
            compression: the hook's :class:`~gradzip.CompressionState` (None before ``fit`` sets up
                DDP when built from a spec).
            logged: the figures last written to the loggers.
        """

        def __init__(
            self,
            compressor: str | Compressor | Choice | CompressionState = "powersgd:approx_rank=4",
            *,
            monitor_every: int | None = None,
            **kwargs: Any,
        ) -> None:
            given = [k for k in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper") if kwargs.get(k) is not None]
            if given:
                raise ValueError(f"CompressedDDPStrategy registers gradzip's hook itself; drop {', '.join(given)}")
            super().__init__(**kwargs)
            if isinstance(compressor, CompressionState):
                self.compression: CompressionState | None = compressor
            else:
                # Built now, so that a bad spec or option fails before any process starts.
                self.compression = None
                CompressionState(compressor, monitor_every=monitor_every or 0)
            self._compressor = compressor
            self._monitor_every = monitor_every
            self._saved: dict[str, Any] | None = None
            self.logged: dict[str, float] = {}

        def configure_ddp(self) -> None:
            """Wrap the module in DDP (``DDPStrategy``), then register gradzip's hook on it."""
            super().configure_ddp()
            if self.compression is None:
                every = self.lightning_module.trainer.log_every_n_steps if self._monitor_every is None else self._monitor_every
                self.compression = CompressionState(self._compressor, monitor_every=every)
            register(self.model, self.compression)
            if self._saved is not None:
                load_gathered(self.compression, self._saved)
                self._saved = None

        def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
            """The optimizer step (its closure runs the backward pass and the hook), then the figures
            of that pass to the loggers."""
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            if self.compression is not None:
                self._log(figures(self.compression.metrics.pop()))
            return out

        def _log(self, logged: dict[str, float]) -> None:
            trainer = self.lightning_module.trainer
            monitored = "gradzip/norm_ratio" in logged
            if not logged or not (monitored or trainer.global_step % trainer.log_every_n_steps == 0):
                return
            self.logged = logged
            if self.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(logged, step=trainer.global_step)

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            """Add every rank's compressor state (gathered on rank 0), then save as ``DDPStrategy`` does.
            Lightning calls this on every rank."""
            if self.compression is not None:
                gathered = gather_state(self.compression)
                if gathered is not None:
                    checkpoint[CHECKPOINT_KEY] = gathered
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

        def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
            """Load the module's weights, and this rank's compressor state once the hook is registered.

            Raises:
                ValueError: (when the state is loaded) for a checkpoint of another world size or codec.
            """
            super().load_model_state_dict(checkpoint, strict=strict)
            saved = checkpoint.get(CHECKPOINT_KEY)
            if saved is None:
                return
            if self.compression is not None and self.model is not None and self.model is not self.lightning_module:
                load_gathered(self.compression, saved)
            else:
                self._saved = saved

    # found by pickle (Lightning's spawn launcher) through this module's __getattr__
    CompressedDDPStrategy.__qualname__ = "CompressedDDPStrategy"
    CompressedDDPStrategy.__module__ = __name__
    return CompressedDDPStrategy
