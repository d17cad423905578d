"""TSR-Adam: Adam whose matrices communicate only an r x r core between two shared bases.

Source: Dang et al., "From O(mn) to O(r^2): Two-Sided Low-Rank Communication for Adam in
Distributed Training with Memory Efficiency" (arXiv 2602.08007); reference code DKmiyan/TSR-Adam,
``TSR_torch/`` (its ``proj_type='full'`` projector).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradzip.comm import make_reducer, nonfinite
from gradzip.compressors import check_int
from gradzip.compressors.base import seeded_generator
from gradzip.compressors.kernels import wire
from gradzip.compressors.values import check_flag
from gradzip.metrics import StepMetrics
from gradzip.optim.base import CompressedAdamBase, check_nonnegative, closure_loss
from gradzip.optim.collectives import mean_all_reduce

#: the name its buckets carry in StepMetrics
CODEC = "tsr-adam"

#: the codec of the dense parameters' gradients with ``dense_int8``
DENSE_CODEC = "int8"


class TSRAdam(CompressedAdamBase):
    """Two-Sided Low-Rank Adam (Dang et al. 2026, arXiv 2602.08007) as a ``torch.optim.Optimizer``
    with ``torch.optim.AdamW``'s parameter groups, decoupled weight decay and state; it owns its
    communication (no DDP all_reduce underneath: run backward under ``no_sync``, e.g. inside
    :func:`~gradzip.optim.grad_sync`, which does so for every step of this optimizer).

    Per 2-D weight ``W`` (m x n) of a group with ``approx_rank=r``, every rank holds the same
    orthonormal bases ``U`` (m x r) and ``V`` (n x r). Each step ``t`` (counted from 0):

    1. Refresh, when the bases are missing or ``update_gap`` steps old: a randomized SVD of the
       mean gradient ``G`` over ranks with ``l = min(r + oversampling, m, n)`` columns, computed
       only from all_reduced sketches, so no rank ever sends its gradient:
       ``Y = mean(G_i Omega)`` (m x l; ``Omega`` n x l standard normal from a ``torch.Generator``
       seeded from ``(seed, t, parameter index)``, identical on every rank), ``Q = qr(Y)``;
       ``power_iters`` times ``Z = mean(G_i^T Q)``, ``Q' = qr(Z)``, ``Y = mean(G_i Q')``,
       ``Q = qr(Y)``; then ``B = mean(Q^T G_i)`` (l x n), ``B = Ut S Vh``, ``U = Q Ut[:, :r]``,
       ``V = Vh[:r]^T``. Every rank computes the QRs and the SVD from the same summed sketches.
    2. Core: ``C = mean(U^T G_i V)`` (r x r), one all_reduce for all matrices of the step, with the
       full gradients of the dense parameters in the same buffer.
    3. AdamW in core space, operation for operation as ``torch.optim.AdamW`` on ``C``:
       ``W *= 1 - lr * weight_decay``; ``m = lerp(m, C, 1 - beta1)``;
       ``v = beta2 v + (1 - beta2) C^2``; ``W -= scale * lr / (1 - beta1^t) * U (m / d) V^T``
       with ``d = sqrt(v / (1 - beta2^t)) + eps``. Moments are kept across refreshes, as the
       reference code keeps them, unless ``moment_transfer``.

    Parameters that are not 2-D (biases, norms; conv kernels too), and every parameter of a group
    with ``approx_rank=None`` or ``compress=False``, take dense AdamW steps on the all_reduced
    gradient, as the paper's "regular" parameters. Embeddings are 2-D weights: the paper gives
    them their own group (its scripts: rank 64-256, ``update_gap=2``, the same scale); so does
    ``gradzip train --optimizer tsr-adam``.

    Bytes each rank hands to ``all_reduce`` at step ``t`` (``s`` bytes per element: the
    gradient dtype's, or 2 with ``wire_bits=16``): ``s * (sum_low r^2 + sum_dense numel)`` every step, plus
    ``s * (1 + power_iters) * l * (m + n)`` for each matrix refreshed at ``t``; amortised,
    ``s * (sum_low [r^2 + (1 + power_iters) l (m + n) / update_gap] + sum_dense numel)``
    (:meth:`payload_nbytes`, :meth:`mean_payload_nbytes`), against ``s * sum numel`` for the
    gradient all_reduce of AdamW. With ``dense_int8`` the ``sum_dense numel`` term leaves the
    core buffer: each bucket of dense gradients costs ``numel + 4 ceil(numel / 256)`` bytes (or its
    raw bytes where those are no more). Biased (the update lives in a rank-r subspace); aggregatable
    (every payload is a sum).

    Args:
        params: as for ``torch.optim.AdamW``; a group may set ``approx_rank``, ``update_gap`` and
            ``scale`` of its own (an ``approx_rank`` of None makes the group dense).
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW`` (its defaults).
        approx_rank: r, the side of the core (an integer >= 1, at most ``min(m, n)`` of every
            2-D weight of the group).
        update_gap: steps between refreshes of the bases (>= 1).
        scale: multiplies the low-rank update (> 0); the reference code's default 1.0 (its
            pre-training scripts use 0.5 to 0.75 at lr 0.01).
        oversampling: extra sketch columns of the randomized SVD (>= 0; the reference's 5).
        power_iters: power iterations of the randomized SVD (>= 0; the reference's 1).
        seed: seeds the sketches' ``Omega`` (identical on every rank).
        wire_bits: 32 sends cores, sketches and dense gradients in the gradient's dtype (the
            paper); 16 sends them as bfloat16 (not in the paper; fp16 and bf16 gradients go as they
            are): each rank's share (divided by world_size) is rounded to bfloat16, saturated at
            its largest finite value over world_size, and summed in bfloat16, so a mean carries
            about 3 significant digits; bfloat16 keeps fp32's exponent range, so small cores do
            not flush to zero as fp16's would. No error feedback: the rounding is lost.
        dense_int8: send the dense parameters' gradients as int8 codes on scales shared by every
            rank, with error feedback (the ``int8`` codec's reducer, :mod:`gradzip.comm.int8sum`,
            groups of 256 elements: ``numel + 4 ceil(numel / 256)`` bytes per bucket of
            ``bucket_cap_mb``), instead of in the core buffer. Not in the paper; for a model whose
            embedding is also its output layer (tied), which the paper's scripts would train
            dense. Groups with ``compress=False`` keep their gradients uncompressed in the core
            buffer. Its residuals are this rank's own and go in :meth:`state_dict`; at most 127
            ranks (``floor(127 / world_size)`` levels per rank, 63 at 2). Default False.
        moment_transfer: on a refresh, carry the moments over to the new bases instead of keeping
            their numbers as the reference code does (not in the paper): ``m = A m B`` and
            ``v = (A * A) v (B * B)`` with ``A = U_new^T U_old`` and ``B = V_old^T V_new``, so
            that ``U m V^T`` is the momentum's projection on the new bases (exact at full rank);
            the variance's map treats the entries as independent. Default False.
        bucket_cap_mb: with ``dense_int8``, the dense gradients travel in buckets of up to this
            many MiB (>= 0; one scale per 256 elements whatever the bucket).
        process_group: the data-parallel group; None for the default group.
        metrics: where the bytes and times of its collectives go.

    Raises:
        ValueError: for a value out of its range, naming it (an ``approx_rank`` larger than a
            dimension of a weight names the weight's shape).

    Differences from the reference code: the refresh all_reduces sketches (the reference
    computes the randomized SVD of an already averaged full gradient); AdamW's arithmetic
    (``eps`` added after the bias correction, decay before the update; the reference follows
    Hugging Face's AdamW: ``eps`` before the correction, decay after); no projector for tensors
    of more than 2 dimensions (they stay dense). A step is skipped on every rank, leaving no
    trace (bases, moments, step counter), when any rank's gradient holds inf or NaN: the
    non-finite value reaches every rank through the sum (:mod:`gradzip.comm.nonfinite`).
    The QRs and SVD are bit-identical across ranks when the ranks run the same LAPACK on the same
    kind of CPU/GPU; elsewhere the bases agree to rounding.
    """

    kind = "tsr-adam"
    loads_plain_adamw = False  # its moments live in core space, r x r

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        approx_rank: int | None = 128,
        update_gap: int = 200,
        scale: float = 1.0,
        oversampling: int = 5,
        power_iters: int = 1,
        seed: int = 0,
        moment_transfer: bool = False,
        wire_bits: int = 32,
        dense_int8: bool = False,
        bucket_cap_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None,
        metrics: StepMetrics | None = None,
    ) -> None:
        self.moment_transfer = check_flag(moment_transfer, name="moment_transfer")
        self.wire_bits = wire.check_bits(wire_bits, allowed=(16, 32), name="wire_bits")
        self.dense_int8 = check_flag(dense_int8, name="dense_int8")
        self.oversampling = check_int(oversampling, name="oversampling", low=0)
        self.power_iters = check_int(power_iters, name="power_iters", low=0)
        self.seed = check_int(seed, name="seed", low=0)
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, process_group=process_group,
            metrics=metrics, bucket_cap_mb=bucket_cap_mb,
        )
        if self.dense_int8:
            self._reducer = make_reducer(DENSE_CODEC, group=process_group, queue=self.queue, metrics=self.metrics)
        extra = {"approx_rank": approx_rank, "update_gap": update_gap, "scale": scale}
        self.defaults.update(extra)
        for group in self.param_groups:
            for name, value in extra.items():
                group.setdefault(name, value)
            self._check_group(group)
        self.skipped_steps = 0
        self.exchanges = 0  # int8 exchanges of the dense gradients (dense_int8), skipped steps included
        self.last_step_skipped = False

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if any(name not in group for name in ("approx_rank", "update_gap", "scale")):
            return  # during construction: checked once the defaults hold them
        if group["approx_rank"] is not None:
            rank = check_int(group["approx_rank"], name="approx_rank", low=1)
            for p in group["params"]:
                if p.dim() == 2 and rank > min(p.shape):
                    raise ValueError(
                        f"approx_rank must be an integer in [1, min(m, n)] of every weight of its group; "
                        f"got {rank} for a weight of shape {tuple(p.shape)}; give the weights of other sizes "
                        "parameter groups of their own (a dict with its own approx_rank, or approx_rank=None to "
                        "step them dense)"
                    )
        check_int(group["update_gap"], name="update_gap", low=1)
        check_nonnegative(group["scale"], name="scale", strict=True)

    # ----- which parameters are projected -----------------------------------------------------

    @staticmethod
    def is_low_rank(p: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``p`` takes core steps (a 2-D weight of a group with a rank) or dense ones."""
        return p.dim() == 2 and group["approx_rank"] is not None and group["compress"]

    def _sketch_columns(self, p: Tensor, group: dict[str, Any]) -> int:
        return min(group["approx_rank"] + self.oversampling, *p.shape)

    def _refresh_due(self, p: Tensor, group: dict[str, Any], step: int) -> bool:
        state = self.state[p]
        return "left" not in state or step - state["refreshed_at"] >= group["update_gap"]

    @property
    def needs_grad_sync(self) -> bool:
        """Always False: every step exchanges cores (and sketches), never the gradient."""
        return False

    # ----- bytes ------------------------------------------------------------------------------

    def payload_nbytes(self, step: int | None = None) -> int:
        """Bytes this rank hands to ``all_reduce`` at ``step`` (default: the next step), for the
        parameters that have a gradient now (see the class docstring for the formula)."""
        step = self.steps_taken if step is None else step
        total = 0
        items = self.params_with_grad()
        total += self._int8_nbytes([(key, p.grad) for key, p, group in items if self._int8_coded(p, group)])
        for _key, p, group in items:
            size = self._wire_size(p.grad)
            if not self.is_low_rank(p, group):
                total += 0 if self._int8_coded(p, group) else size * p.numel()
                continue
            total += size * group["approx_rank"] ** 2
            if self._refresh_due(p, group, step):
                total += size * (1 + self.power_iters) * self._sketch_columns(p, group) * sum(p.shape)
        return total

    def mean_payload_nbytes(self) -> float:
        """Bytes per step averaged over a refresh period, for every parameter of the groups."""
        total = 0.0
        coded = [p for group in self.param_groups for p in group["params"] if self._int8_coded(p, group)]
        total += self._int8_nbytes(list(enumerate(coded)))
        for group in self.param_groups:
            for p in group["params"]:
                size = self._wire_size(p)
                if not self.is_low_rank(p, group):
                    total += 0 if self._int8_coded(p, group) else size * p.numel()
                    continue
                sketch = (1 + self.power_iters) * self._sketch_columns(p, group) * sum(p.shape)
                total += size * (group["approx_rank"] ** 2 + sketch / group["update_gap"])
        return total

    def _int8_coded(self, p: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``p``'s gradient goes as int8 codes: a dense parameter of a group that
        compresses, under ``dense_int8`` (a group with ``compress=False`` travels uncompressed)."""
        return self.dense_int8 and group["compress"] and not self.is_low_rank(p, group)

    def _int8_nbytes(self, tensors: list[tuple[Hashable, Tensor]]) -> int:
        """The int8 payload of ``tensors`` in :meth:`exchange_`'s buckets (a bucket whose codes
        and scales would not be smaller than its raw bytes travels raw)."""
        total = 0
        for bucket in self._buckets(tensors):
            numel = sum(t.numel() for _, t in bucket)
            total += self.reducer.bucket_nbytes(numel, bucket[0][1].dtype)
        return total

    def _wire_size(self, t: Tensor) -> int:
        """Bytes per element of ``t`` on the wire (those of :meth:`_wire_dtype`)."""
        dtype = self._wire_dtype(t)
        return t.element_size() if dtype is None else dtype.itemsize

    def _wire_dtype(self, t: Tensor) -> torch.dtype | None:
        """The dtype ``t`` is summed in on the wire (None: its own)."""
        return torch.bfloat16 if self.wire_bits == 16 and t.element_size() > 2 else None

    # ----- bases ------------------------------------------------------------------------------

    def _low_rank_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """AdamW's state of ``p`` with moments in core space (r x r)."""
        state = self.state[p]
        if "exp_avg" not in state:
            rank = group["approx_rank"]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros(rank, rank, dtype=p.dtype, device=p.device)
            state["exp_avg_sq"] = torch.zeros(rank, rank, dtype=p.dtype, device=p.device)
            state["variance_steps"] = 0
        return state

    def _group_of(self, p: Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise ValueError("the tensor is not a parameter of this optimizer")

    def set_bases(self, p: Tensor, left: Tensor, right: Tensor) -> None:
        """Give weight ``p`` the bases ``left`` (m x r) and ``right`` (n x r), both with
        orthonormal columns, as if refreshed now: the next refresh comes ``update_gap`` steps
        later. Every rank must set the same bases.

        Raises:
            ValueError: if ``p`` is not a low-rank weight of this optimizer or a shape is wrong.
        """
        group = self._group_of(p)
        if not self.is_low_rank(p, group):
            raise ValueError(f"the weight of shape {tuple(p.shape)} takes dense steps; it has no bases")
        rank = group["approx_rank"]
        m, n = p.shape
        if tuple(left.shape) != (m, rank) or tuple(right.shape) != (n, rank):
            raise ValueError(
                f"left and right must be ({m}, {rank}) and ({n}, {rank}); got {tuple(left.shape)} and {tuple(right.shape)}"
            )
        state = self._low_rank_state(p, group)
        state["left"] = left.detach().to(p.dtype).clone()
        state["right"] = right.detach().to(p.dtype).clone()
        state["refreshed_at"] = self.steps_taken

    def _mean(self, tensors: list[Tensor], *, key: Hashable, dense_bytes: int = 0) -> tuple[list[Tensor], bool]:
        """The means over ranks of ``tensors`` (one all_reduce of their concatenation), and
        whether every rank's were finite. At world size 1: the tensors themselves."""
        # nothing to send (dense_int8 with no low-rank weight: no cores, the dense gradients go
        # apart; or only zero-element tensors): torch.cat refuses an empty list, and a
        # zero-element collective is a round trip for nothing (cases.md C1: some gloo builds refuse
        # it); every rank has the same tensors, so every rank skips it together
        if self.world_size == 1 or sum(t.numel() for t in tensors) == 0:
            return tensors, all(nonfinite.is_finite(t) for t in tensors)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        mean, finite = mean_all_reduce(flat, key=key, dense_bytes=dense_bytes, group=self.process_group,
                                       queue=self.queue, metrics=self.metrics, codec=CODEC,
                                       wire_dtype=self._wire_dtype(flat))
        return [part.view_as(t) for part, t in zip(mean.split([t.numel() for t in tensors]), tensors)], finite

    def _refresh(self, due: list[tuple[Hashable, Tensor, dict[str, Any]]], step: int) -> dict[Tensor, tuple[Tensor, Tensor]] | None:
        """New bases of the weights in ``due`` from all_reduced sketches of their mean gradient
        (step 1 of the class docstring); None when a sketch was not finite on some rank."""
        grads = [p.grad for _, p, _ in due]
        omegas = []
        for key, p, group in due:
            gen = seeded_generator(self.seed, step, ("tsr-omega", key), device=p.device)
            omegas.append(torch.randn(p.shape[1], self._sketch_columns(p, group), generator=gen, device=p.device, dtype=p.dtype))
        sketches, finite = self._mean([g @ omega for g, omega in zip(grads, omegas)], key=("tsr-sketch", "range"))
        if not finite:
            return None
        ranges = [_orthonormal(y) for y in sketches]
        for i in range(self.power_iters):
            sketches, finite = self._mean([g.T @ q for g, q in zip(grads, ranges)], key=("tsr-sketch", "corange", i))
            if not finite:
                return None
            coranges = [_orthonormal(z) for z in sketches]
            sketches, finite = self._mean([g @ q for g, q in zip(grads, coranges)], key=("tsr-sketch", "range", i))
            if not finite:
                return None
            ranges = [_orthonormal(y) for y in sketches]
        projected, finite = self._mean([q.T @ g for g, q in zip(grads, ranges)], key=("tsr-sketch", "projection"))
        if not finite:
            return None
        bases = {}
        for (_key, p, group), q, b in zip(due, ranges, projected):
            u_small, _s, vh = (t.to(b.dtype) for t in torch.linalg.svd(_wide_enough(b), full_matrices=False))
            rank = group["approx_rank"]
            bases[p] = ((q @ u_small[:, :rank]).contiguous(), vh[:rank].T.contiguous())
        return bases

    # ----- the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step (collective: every rank of the group must call it, with a gradient
        for the same parameters). Sets :attr:`last_step_skipped` when a non-finite gradient on
        some rank made every rank skip it.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            the closure's loss, or None.
        """
        loss = closure_loss(closure)
        t = self.steps_taken
        items = self.params_with_grad()
        low = [(key, p, group) for key, p, group in items if self.is_low_rank(p, group)]
        dense = [(key, p, group) for key, p, group in items if not self.is_low_rank(p, group)]
        due = [item for item in low if self._refresh_due(item[1], item[2], t)]
        bases = self._refresh(due, t) if due else {}
        self.last_step_skipped = bases is None
        if bases is None:
            self.skipped_steps += 1
            return loss
        for _key, p, _group in low:
            if p not in bases:
                bases[p] = (self.state[p]["left"], self.state[p]["right"])
        cores = [bases[p][0].T @ p.grad @ bases[p][1] for _, p, _ in low]
        coded = [item for item in dense if self._int8_coded(item[1], item[2])]
        buffered = [item for item in dense if not self._int8_coded(item[1], item[2])]  # they ride with the cores
        dense_bytes = sum(p.grad.numel() * p.grad.element_size() for _, p, _ in low + buffered)
        means, finite = self._mean(cores + [p.grad for _, p, _ in buffered], key=("tsr-core",), dense_bytes=dense_bytes)
        if finite and coded:
            coded_means, finite = self._int8_mean(coded)
            means = means + coded_means
        dense = buffered + coded  # in the order of their means
        if not finite:
            self.last_step_skipped = True
            self.skipped_steps += 1
            return loss
        refreshed = {id(p) for _, p, _ in due}
        for (_key, p, group), core in zip(low, means[: len(low)]):
            state = self._low_rank_state(p, group)
            if id(p) in refreshed:
                if self.moment_transfer and "left" in state:
                    left_map = bases[p][0].T @ state["left"]  # new core coordinates of the old ones
                    right_map = state["right"].T @ bases[p][1]
                    state["exp_avg"] = left_map @ state["exp_avg"] @ right_map
                    state["exp_avg_sq"] = (left_map * left_map) @ state["exp_avg_sq"] @ (right_map * right_map)
                state["left"], state["right"] = bases[p]
                state["refreshed_at"] = t
            self._core_step_(p, state, core, group)
        for (_key, p, group), grad in zip(dense, means[len(low):]):
            self.adamw_step_(p, grad, group)
        self.steps_taken += 1
        return loss

    def _int8_mean(self, dense: list[tuple[Hashable, Tensor, dict[str, Any]]]) -> tuple[list[Tensor], bool]:
        """The means over ranks of the dense gradients through the int8 reducer (``dense_int8``),
        and whether every rank's were finite; the residuals of a step that was not finite on
        some rank are put back. At world size 1: copies of the gradients."""
        grads = [p.grad.clone() for _, p, _ in dense]
        finite_here = nonfinite.all_finite(grads)
        if self.world_size == 1:
            return grads, finite_here
        if not finite_here:  # the marker in the collective, so every rank skips and puts its residual back
            for g in grads:
                g.fill_(float("nan"))
        # the reducer's own step count: a skipped step is retaken under a new number, since the
        # reducer remembers the numbers of non-finite steps
        self.exchange_({("tsr-dense", key): (g, True) for (key, _, _), g in zip(dense, grads)}, step=self.exchanges)
        self.exchanges += 1
        self.reducer.settle()
        return grads, not nonfinite.received_marker(grads)

    def _core_step_(self, p: Tensor, state: dict[str, Any], core: Tensor, group: dict[str, Any]) -> None:
        """Step 3 of the class docstring."""
        state["step"] += 1
        self.decay_(p, group)
        self.update_momentum_(state, core, group)
        self.update_variance_(state, core, group)
        normalized = state["exp_avg"] / self.denominator(p, state, group)
        bias_correction1 = 1 - group["betas"][0] ** float(state["step"])
        p.add_(state["left"] @ normalized @ state["right"].T, alpha=-(group["scale"] * group["lr"] / bias_correction1))

    # ----- checkpoints ------------------------------------------------------------------------

    def _state_shapes(self, p: Tensor, group: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        if not self.is_low_rank(p, group):
            return super()._state_shapes(p, group)
        rank = group["approx_rank"]
        return {"exp_avg": (rank, rank), "exp_avg_sq": (rank, rank), "left": (p.shape[0], rank),
                "right": (p.shape[1], rank)}

    def extra_state(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "seed": self.seed, "oversampling": self.oversampling,
                "power_iters": self.power_iters, "dense_int8": self.dense_int8,
                "exchanges": self.exchanges}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.skipped_steps = state["skipped_steps"]
        self.seed = state["seed"]
        self.oversampling = state["oversampling"]
        self.power_iters = state["power_iters"]
        # the saved number, as for a fresh optimizer: loading the reducer's state (the base
        # class, before this) clears its ledger of skipped exchanges, so a clean retake after a
        # rollback over a skipped step keeps its residuals under the number reused
        self.exchanges = state["exchanges"]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: for another optimizer's state_dict, one saved with another ``dense_int8``
                (its residuals belong to that exchange), or moments that do not fit the
                parameters (checked before anything is loaded).
        """
        extra = state_dict.get("gradzip") if isinstance(state_dict, dict) else None
        if isinstance(extra, dict) and extra.get("optimizer") == self.kind:
            saved = extra.get("dense_int8", False)
            if saved != self.dense_int8:
                raise ValueError(f"state_dict was saved with dense_int8={saved}; this optimizer has dense_int8={self.dense_int8}")
        super().load_state_dict(state_dict)


def _wide_enough(t: Tensor) -> Tensor:
    """``t`` in a dtype the QR and SVD kernels take everywhere (fp32 for fp16 and bf16, which CPU
    LAPACK lacks); fp32 and fp64 unchanged."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _orthonormal(y: Tensor) -> Tensor:
    """An orthonormal basis of ``y``'s columns (QR's ``Q``), in ``y``'s dtype."""
    return torch.linalg.qr(_wide_enough(y)).Q.to(y.dtype)
