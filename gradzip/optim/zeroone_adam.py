"""0/1 Adam: adaptive variance freezing and 1-bit synchronisation with local steps.

Source: Lu et al., "Maximizing Communication Efficiency for Large-scale Training via 0/1 Adam"
(ICLR 2023, arXiv 2202.06009), Algorithm 1 with the policies of its Section 4.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradzip.comm import Reducer
from gradzip.compressors import check_int
from gradzip.metrics import StepMetrics
from gradzip.optim.base import CompressedAdamBase, closure_loss


class ZeroOneAdam(CompressedAdamBase):
    """0/1 Adam (Lu et al. 2022, arXiv 2202.06009) as a ``torch.optim.Optimizer`` with
    ``torch.optim.AdamW``'s parameter groups, decoupled weight decay and state.

    Steps are counted from 1. Two stages:

    1. Adaptive variance freezing, steps ``1 .. var_freeze_step``. Step ``t`` is a *variance
       step* when ``t % var_interval == 0``: gradients are averaged uncompressed and the step is
       exactly AdamW's (momentum and variance updated). On every other step the gradients are
       averaged by the two-phase 1-bit all-reduce with error feedback, the momentum is updated
       with that average and the variance is left as it is. ``var_interval`` starts at 1 and
       doubles after every ``var_update_scaler`` variance steps (the paper's exponential
       policy for the set T_v, with kappa = ``var_update_scaler``).
    2. 1-bit synchronisation with local steps, after ``var_freeze_step``: the variance is
       frozen; every rank takes Adam steps with its own gradient and accumulates its update
       ``u = u * (1 - lr * weight_decay) + lr_t * m`` (``lr_t`` the bias-corrected step
       size). Step ``t`` is a *sync step* when ``t % local_interval == 0``: ``u`` is averaged by
       the 1-bit all-reduce with error feedback, the parameters are set from the previous sync
       point, ``p = anchor * prod(1 - lr * weight_decay) - mean(u) / (sqrt(v_hat) + eps)``, and the
       momentum to ``mean(u) / sum(lr_t)``. ``local_interval`` starts at 1 and doubles every
       ``local_step_scaler`` steps up to ``local_step_clipper`` (the paper's H and its
       learning-rate-driven policy for T_u, with a fixed doubling period).

    Implemented from the paper: the variance-update set T_v with its exponential policy, the
    1-bit all-reduce of gradients between variance updates, the freezing of the variance, local
    steps with 1-bit synchronisation of the accumulated update and the momentum recovered from
    it. Not implemented: a sync set T_u driven by the learning-rate schedule itself (a fixed
    doubling period instead, as DeepSpeed's ``ZeroOneAdam``), and the paper's momentum
    approximation between syncs (each rank keeps its own momentum until the next sync).

    Ranks hold bit-identical parameters after every stage-1 step and after every sync step;
    between syncs they differ (that is what local steps are). :meth:`synchronize` forces a sync
    (before an evaluation or a checkpoint). Stage 2 keeps two more tensors per parameter (the
    anchor and ``u``). Biased (sign compression with error feedback); not aggregatable. Bytes per
    rank: ``4 n`` on variance steps, about ``n / 8 * (1 + 1 / world_size)`` plus scales on other
    stage-1 steps and on sync steps, 0 on local steps.

    Args:
        params: as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW`` (its defaults).
        var_freeze_step: last step of stage 1 (>= 1); the paper puts it at the end of the
            learning-rate warm-up.
        var_update_scaler: kappa, variance steps per doubling of ``var_interval`` (>= 1).
        local_step_scaler: stage-2 steps per doubling of ``local_interval`` (>= 1).
        local_step_clipper: H, the largest ``local_interval`` (>= 1).
        process_group, average_grads, reducer, metrics, bucket_cap_mb: see
            :class:`~gradzip.optim.base.CompressedAdamBase`.

    Raises:
        ValueError: for a value out of its range, naming it.

    Non-finite gradients are not checked here: unlike :class:`~gradzip.optim.DeMo` and
    :class:`~gradzip.optim.TSRAdam`, whose exchanges show every rank a NaN sent by one, a NaN
    on one rank reaches the others unevenly through the sign exchange and the local steps.
    Before :meth:`step`, agree on skipping such a step on every rank (an ``all_reduce`` MIN of a
    0/1 finiteness flag, as ``gradzip train`` does) and do not call ``step`` for it.
    """

    kind = "zeroone-adam"

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        var_freeze_step: int = 100,
        var_update_scaler: int = 16,
        local_step_scaler: int = 1000,
        local_step_clipper: int = 16,
        process_group: dist.ProcessGroup | None = None,
        average_grads: bool = True,
        reducer: Reducer | None = None,
        metrics: StepMetrics | None = None,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        self.var_freeze_step = check_int(var_freeze_step, name="var_freeze_step", low=1)
        self.var_update_scaler = check_int(var_update_scaler, name="var_update_scaler", low=1)
        self.local_step_scaler = check_int(local_step_scaler, name="local_step_scaler", low=1)
        self.local_step_clipper = check_int(local_step_clipper, name="local_step_clipper", low=1)
        self.var_interval = 1
        self.var_counter = 0
        self.local_interval = 1
        self.local_counter = 0
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, process_group=process_group,
            average_grads=average_grads, reducer=reducer, metrics=metrics, bucket_cap_mb=bucket_cap_mb,
        )

    # ----- the schedule -----------------------------------------------------------------------

    @property
    def next_step(self) -> int:
        """The 1-based number of the coming step."""
        return self.steps_taken + 1

    @property
    def frozen(self) -> bool:
        """Whether the coming step is in stage 2 (variance frozen, local steps)."""
        return self.next_step > self.var_freeze_step

    def is_variance_step(self, t: int) -> bool:
        return not t > self.var_freeze_step and t % self.var_interval == 0

    def is_sync_step(self, t: int) -> bool:
        return t > self.var_freeze_step and t % self.local_interval == 0

    @property
    def needs_grad_sync(self) -> bool:
        """True when the coming step is a variance step (uncompressed averaged gradients)."""
        return self.is_variance_step(self.next_step)

    def _advance_schedule(self, t: int) -> None:
        if t <= self.var_freeze_step:
            if t % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
        else:
            self.local_counter += 1
            if self.local_counter == self.local_step_scaler:
                self.local_counter = 0
                self.local_interval = min(self.local_step_clipper, self.local_interval * 2)

    # ----- steps ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step (collective on variance, compressed and sync steps: every rank
        of the group must call it).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            the closure's loss, or None.
        """
        loss = closure_loss(closure)
        t = self.next_step
        items = self.params_with_grad()
        variance_step = self.is_variance_step(t)
        if not variance_step:
            self.require_variance(items)  # before anything changes: the error leaves no half step
        if variance_step:
            self.average_gradients_([p for _, p, _ in items], step=t)
            for _key, p, group in items:
                self.adamw_step_(p, p.grad, group)
        elif t <= self.var_freeze_step:
            self.exchange_({("grad", key): (p.grad, group["compress"]) for key, p, group in items}, step=t)
            for _key, p, group in items:
                state = self._state(p)
                state["step"] += 1
                self.decay_(p, group)
                self.update_momentum_(state, p.grad, group)
                self.apply_update_(p, state, group, self.denominator(p, state, group))
        else:
            for _key, p, group in items:
                self._local_step_(p, group)
            if self.is_sync_step(t):
                self._sync_(items, step=t)
        self._advance_schedule(t)
        self.steps_taken += 1
        return loss

    def _local_step_(self, p: Tensor, group: dict[str, Any]) -> None:
        """An Adam step with this rank's gradient and the frozen variance; accumulates ``u``."""
        state = self._state(p)
        if "anchor" not in state:
            state["anchor"] = p.detach().clone()
            state["update_sum"] = torch.zeros_like(p)
            state["decay"] = 1.0
            state["lr_sum"] = 0.0
        state["step"] += 1
        decay = 1 - group["lr"] * group["weight_decay"]
        step_size = group["lr"] / (1 - group["betas"][0] ** float(state["step"]))
        self.decay_(p, group)
        self.update_momentum_(state, p.grad, group)
        p.addcdiv_(state["exp_avg"], self.denominator(p, state, group), value=-step_size)
        state["update_sum"].mul_(decay).add_(state["exp_avg"], alpha=step_size)
        state["decay"] *= decay
        state["lr_sum"] += step_size

    def _sync_(self, items: list, *, step: int) -> None:
        """Average the accumulated updates (1-bit) and move every rank to the same point."""
        pending = [(key, p, group) for key, p, group in items if self.state[p].get("lr_sum", 0.0) > 0]
        self.exchange_({("update", key): (self.state[p]["update_sum"], group["compress"]) for key, p, group in pending}, step=step)
        for _key, p, group in pending:
            state = self.state[p]
            denom = self.denominator(p, state, group)
            p.copy_(state["anchor"]).mul_(state["decay"]).addcdiv_(state["update_sum"], denom, value=-1)
            torch.div(state["update_sum"], state["lr_sum"], out=state["exp_avg"])
            state["anchor"].copy_(p)
            state["update_sum"].zero_()
            state["decay"] = 1.0
            state["lr_sum"] = 0.0

    @torch.no_grad()
    def synchronize(self) -> None:
        """Sync now (collective): after it every rank holds the same parameters. A no-op
        where no local step is pending."""
        items = [(key, p, group) for key, p, group in self._all_items() if "anchor" in self.state[p]]
        if items:
            self._sync_(items, step=self.steps_taken)

    def _all_items(self) -> list:
        out, index = [], 0
        for group in self.param_groups:
            for p in group["params"]:
                out.append((index, p, group))
                index += 1
        return out

    # ----- checkpoints ------------------------------------------------------------------------

    def extra_state(self) -> dict[str, Any]:
        return {
            "var_interval": self.var_interval,
            "var_counter": self.var_counter,
            "local_interval": self.local_interval,
            "local_counter": self.local_counter,
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        for name in ("var_interval", "var_counter", "local_interval", "local_counter"):
            setattr(self, name, state[name])
