"""SEPARATE's one-round reducer (Zhao et al., ICLR 2025; arithmetic in
:mod:`gradzip.compressors.separate`).

For one bucket (a flat tensor holding several gradients) at a step past ``start_step``:

1. Split the bucket into gradients by ``shapes``; those that compress are viewed as ``m x n``
   matrices and error-compensated in fp32 (``c = g + e``).
2. One all_reduce of ``[uncompressed / world_size, c_1 A_1 / world_size .. c_k A_k / world_size]``
   in the bucket's dtype, each ``A`` drawn from ``(seed, step, name)`` with ``name`` the gradient's
   :func:`~gradzip.keys.tensor_key`.
3. Decode each summed payload as ``P A^T``; the same draw of ``A`` gives this rank's own decode
   ``c A A^T`` for the moving-average error memory.

Non-finite gradients (:mod:`gradzip.comm.nonfinite`): a rank whose bucket holds inf or NaN sends an
all-NaN payload; every rank sees the NaN sum, returns all NaN, and the step's error-memory
updates are put back when the next step starts. Payloads are divided by world_size and saturated
at the wire dtype's range before they are summed, so finite input gives finite output.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import nonfinite
from gradzip.comm.queue import completed
from gradzip.comm.settling import SettlingReducer
from gradzip.comm.traffic import allreduce_bytes
from gradzip.compressors.kernels import wire
from gradzip.compressors.lowrank import matrix_view_shape
from gradzip.compressors.separate import moving_average_error
from gradzip.keys import tensor_key


def split_bucket(grad: Tensor, shapes: Sequence[torch.Size] | None) -> list[tuple[int, torch.Size]]:
    """``(offset, shape)`` of each gradient laid end to end in ``grad`` (None: ``grad`` is one).

    Raises:
        ValueError: if ``shapes`` do not add up to ``grad.numel()``.
    """
    shapes = [torch.Size(s) for s in shapes] if shapes is not None else [grad.shape]
    out, total = [], 0
    for shape in shapes:
        out.append((total, shape))
        total += shape.numel()
    if total != grad.numel():
        raise ValueError(f"shapes cover {total} elements but the bucket holds {grad.numel()}")
    return out


class SeparateReducer(SettlingReducer):
    """Averages buckets over ``group`` with SEPARATE and moving-average error feedback.

    Args:
        compressor: the :class:`~gradzip.compressors.separate.Separate` parameters.
        group: the process group (None: the default group).
        queue: the ordered launch queue shared by every reducer of ``group``.
        metrics: where bytes and times go (no quality figures are recorded).
        ledger: the steps whose gradient was not finite, shared by every reducer of one hook;
            None for a ledger of this reducer's own.
    """

    def reduce(
        self,
        key: Hashable,
        grad: Tensor,
        *,
        step: int,
        shapes: Sequence[torch.Size] | None = None,
        flush: bool = True,
    ) -> Future:
        """Start averaging a bucket; returns at once.

        Args:
            key: the bucket's name across steps (its index); keys the error memories and the
                projections.
            grad: flat (or any shape, read flat) floating tensor holding the gradients; must stay
                unchanged until the future completes.
            step: the training step (seeds the projections).
            shapes: shapes of the gradients laid end to end in ``grad``; None treats ``grad`` as
                one tensor of its own shape.
            flush: accepted for the :class:`~gradzip.comm.Reducer` interface; nothing is held.

        Returns:
            a future whose value is the decoded mean, ``grad``'s shape and dtype; all NaN on every
            rank if the bucket held inf or NaN on any rank.

        Raises:
            ValueError: if ``shapes`` do not add up to ``grad.numel()``.
        """
        self._begin(key, step)
        world_size = dist.get_world_size(self.group)
        if grad.numel() == 0:
            return completed(grad.clone())
        codec = self.compressor
        layout = split_bucket(grad, shapes)
        flat = grad.reshape(-1)
        dense = step < codec.start_step
        compressed = [] if dense else [i for i, (_, s) in enumerate(layout) if codec.compresses(s)]
        plain = [i for i in range(len(layout)) if i not in set(compressed)]
        widths = [matrix_view_shape(layout[i][1])[0] * codec.effective_rank(matrix_view_shape(layout[i][1])[1]) for i in compressed]
        n_plain = sum(layout[i][1].numel() for i in plain)
        wire_dtype = grad.dtype
        payload = torch.empty(n_plain + sum(widths), dtype=wire_dtype, device=grad.device)
        raw = grad.numel() * grad.element_size()
        self.metrics.add_bucket(
            key, payload_bytes=wire.nbytes([payload]), dense_bytes=raw,
            collective="dense" if dense else "allreduce", compressed=bool(compressed),
            sent_bytes=allreduce_bytes(wire.nbytes([payload]), world_size),
            received_bytes=allreduce_bytes(wire.nbytes([payload]), world_size), codec=codec.spec,
        )
        box: dict[str, Any] = {}

        def launch() -> Future:
            with self.metrics.timed("compress_s", key):
                sendable = nonfinite.is_finite(grad)
                offset = 0
                for i in plain:
                    o, s = layout[i]
                    torch.div(flat[o : o + s.numel()], world_size, out=payload[offset : offset + s.numel()])
                    offset += s.numel()
                box["matrices"], box["local"] = [], []
                for i in compressed:
                    o, s = layout[i]
                    m, n = matrix_view_shape(s)
                    piece = flat[o : o + s.numel()].view(m, n)
                    name = tensor_key(key, i)
                    mat, _ = nonfinite.checked_input(piece, self.feedback.compensate(name, piece, step=step))
                    box["matrices"].append(mat)
                    if sendable:
                        proj = codec.encode(mat, step=step, key=name)
                        box["local"].append(proj)
                        payload[offset : offset + proj.numel()] = nonfinite.saturate(proj.div(world_size), wire_dtype).reshape(-1)
                    offset += m * codec.effective_rank(n)
                if not sendable:
                    payload.fill_(float("nan"))  # the marker: every rank's sum turns NaN
            work = dist.all_reduce(payload, group=self.group, async_op=True)
            return self.metrics.track(work.get_future(), (key,))

        def finish(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            if nonfinite.received_marker([payload]):
                return self.ledger.marked_result(step, grad)
            out = torch.empty_like(flat)
            with self.metrics.timed("decompress_s", key):
                offset = 0
                for i in plain:
                    o, s = layout[i]
                    out[o : o + s.numel()] = payload[offset : offset + s.numel()]
                    offset += s.numel()
                for j, i in enumerate(compressed):
                    o, s = layout[i]
                    m, n = matrix_view_shape(s)
                    r = codec.effective_rank(n)
                    mat = box["matrices"][j]
                    name = tensor_key(key, i)
                    # The summed payload and this rank's own, lifted by one draw of A.
                    both = torch.cat([payload[offset : offset + m * r].view(m, r).float(), box["local"][j]])
                    lifted = codec.decode(both, n, step=step, key=name, out=torch.empty(2 * m, n, device=grad.device))
                    out[o : o + s.numel()] = nonfinite.saturate(lifted[:m], out.dtype).reshape(-1)
                    previous = self.feedback.residuals.get(name)
                    previous = previous if previous is not None and previous.shape == mat.shape else None
                    self.feedback.store(name, moving_average_error(previous, mat, lifted[m:], codec.ef_beta), step=step)
                    offset += m * r
            return out.view(grad.shape)

        return self.queue.submit(launch, device=grad.device).then(finish)
