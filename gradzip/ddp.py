"""The DDP communication hook: ``hook(state, bucket) -> Future[Tensor]``, PyTorch's signature.

    ddp_model.register_comm_hook(gradzip.CompressionState("topk:ratio=0.01"), gradzip.compression_hook)

Buckets are keyed by the parameters they hold (:mod:`gradzip.keys`), not by ``bucket.index()``:
DDP lays its buckets out again after the first backward pass (and a fresh process starts from
the first layout), and residuals and warm-start factors follow their parameters into the new
buckets, never onto another tensor. Parameters are numbered by their place in the module the
state is bound to (:meth:`CompressionState.bind`), or, unbound, in the order the hook first
meets them, which DDP makes the same in every process that registers the hook at the same
point. The step counter advances after the last bucket of each backward pass, as in PyTorch's
``powerSGD_hook``; the last bucket's hook returns once every collective of the pass has been
issued (later rounds wait for earlier ones), so that the collectives DDP issues after the hooks
(the unused-parameter map under ``find_unused_parameters=True``) come after them on every rank. Buckets below ``min_compress_bytes`` are held back and sent fused,
uncompressed, with the last bucket of the pass (see :mod:`gradzip.comm.reducer`).

``CompressionState("auto")`` picks a codec per bucket (see :mod:`gradzip.control.auto`);
``CompressionState("kimad")`` (or ``legacy``, ``edgc``) a codec per layer of every bucket (see
:mod:`gradzip.control.schedules`);
``monitor_every`` adds quality figures to the metrics every that many steps; ``verify_every``
runs a dense all_reduce beside the compressed one on every that many steps and records the
difference (an exactness check that also catches codec or collective faults in the field).
"""


from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from gradzip.choice import EMBEDDINGS, Choice, parse_compressor
from gradzip.comm import Reducer, make_reducer
from gradzip.comm.nonfinite import StepLedger
from gradzip.comm.queue import CollectiveQueue
from gradzip.comm.split import SplitReducer
from gradzip.comm.warmup import WarmupReducer
from gradzip.compressors import Compressor
from gradzip.keys import bucket_key
from gradzip.metrics import StepMetrics, relative_difference


class ParameterNumbers:
    """Stable numbers for parameters, for the keys of :mod:`gradzip.keys`.

    Bound to a module (:meth:`bind`), a parameter's number is its place in
    ``module.parameters()``; unbound, parameters are numbered in the order they are first met.
    The element count of each number is kept, so that a checkpoint's state cannot land on
    parameters of another size (:meth:`expect`).
    """

    def __init__(self) -> None:
        self.numbers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.numels: list[int] = []  # by number
        self.bound = False
        self.expected: list[int] | None = None

    def bind(self, module: nn.Module) -> None:
        """Number ``module``'s parameters by their place in ``module.parameters()``.

        Raises:
            ValueError: if parameters were already numbered otherwise, or their sizes differ from
                a checkpoint's (:meth:`expect`).
        """
        numbers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for number, param in enumerate(module.parameters()):
            numbers[param] = number
        if any(numbers.get(param) != number for param, number in self.numbers.items()):
            raise ValueError("bind the state to its module before the first backward pass")
        self.numbers, self.numels, self.bound = numbers, [p.numel() for p in module.parameters()], True
        self._check(range(len(self.numels)))

    def expect(self, numels: Sequence[int] | None) -> None:
        """Require the element counts a checkpoint was made with (None: no requirement).

        Raises:
            ValueError: if parameters already numbered differ in size.
        """
        self.expected = None if numels is None else [int(n) for n in numels]
        self._check(range(len(self.numels)))

    def of(self, params: Sequence[torch.Tensor]) -> list[int]:
        """The numbers of ``params``, numbering those met for the first time.

        Raises:
            ValueError: for a parameter outside the bound module, or one whose size differs from
                the checkpoint's at its number.
        """
        out = []
        for param in params:
            number = self.numbers.get(param)
            if number is None:
                if self.bound:
                    raise ValueError("a DDP bucket holds a parameter of another module than the one the state is bound to")
                number = self.numbers[param] = len(self.numels)
                self.numels.append(param.numel())
                self._check([number])
            out.append(number)
        return out

    def sizes(self) -> list[int]:
        """Element count by number: the parameters numbered so far, then those a loaded
        checkpoint knew beyond them (so saving before the hook has run keeps them)."""
        return self.numels + (self.expected or [])[len(self.numels) :]

    def _check(self, numbers) -> None:
        if self.expected is None:
            return
        for number in numbers:
            if number < len(self.expected) and self.expected[number] != self.numels[number]:
                raise ValueError(
                    f"parameter {number} has {self.numels[number]} elements, but {self.expected[number]} in the "
                    "checkpoint: the state was saved for another model or parameter order (bind it to the model "
                    "with CompressionState.bind)"
                )


class CompressionState:
    """State of :func:`compression_hook`: the codec, its reducer, the step and the metrics.

    Args:
        compressor: a spec such as ``"powersgd:approx_rank=4"`` (DGC's ``warmup_steps``,
            ``warmup_stages`` and ``clip_norm`` accepted after a codec with a ``ratio``;
            ``embeddings=none|fp16|bf16|int8`` after any codec sends the embedding tables by that
            codec, :mod:`gradzip.comm.split`, and needs :meth:`bind`), a built codec, ``"auto"``,
            or a value from :func:`gradzip.choice.parse_compressor`.
        process_group: None for the default group.
        error_feedback: override the codec's default.
        collective: ``auto`` (by bytes), ``allreduce``, ``allgather`` or ``twophase``
            (single-round codecs; see :mod:`gradzip.comm.traffic`).
        min_compress_bytes: buckets with fewer raw bytes travel uncompressed, fused into one
            all_reduce per backward pass (single-round codecs); an integer >= 0.
        monitor_every: quality figures every this many steps (0: never).
        verify_every: exactness check every this many steps (0: never).
        auto: a :class:`gradzip.control.auto.AutoConfig` for ``compressor="auto"`` (None: defaults).
        total_steps: the run's steps, for the per-layer schedules that slice the run (``legacy``,
            ``edgc``) when their spec does not give it; None: not known.

    Raises:
        ValueError: for a bad spec, collective, threshold or setting (at construction, before
            training starts), or a ``torch:`` hook (PyTorch's hooks are registered as they are).

    Pickles without its process group (it uses the default group after unpickling) and without
    its binding, and carries its reducer's residuals in :meth:`state_dict`.
    """

    def __init__(
        self,
        compressor: str | Compressor | Choice = "powersgd:approx_rank=4",
        *,
        process_group: dist.ProcessGroup | None = None,
        error_feedback: bool | None = None,
        collective: str = "auto",
        min_compress_bytes: int = 0,
        monitor_every: int = 0,
        verify_every: int = 0,
        auto: Any = None,
        total_steps: int | None = None,
    ) -> None:
        for name, value in (("monitor_every", monitor_every), ("verify_every", verify_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}")
        self.choice = parse_compressor(compressor)
        if self.choice.kind == "torch":
            raise ValueError(f"{self.choice.spec} is PyTorch's own hook: register it with DDP directly")
        # the constructor's arguments, kept once: pickling rebuilds the state from them
        self.options = {
            "error_feedback": error_feedback, "collective": collective, "min_compress_bytes": min_compress_bytes,
            "monitor_every": monitor_every, "verify_every": verify_every, "auto": auto, "total_steps": total_steps,
        }
        self.process_group = process_group
        self.is_auto = self.choice.kind == "auto"
        self.compressor = None if self.is_auto else self.choice.codec
        self.spec = self.choice.spec
        self.monitor_every = monitor_every
        self.verify_every = verify_every
        self.step = 0
        self.metrics = StepMetrics(monitor_every)
        self.queue = CollectiveQueue()
        self.reducer: Reducer = self._make_reducer()
        self.numbering = ParameterNumbers()

    def bind(self, module: nn.Module) -> "CompressionState":
        """Number parameters by their place in ``module.parameters()`` (the DDP model or the module
        it wraps), so that state keys do not depend on the order the hook meets them; returns self.
        With ``embeddings=CODEC`` in the spec, the weights of ``module``'s ``nn.Embedding`` layers
        (an output layer tied to one included) are the tables sent by that codec; binding is then
        required.

        Raises:
            ValueError: after the hook has met parameters in another order, or if the sizes
                differ from a loaded checkpoint's.
        """
        self.numbering.bind(module)
        if isinstance(self.reducer, SplitReducer):
            tables = [m.weight for m in module.modules() if isinstance(m, nn.Embedding)]
            self.reducer.take(self.numbering.of(tables))
        return self

    def _make_reducer(self) -> Reducer:
        opts = self.options
        if self.is_auto and self.choice.per_layer:
            from gradzip.control.layer_reducer import LayerAutoReducer
            from gradzip.control.schedules import layer_controller

            controller = layer_controller(self.choice.schedule, self.choice.params, total_steps=opts["total_steps"])
            return LayerAutoReducer(controller, group=self.process_group, queue=self.queue, metrics=self.metrics)
        if self.is_auto:
            from gradzip.control.auto import AutoConfig, make_controller
            from gradzip.control.auto_reducer import AutoReducer

            cfg = (opts["auto"] or AutoConfig()).validate()
            specs = cfg.candidate_specs(dist.get_world_size(self.process_group))
            return AutoReducer(
                specs, make_controller(cfg, specs), group=self.process_group, queue=self.queue, metrics=self.metrics
            )
        common = {
            "group": self.process_group, "error_feedback": opts["error_feedback"], "collective": opts["collective"],
            "min_compress_bytes": opts["min_compress_bytes"], "queue": self.queue, "metrics": self.metrics,
        }
        if self.choice.warmup:  # DGC's sparsity warm-up and local clipping around the codec
            return WarmupReducer(self.compressor, **self.choice.warmup, **common)
        if self.choice.embeddings:  # the tables by a codec of their own, found when bound
            ledger = StepLedger()
            side = make_reducer(
                self.choice.embeddings, group=self.process_group, queue=self.queue, metrics=self.metrics, ledger=ledger
            )
            return SplitReducer(
                make_reducer(self.compressor, **common, ledger=ledger), side,
                option=f"{EMBEDDINGS}={self.choice.embeddings}",
            )
        return make_reducer(self.compressor, **common)

    def state_dict(self) -> dict[str, Any]:
        """Spec, step, reducer state (residuals, factors; tensors cloned) and the element count of
        each numbered parameter."""
        return {
            "compressor": self.spec, "step": self.step, "reducer": self.reducer.state_dict(),
            "parameters": self.numbering.sizes(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: if the checkpoint was made with another codec spec, or for parameters of
                other sizes (checked as parameters are numbered).
        """
        if state["compressor"] != self.spec:
            raise ValueError(f"checkpoint holds compressor state for {state['compressor']!r}, not {self.spec!r}")
        self.numbering.expect(state.get("parameters"))
        self.step = state["step"]
        self.reducer.load_state_dict(state["reducer"])

    def __getstate__(self) -> dict[str, Any]:
        return {"compressor": self.spec, "options": self.options, "state": self.state_dict()}

    def __setstate__(self, data: dict[str, Any]) -> None:
        self.__init__(data["compressor"], **data["options"])
        self.load_state_dict(data["state"])


def verified_reduce(
    state: CompressionState, key, grad: torch.Tensor, *, step: int, shapes=None, flush: bool = True
) -> torch.futures.Future:
    """``state.reducer.reduce(...)`` with a dense all_reduce of ``grad`` beside it; the relative
    and max-abs difference of the compressed mean from the dense mean go into the metrics.

    The dense collective goes through the group's queue before the compressed ones, so every
    rank issues it at the same place in the order. Its bytes are not counted as payload.
    """
    world_size = dist.get_world_size(state.process_group)
    dense = grad.div(world_size)
    dense_fut = state.queue.submit(
        lambda: dist.all_reduce(dense, group=state.process_group, async_op=True).get_future(), device=dense.device
    )
    compressed = state.reducer.reduce(key, grad, step=step, shapes=shapes, flush=flush)

    def compare(fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()
        dense_fut.wait()
        figures = relative_difference(value, dense)
        figures["dense_bytes"] = dense.numel() * dense.element_size()
        state.metrics.add_verify(key, figures)
        return value

    return compressed.then(compare)


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the group through ``state``'s codec.

    Args:
        state: a :class:`CompressionState`.
        bucket: DDP's ``GradBucket``; its flat buffer (any floating dtype) holds the gradients.

    Returns:
        a future whose value is the averaged flat bucket (same shape and dtype).
    """
    # DDP lays a complex parameter's gradient into the bucket as its real view, two elements per
    # value (and its gradients() then give the complex shape on a real dtype)
    shapes = [torch.Size((*p.shape, 2)) if p.is_complex() else g.shape
              for p, g in zip(bucket.parameters(), bucket.gradients())]
    key = bucket_key(state.numbering.of(bucket.parameters()), [s.numel() for s in shapes])
    last = bucket.is_last()
    if state.verify_every and state.step % state.verify_every == 0:
        fut = verified_reduce(state, key, bucket.buffer(), step=state.step, shapes=shapes, flush=last)
    else:
        fut = state.reducer.reduce(key, bucket.buffer(), step=state.step, shapes=shapes, flush=last)
    if last:
        # Every round of the pass is issued before DDP's own collectives that follow the hooks.
        state.queue.wait_launched()
        state.step += 1
    return fut
