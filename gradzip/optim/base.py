"""What the compressed Adam optimizers share: AdamW's parameter groups, state and step, the
process group, full-precision gradient averaging, the compressed exchange and ``state_dict``.

Communication and DDP. These optimizers own their communication. :attr:`needs_grad_sync`
says, before each backward pass, whether the coming :meth:`step` wants gradients averaged in
full precision (1-bit Adam's warm-up, 0/1 Adam's variance steps) or each rank's own gradient
(every other step: the optimizer exchanges a compressed quantity itself). Two ways to run:

- Without DDP (``average_grads=True``, the default): :meth:`step` averages the gradients itself
  with an uncompressed ``all_reduce`` when it needs them averaged.
- Under DDP (``average_grads=False``): DDP's hook averages them; run backward inside
  ``grad_sync(ddp_model, optimizer)``, which is ``ddp_model.no_sync()`` whenever
  :attr:`needs_grad_sync` is False, so after warm-up the hook steps aside and nothing travels
  twice. (Forgetting ``no_sync`` costs a second exchange, not correctness.)

At world_size 1, or with no process group initialised, nothing is communicated and nothing is
compressed.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Hashable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gradzip.comm import Reducer
from gradzip.comm.queue import CollectiveQueue
from gradzip.compressors.values import check_flag, check_number
from gradzip.metrics import StepMetrics
from gradzip.optim import exchange


def check_betas(betas: Any) -> tuple[float, float]:
    """Validate Adam's ``(beta1, beta2)``, each in [0, 1).

    Raises:
        ValueError: naming ``betas`` and the allowed range.
    """
    # numbers only: float() would also take a bool or the characters of a two-letter string
    pair = tuple(betas) if isinstance(betas, Iterable) and not isinstance(betas, (str, bytes)) else ()
    if len(pair) != 2 or any(isinstance(b, bool) or not isinstance(b, numbers.Real) for b in pair):
        raise ValueError(f"betas must be two numbers in [0, 1); got {betas!r}")
    beta1, beta2 = (float(b) for b in pair)
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be two numbers in [0, 1); got {betas!r}")
    return beta1, beta2


def check_nonnegative(value: Any, *, name: str, strict: bool = False) -> float:
    """Validate a finite number >= 0 (> 0 when ``strict``).

    Raises:
        ValueError: naming ``name`` and the allowed range.
    """
    return check_number(value, name=name, low=0, low_open=strict)


def group_world_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def grad_sync(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> AbstractContextManager:
    """The context to run backward in: ``model.no_sync()`` when ``model`` is DDP and
    ``optimizer`` (a gradzip compressed optimizer) wants each rank's own gradient for its next
    step; otherwise a no-op (plain optimizers always want DDP's averaged gradients)."""
    needs = getattr(optimizer, "needs_grad_sync", True)
    if not needs and hasattr(model, "no_sync"):
        return model.no_sync()
    return nullcontext()


def range_name(kind: str, indices: list[int]) -> str:
    """``kind 0-51`` for the ascending indices 0 to 51, all of them; ``kind 0,2,5`` when some in
    the range are missing (so that two different index lists never share a name)."""
    first, last = indices[0], indices[-1]
    if len(indices) == last - first + 1:
        return f"{kind} {first}-{last}" if last != first else f"{kind} {first}"
    return f"{kind} " + ",".join(str(i) for i in indices)


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """What ``step(closure)`` returns: the closure's loss, evaluated with autograd on (every
    optimizer here steps under ``torch.no_grad``), or None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def check_loadable(optimizer: torch.optim.Optimizer, state_dict: Any, *, kind: str, extra_keys: tuple[str, ...],
                   state_keys: tuple[str, ...], plain_ok: bool, check_group, state_shapes) -> None:
    """Refuse, before anything is loaded, a ``state_dict`` that another optimizer wrote or whose
    settings are out of range.

    Args:
        optimizer: the optimizer about to load it.
        state_dict: what is about to be loaded.
        kind: the optimizer's name, as its :meth:`state_dict` records it under ``"gradzip"``.
        extra_keys: the keys its ``"gradzip"`` section holds (checked where the section names
            no optimizer, as a section written without the name does).
        state_keys: keys every parameter's state of this optimizer holds.
        plain_ok: whether a ``state_dict`` without the ``"gradzip"`` section (a plain
            ``torch.optim.AdamW``'s: its groups must hold AdamW's settings) loads.
        check_group: the optimizer's range check of one parameter group, run on each loaded
            group's settings over the optimizer's own group (same parameters).
        state_shapes: ``(param, settings) -> {key: shape}``, the shape each state tensor of
            ``param`` must have under its group's loaded ``settings``.

    Raises:
        ValueError: naming what the ``state_dict`` is and what this optimizer is, or the setting
            out of range.
    """
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
            or not isinstance(state_dict.get("param_groups"), list):
        raise ValueError("state_dict must be a dict with a 'state' dict and a 'param_groups' list (an optimizer's)")
    extra = state_dict.get("gradzip")
    if extra is None:
        if not plain_ok:
            raise ValueError(f"state_dict has no 'gradzip' section: it is not a {kind} optimizer's "
                             "(a plain torch optimizer's loads only into onebit-adam and zeroone-adam)")
        adamw = ("lr", "betas", "eps", "weight_decay")
        if any(not isinstance(g, dict) or any(k not in g for k in adamw) for g in state_dict["param_groups"]):
            raise ValueError(f"state_dict has no 'gradzip' section and its param_groups lack AdamW's {', '.join(adamw)}: "
                             f"it is not an AdamW optimizer's, which is the plain kind {kind} loads")
    else:
        if not isinstance(extra, dict):
            raise ValueError(f"state_dict's 'gradzip' section must be a dict; got {type(extra).__name__}")
        other = extra.get("optimizer")
        if other is not None and other != kind:
            raise ValueError(f"state_dict is a {other} optimizer's; this optimizer is {kind}")
        missing = [k for k in extra_keys if k not in extra]
        if missing:
            raise ValueError(f"state_dict is not a {kind} optimizer's: its 'gradzip' section lacks {', '.join(missing)}")
    for state in state_dict["state"].values():
        if not isinstance(state, dict):
            raise ValueError(f"state_dict's per-parameter states must be dicts; got {type(state).__name__}")
        if not state:
            continue  # a parameter not stepped yet: torch's state_dict keeps the empty entry that looking it up made
        missing = [k for k in state_keys if k not in state]
        if missing:
            raise ValueError(f"state_dict is not a {kind} optimizer's: a parameter's state lacks {', '.join(missing)}")
    saved = state_dict["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"state_dict has {len(saved)} parameter groups; this optimizer has {len(optimizer.param_groups)}")
    for own, group in zip(optimizer.param_groups, saved):
        if not isinstance(group, dict):
            raise ValueError(f"state_dict's param_groups must be dicts; got {type(group).__name__}")
        settings = {**own, **{k: v for k, v in group.items() if k != "params"}}
        check_group(settings)
        # another model's states (as many parameters, other shapes) would load, and the next step
        # fail deep inside torch with the optimizer's own state already replaced
        for index, param in zip(group.get("params", []), own["params"]):
            state = state_dict["state"].get(index) or {}
            for key, shape in state_shapes(param, settings).items():
                if key in state and not (isinstance(state[key], Tensor) and tuple(state[key].shape) == tuple(shape)):
                    got = tuple(state[key].shape) if isinstance(state[key], Tensor) else type(state[key]).__name__
                    raise ValueError(f"state_dict's {key} of parameter {index!r} is {got} where this optimizer's "
                                     f"parameter needs {tuple(shape)}: the states do not fit (another model's state_dict?)")


def kept_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's settings, to put back after ``torch.optim.Optimizer.load_state_dict`` those
    that the loaded groups lack (``compress`` and TSR-Adam's ranks under a plain AdamW's)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def restore_missing(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    """Put back into each group the settings of :func:`kept_settings` it no longer has."""
    for group, own in zip(optimizer.param_groups, settings):
        for key, value in own.items():
            group.setdefault(key, value)


def added_checked(optimizer: torch.optim.Optimizer, param_group: dict[str, Any], check) -> None:
    """``torch.optim.Optimizer.add_param_group`` followed by ``check(group)`` on the group as
    completed with the defaults; a group that fails the check is taken out again."""
    torch.optim.Optimizer.add_param_group(optimizer, param_group)
    try:
        check(optimizer.param_groups[-1])
    except ValueError:
        optimizer.param_groups.pop()
        raise


def _no_variance(p: Tensor) -> ValueError:
    # the user's model gave this parameter no gradient in warm-up: their setup, not our invariant
    return ValueError(f"a parameter of shape {tuple(p.shape)} had no gradient during the full-precision steps, so "
                        "it has no variance to freeze; give every parameter a gradient in warm-up")


class CompressedAdamBase(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) whose subclasses decide which
    steps communicate what.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``. A group may set
            ``compress=False``: its tensors are exchanged uncompressed (``all_reduce``).
        lr: learning rate (> 0).
        betas: ``(beta1, beta2)`` in [0, 1).
        eps: added to the square root of the variance (>= 0).
        weight_decay: decoupled weight decay per unit of learning rate (>= 0), as AdamW.
        process_group: the data-parallel group; None for the default group.
        average_grads: average gradients with an uncompressed ``all_reduce`` in :meth:`step`
            when the step needs them averaged; False under DDP, whose hook does it.
        reducer: the compressed exchange; None builds :func:`gradzip.optim.exchange.onebit_reducer`
            on the first compressed step. Anything with gradzip's ``Reducer`` interface
            (``reduce(key, tensor, *, step) -> Future`` of the mean, ``state_dict``).
        metrics: where bytes and times of this optimizer's collectives go (share the DDP
            hook's to count both in one place).
        bucket_cap_mb: compressed tensors travel flattened in buckets of up to this many MiB
            (>= 0; DDP's default, 25), two collectives per bucket; each of the ``world_size``
            chunks of a bucket gets one scale, as DeepSpeed's 1-bit Adam compresses its flat
            fp32 parameter groups. 0 sends every tensor alone (one scale per chunk of each).

    Raises:
        ValueError: for a value out of its range, naming it.

    Every parameter in the groups must have a gradient on every rank at every step after the
    first compressed step, or on none (the exchange is collective). State per parameter:
    AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``, plus ``variance_steps`` (how often
    ``exp_avg_sq`` was updated; its bias correction uses it). :meth:`state_dict` adds the
    optimizer's step counter and the exchange's error-feedback buffers, which differ per rank:
    save every rank's own ``state_dict`` to resume bit-exactly.
    """

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        process_group: dist.ProcessGroup | None = None,
        average_grads: bool = True,
        reducer: Reducer | None = None,
        metrics: StepMetrics | None = None,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        defaults = {
            "lr": check_nonnegative(lr, name="lr", strict=True),
            "betas": check_betas(betas),
            # eps 0 divides 0 by 0 where a moment is 0 (a parameter without gradient signal)
            "eps": check_nonnegative(eps, name="eps", strict=True),
            "weight_decay": check_nonnegative(weight_decay, name="weight_decay"),
            "compress": True,
        }
        super().__init__(params, defaults)
        self.bucket_cap_mb = check_nonnegative(bucket_cap_mb, name="bucket_cap_mb")
        self.process_group = process_group
        self.average_grads = check_flag(average_grads, name="average_grads")
        self.metrics = metrics if metrics is not None else StepMetrics()
        self.queue = CollectiveQueue()
        self.steps_taken = 0
        self._reducer = reducer
        self._dense: Reducer | None = None

    #: the name :meth:`state_dict` records; :meth:`load_state_dict` refuses another's
    kind = "adamw"
    #: whether a plain ``torch.optim.AdamW`` state_dict loads (its moments have the parameters' shapes)
    loads_plain_adamw = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group`` with the ranges checked.

        Raises:
            ValueError: naming the setting out of range; the group is not added.
        """
        added_checked(self, param_group, self._check_group)

    def _check_group(self, group: dict[str, Any]) -> None:
        group["betas"] = check_betas(group["betas"])
        # >= 0, not > 0: a learning-rate schedule puts a group's lr at 0 (warm-up from 0, decay to
        # 0), and the state_dict saved then must load; the constructor's lr stays > 0
        check_nonnegative(group["lr"], name="lr")
        check_nonnegative(group["eps"], name="eps", strict=True)
        check_nonnegative(group["weight_decay"], name="weight_decay")
        check_flag(group.get("compress", True), name="compress")

    # ----- what subclasses decide -------------------------------------------------------------

    @property
    def needs_grad_sync(self) -> bool:
        """Whether the next :meth:`step` wants gradients averaged in full precision."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Bring every rank to the same parameters now (collective where the method takes local
        steps; a no-op here, where every step ends synchronised)."""

    # ----- communication ----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return group_world_size(self.process_group)

    @property
    def reducer(self) -> Reducer:
        """The compressed exchange (built on first use)."""
        if self._reducer is None:
            self._reducer = exchange.onebit_reducer(group=self.process_group, queue=self.queue, metrics=self.metrics)
        return self._reducer

    def _dense_reducer(self) -> Reducer:
        if self._dense is None:
            self._dense = exchange.dense_reducer(group=self.process_group, queue=self.queue, metrics=self.metrics)
        return self._dense

    def _dense_mean_(self, tensors: list[Tensor], *, step: int) -> None:
        """Replace each tensor by its mean over the group, uncompressed: one ``all_reduce`` per
        dtype of the flattened tensors (``tensor / world_size`` summed)."""
        if self.world_size == 1 or not tensors:
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        futures, parts = [], []
        for dtype, group in by_dtype.items():
            flat = _flatten_dense_tensors(group)
            futures.append(self._dense_reducer().reduce(("dense", str(dtype)), flat, step=step))
            parts.append(group)
        for fut, group in zip(futures, parts):
            for t, mean in zip(group, _unflatten_dense_tensors(fut.wait(), group)):
                t.copy_(mean)

    def average_gradients_(self, params: list[Tensor], *, step: int) -> None:
        """Average ``p.grad`` of ``params`` over the group in place (uncompressed), unless
        ``average_grads`` is False (DDP did it)."""
        if self.average_grads:
            self._dense_mean_([p.grad for p in params], step=step)

    def exchange_(self, tensors: dict[Hashable, tuple[Tensor, bool]], *, step: int) -> None:
        """Replace every tensor by its mean over the group, in place.

        Args:
            tensors: ``key -> (tensor, compress)``; keys name the error-feedback buffers across
                steps. Compressed tensors are flattened into buckets of up to ``bucket_cap_mb``
                (in key order, identical on every rank; a bucket is keyed by its tensors' keys,
                so a bucket whose members change when a parameter has no gradient takes a
                residual of its own, never another bucket's) and go through :attr:`reducer`,
                every bucket launched before any is awaited; the others through one
                uncompressed ``all_reduce``.
            step: the optimizer step (seeds and schedules of the codec).
        """
        if self.world_size == 1 or not tensors:
            return
        compressed = [(key, t) for key, (t, squeeze) in tensors.items() if squeeze]
        futures = []
        for bucket in self._buckets(compressed):
            parts = [t for _, t in bucket]
            flat = parts[0] if len(parts) == 1 else _flatten_dense_tensors(parts)
            futures.append((parts, self.reducer.reduce(self.bucket_name([key for key, _ in bucket]), flat, step=step,
                                                       shapes=[t.shape for t in parts])))
        self._dense_mean_([t for t, squeeze in tensors.values() if not squeeze], step=step)
        for parts, fut in futures:
            mean = fut.wait()
            if len(parts) == 1:
                parts[0].copy_(mean)
                continue
            for t, part in zip(parts, _unflatten_dense_tensors(mean, parts)):
                t.copy_(part)

    @staticmethod
    def bucket_name(keys: list[Hashable]) -> Hashable:
        """The name a bucket of the tensors ``keys`` keeps its residual under across steps, and the
        monitor shows: ``exp_avg 0-27`` for keys ``("exp_avg", 0)`` to ``("exp_avg", 27)``, all of
        them (:func:`range_name`); other keys as their tuple. Another membership never takes this
        bucket's residual."""
        if all(isinstance(k, tuple) and len(k) == 2 and isinstance(k[1], int) for k in keys):
            kinds = {k[0] for k in keys}
            if len(kinds) == 1:
                return range_name(str(kinds.pop()), [k[1] for k in keys])
        return tuple(keys)

    def _buckets(self, items: list[tuple[Hashable, Tensor]]) -> list[list[tuple[Hashable, Tensor]]]:
        """Consecutive runs of ``items`` of one dtype and device, each up to ``bucket_cap_mb``
        (a larger tensor alone; ``bucket_cap_mb == 0``: every tensor alone)."""
        cap_bytes = self.bucket_cap_mb * 2**20
        buckets: list[list[tuple[Hashable, Tensor]]] = []
        size = 0
        for key, t in items:
            nbytes = t.numel() * t.element_size()
            last = buckets[-1][-1][1] if buckets else None
            if last is None or (last.dtype, last.device) != (t.dtype, t.device) or size + nbytes > cap_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((key, t))
            size += nbytes
        return buckets

    # ----- AdamW's arithmetic, operation for operation ----------------------------------------

    def _state(self, p: Tensor) -> dict[str, Any]:
        """AdamW's state of ``p`` (created as AdamW creates it), plus ``variance_steps``."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["variance_steps"] = 0
        return state

    @staticmethod
    def decay_(p: Tensor, group: dict[str, Any]) -> None:
        """AdamW's decoupled weight decay: ``p *= 1 - lr * weight_decay``."""
        if group["weight_decay"] != 0:
            p.mul_(1 - group["lr"] * group["weight_decay"])

    @staticmethod
    def update_momentum_(state: dict[str, Any], grad: Tensor, group: dict[str, Any]) -> None:
        """``exp_avg = beta1 * exp_avg + (1 - beta1) * grad``, in place (an out-of-place update
        would leave the stored moment without the gradient term)."""
        state["exp_avg"].lerp_(grad, 1 - group["betas"][0])

    @staticmethod
    def update_variance_(state: dict[str, Any], grad: Tensor, group: dict[str, Any]) -> None:
        """``exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad**2``, in place."""
        beta2 = group["betas"][1]
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["variance_steps"] += 1

    def denominator(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        """``sqrt(exp_avg_sq / (1 - beta2 ** variance_steps)) + eps``, as AdamW computes it.

        Raises:
            ValueError: if the variance of ``p`` was never updated (no gradient during
                warm-up), which would divide by zero.
        """
        if state["variance_steps"] == 0:
            raise _no_variance(p)
        bias_correction2 = 1 - group["betas"][1] ** state["variance_steps"]
        return (state["exp_avg_sq"].sqrt() / bias_correction2**0.5).add_(group["eps"])

    def require_variance(self, items: list[tuple[Hashable, Tensor, dict[str, Any]]]) -> None:
        """Raise :meth:`denominator`'s error for the first of ``items`` (``(key, param, group)``)
        whose variance was never updated; called before a step changes anything, so that the error
        leaves every parameter and state as it was.

        Raises:
            ValueError: naming the parameter's shape.
        """
        for _key, p, _group in items:
            if not self.state.get(p, {}).get("variance_steps"):
                raise _no_variance(p)

    def apply_update_(self, p: Tensor, state: dict[str, Any], group: dict[str, Any], denom: Tensor) -> None:
        """``p -= lr / (1 - beta1 ** step) * exp_avg / denom`` (weight decay applied before)."""
        step = float(state["step"])
        bias_correction1 = 1 - group["betas"][0] ** step
        p.addcdiv_(state["exp_avg"], denom, value=-(group["lr"] / bias_correction1))

    def adamw_step_(self, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        """One step of ``torch.optim.AdamW`` (single-tensor path, ``amsgrad=False``), bit for bit."""
        state = self._state(p)
        state["step"] += 1
        self.decay_(p, group)
        self.update_momentum_(state, grad, group)
        self.update_variance_(state, grad, group)
        self.apply_update_(p, state, group, self.denominator(p, state, group))

    def params_with_grad(self) -> list[tuple[Hashable, Tensor, dict[str, Any]]]:
        """``(key, param, group)`` for every parameter with a gradient; the key is the
        parameter's position over all groups (as in :meth:`state_dict`)."""
        out = []
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                    out.append((index, p, group))
                index += 1
        return out

    # ----- checkpoints ------------------------------------------------------------------------

    def _state_shapes(self, p: Tensor, group: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """The shape of each state tensor of ``p`` (0/1 Adam's anchor and update sum included)."""
        return dict.fromkeys(("exp_avg", "exp_avg_sq", "anchor", "update_sum"), tuple(p.shape))

    def extra_state(self) -> dict[str, Any]:
        """Optimizer-level state beyond the step counter (subclasses add theirs)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`extra_state` returned."""

    def state_dict(self) -> dict[str, Any]:
        """AdamW's ``state_dict`` plus ``"gradzip"``: the step counter, the subclass's schedule
        state and the exchange's error-feedback buffers (this rank's; they differ per rank)."""
        out = super().state_dict()
        reducer_state = self._reducer.state_dict() if self._reducer is not None else None
        out["gradzip"] = {"optimizer": self.kind, "steps_taken": self.steps_taken, "exchange": reducer_state,
                          **self.extra_state()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. A plain ``torch.optim.AdamW`` state_dict
        loads too where :attr:`loads_plain_adamw` (the step counter is then taken from the
        parameters' ``step``).

        Raises:
            ValueError: for another optimizer's state_dict (checked before anything is loaded).
        """
        check_loadable(self, state_dict, kind=self.kind, extra_keys=("steps_taken", "exchange", *self.extra_state()),
                       state_keys=("step", "exp_avg", "exp_avg_sq"), plain_ok=self.loads_plain_adamw,
                       check_group=self._check_group, state_shapes=self._state_shapes)
        state_dict = dict(state_dict)
        extra = state_dict.pop("gradzip", None)
        settings = kept_settings(self)
        super().load_state_dict(state_dict)
        restore_missing(self, settings)
        for state in self.state.values():
            if state:  # empty: a parameter not stepped yet
                state.setdefault("variance_steps", int(float(state["step"])))
        if extra is None:
            steps = [int(float(s["step"])) for s in self.state.values()]
            self.steps_taken = max(steps, default=0)
            return
        self.steps_taken = extra["steps_taken"]
        if extra["exchange"] is not None:
            self.reducer.load_state_dict(extra["exchange"])
        self.load_extra_state(extra)
