"""1-bit Adam: full-precision Adam during a warm-up, then a frozen variance and a momentum
exchanged at one bit per element.

Source: Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed" (ICML 2021, arXiv 2102.02888), Algorithm 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from gradzip.comm import Reducer
from gradzip.compressors import check_int
from gradzip.metrics import StepMetrics
from gradzip.optim.base import CompressedAdamBase, closure_loss


class OneBitAdam(CompressedAdamBase):
    """1-bit Adam (Tang et al. 2021, arXiv 2102.02888) as a ``torch.optim.Optimizer`` with
    ``torch.optim.AdamW``'s parameter groups, decoupled weight decay and state.

    Algorithm (numbered as in the paper's Algorithm 1):

    1. Warm-up, steps ``0 .. warmup_steps - 1``: gradients are averaged uncompressed and the
       step is exactly ``torch.optim.AdamW``'s (same arithmetic, same rounding).
    2. Then the variance ``exp_avg_sq`` is frozen (its bias correction stays at the last
       warm-up step). Each step:

       a. every rank updates its momentum with its own gradient,
          ``m_i = beta1 * m + (1 - beta1) * g_i`` (in place);
       b. the momenta are averaged by the two-phase 1-bit compressed all-reduce with worker and
          server error feedback (:func:`gradzip.optim.exchange.onebit_reducer`): every rank
          ends with the same ``m``;
       c. ``p = p * (1 - lr * weight_decay) - lr / (1 - beta1**t) * m / (sqrt(v_hat) + eps)``.

    Biased (sign compression; error feedback makes the bias vanish over steps). Not
    aggregatable (two-phase exchange instead). Bytes each rank hands to collectives per compressed
    step for ``n`` elements on ``W`` ranks: about ``n / 8 * (1 + 1 / W)`` plus the scales, against
    ``4 n`` for an fp32 ``all_reduce`` of the gradient: >= 16x less at any world size (21x at 2
    ranks, 32x in the limit). Groups with ``compress=False`` average the momentum uncompressed.

    Args:
        params: as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW`` (its defaults).
        warmup_steps: full-precision steps before the variance freezes (>= 1: a frozen
            variance needs at least one update). The paper uses 15-25% of training.
        process_group, average_grads, reducer, metrics, bucket_cap_mb: see
            :class:`~gradzip.optim.base.CompressedAdamBase` (DDP: ``average_grads=False`` and
            backward inside :func:`~gradzip.optim.grad_sync`, so the hook steps aside after
            warm-up).

    Raises:
        ValueError: for a value out of its range, naming it.

    Non-finite gradients are not checked here: unlike :class:`~gradzip.optim.DeMo` and
    :class:`~gradzip.optim.TSRAdam`, whose exchanges show every rank a NaN sent by one, a NaN
    on one rank reaches the others unevenly through the sign exchange. Before :meth:`step`,
    agree on skipping such a step on every rank (an ``all_reduce`` MIN of a 0/1 finiteness flag,
    as ``gradzip train`` does) and do not call ``step`` for it.

    Differences from DeepSpeed's ``OnebitAdam``: no engine, fp16 or cupy needed; bias
    correction as AdamW's; the error buffers are kept in :meth:`state_dict` (DeepSpeed resets
    them on load), so a resumed run continues bit-exactly.
    """

    kind = "onebit-adam"

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        warmup_steps: int = 100,
        process_group: dist.ProcessGroup | None = None,
        average_grads: bool = True,
        reducer: Reducer | None = None,
        metrics: StepMetrics | None = None,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        self.warmup_steps = check_int(warmup_steps, name="warmup_steps", low=1)
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, process_group=process_group,
            average_grads=average_grads, reducer=reducer, metrics=metrics, bucket_cap_mb=bucket_cap_mb,
        )

    @property
    def in_warmup(self) -> bool:
        """Whether the next step is a full-precision AdamW step."""
        return self.steps_taken < self.warmup_steps

    @property
    def needs_grad_sync(self) -> bool:
        """True during warm-up (averaged gradients); False after (each rank's own gradient)."""
        return self.in_warmup

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step (collective: every rank of the group must call it).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            the closure's loss, or None.
        """
        loss = closure_loss(closure)
        items = self.params_with_grad()
        step = self.steps_taken
        if self.in_warmup:
            self.average_gradients_([p for _, p, _ in items], step=step)
            for _key, p, group in items:
                self.adamw_step_(p, p.grad, group)
        else:
            self.require_variance(items)  # before the momenta change: the error leaves no half step
            momenta = {}
            for key, p, group in items:
                state = self._state(p)
                state["step"] += 1
                self.update_momentum_(state, p.grad, group)
                momenta[("exp_avg", key)] = (state["exp_avg"], group["compress"])
            self.exchange_(momenta, step=step)
            for _key, p, group in items:
                state = self.state[p]
                self.decay_(p, group)
                self.apply_update_(p, state, group, self.denominator(p, state, group))
        self.steps_taken += 1
        return loss

    def extra_state(self) -> dict:
        return {"warmup_steps": self.warmup_steps}

    def load_extra_state(self, state: dict) -> None:
        self.warmup_steps = state["warmup_steps"]
