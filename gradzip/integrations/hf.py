"""Hugging Face ``transformers`` Trainer: a callback that puts gradzip's hook on the wrapped model.

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.add_callback(CompressionCallback(trainer, "powersgd:approx_rank=4"))
    trainer.train()

The Trainer has no comm-hook option, and a callback's events receive the unwrapped model
(``trainer.model``), not the ``DistributedDataParallel`` one the Trainer builds inside
``train()``. So the callback is given the trainer, and at ``on_train_begin`` (after the Trainer
has wrapped the model) registers the hook on ``trainer.model_wrapped``, bound to its
parameters. Hence the two lines: build the trainer, then add the callback.

Every ``logging_steps`` optimizer steps, counted from the first (the steps that carry quality
figures, with ``monitor_every`` left to follow ``logging_steps``), the figures of
:func:`gradzip.integrations.common.figures` go through ``trainer.log`` (the log history and
every ``report_to`` integration). At each checkpoint (``on_save``) every
rank writes its compressor state to ``gradzip_state_{rank}.pt`` in the checkpoint folder, as
the Trainer writes its per-rank RNG state; a resumed run loads it back at ``on_train_begin``
from ``resume_from``, else ``args.resume_from_checkpoint``, else
``<output_dir>/checkpoint-<global step>``.

Needs ``transformers`` (``pip install 'gradzip[hf]'``), imported the first time
``CompressionCallback`` is looked up (the class is built then, on ``TrainerCallback``), not when
this module is.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from gradzip.choice import Choice
from gradzip.compressors import Compressor
from gradzip.ddp import CompressionState
from gradzip.integrations.common import figures, register, to_cpu

STATE_FILE = "gradzip_state_{rank}.pt"


def __getattr__(name: str) -> Any:
    # PEP 562: the class needs transformers' base class, so it is built on first use.
    if name == "CompressionCallback":
        cls = globals()[name] = _define_callback()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _define_callback() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as exc:  # the optional dependency is missing
        raise ImportError("gradzip.integrations.hf needs transformers (pip install 'gradzip[hf]')") from exc

    class CompressionCallback(TrainerCallback):
        """Registers gradzip's hook on the Trainer's DDP model, logs its figures, checkpoints its state.

        Args:
            trainer: the ``transformers.Trainer`` this callback is added to.
            compressor: a spec such as ``"powersgd:approx_rank=4"``, a codec, or a ready
                :class:`~gradzip.CompressionState` (for its other options).
            monitor_every: quality figures (the logged norm ratio) every this many steps; None uses
                the Trainer's logging interval, 0 never. Ignored for a ready state.
            resume_from: the checkpoint folder to load the compressor state from when training
                resumes (None: see the module docstring).

        Raises:
            ValueError: for a bad spec or option.

        Attributes:
            compression: the hook's :class:`~gradzip.CompressionState` (None until training starts,
                when built from a spec).
        """

        def __init__(
            self,
            trainer: Any,
            compressor: str | Compressor | Choice | CompressionState = "powersgd:approx_rank=4",
            *,
            monitor_every: int | None = None,
            resume_from: str | os.PathLike | None = None,
        ) -> None:
            if not isinstance(compressor, CompressionState):
                CompressionState(compressor, monitor_every=monitor_every or 0)  # fail on a bad spec now
            self.trainer = trainer
            self.compression = compressor if isinstance(compressor, CompressionState) else None
            self._compressor = compressor
            self._monitor_every = monitor_every
            self.resume_from = resume_from
            self._registered: Any = None  # the DDP model the hook is on

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            """Register the hook on ``trainer.model_wrapped``; load the state of a resumed run."""
            from torch.nn.parallel import DistributedDataParallel

            model = self.trainer.model_wrapped
            if not isinstance(model, DistributedDataParallel):
                warnings.warn(f"gradzip: the Trainer's model is a {type(model).__name__}, not DDP; nothing is compressed", stacklevel=2)
                return
            if self.compression is None:
                every = state.logging_steps if self._monitor_every is None else self._monitor_every
                self.compression = CompressionState(self._compressor, monitor_every=int(every))
            if model is not self._registered:
                register(model, self.compression)
                self._registered = model
            if state.global_step > 0:
                self._load(args, state.global_step)

        def _load(self, args: Any, global_step: int) -> None:
            rank = dist.get_rank(self.compression.process_group)
            resumed = args.resume_from_checkpoint if isinstance(args.resume_from_checkpoint, (str, os.PathLike)) else None
            folder = self.resume_from or resumed or os.path.join(args.output_dir, f"checkpoint-{global_step}")
            path = os.path.join(folder, STATE_FILE.format(rank=rank))
            if not os.path.exists(path):
                warnings.warn(f"gradzip: resumed at step {global_step} but {path} does not exist; the compressor "
                              "state (residuals, factors) starts afresh", stacklevel=2)
                return
            self.compression.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            """Log the step's figures through ``trainer.log`` every logging interval."""
            if self.compression is None or self._registered is None:
                return control
            logged = figures(self.compression.metrics.pop())
            every = self.compression.monitor_every or max(int(state.logging_steps), 1)
            if logged and (self.compression.step - 1) % every == 0:  # the step just reduced
                should_log = control.should_log
                self.trainer.log(logged)
                control.should_log = should_log  # trainer.log clears it; the Trainer's own logs still go
            return control

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            """Write this rank's compressor state into the checkpoint folder just saved."""
            if self.compression is None or self._registered is None:
                return
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            rank = dist.get_rank(self.compression.process_group)
            torch.save(to_cpu(self.compression.state_dict()), os.path.join(folder, STATE_FILE.format(rank=rank)))

    CompressionCallback.__qualname__ = "CompressionCallback"
    CompressionCallback.__module__ = __name__
    return CompressionCallback
