"""Two-phase compressed all_reduce for any single-round codec.

Source: Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed" (2021, arXiv 2102.02888), section 4 (compressed allreduce with worker- and
server-side error compensation); the same scheme as Bagua's ByteGrad. gather-based exchanges send
``(W - 1) P`` bytes per rank for a payload of ``P`` bytes on ``W`` ranks; this one sends about
``2 (W - 1) P / W``, flat in the world size (exact figures in :mod:`gradzip.comm.traffic`).

For one bucket on rank ``r`` of ``W``:

1. Compensate with the worker-side error feedback: ``c = g + e_worker``.
2. Cut ``c`` into ``W`` chunks (:func:`~gradzip.comm.traffic.chunk_sizes`) and compress each,
   chunk ``j`` under the codec key ``(key, j)``; ``e_worker <- c - decode(chunks)``.
3. Round 1, ``all_to_all``: chunk ``j``'s payload goes to rank ``j``; rank ``r`` receives every
   rank's payload of chunk ``r``.
4. Rank ``r`` decodes those ``W`` payloads in rank order and averages them (``m``), compensates
   with its server-side error feedback (``s = m + e_server``), compresses ``s`` under the key
   ``(key, r, "mean")``; ``e_server <- s - decode(s)``.
5. Round 2, ``all_gather``: every rank receives every chunk's compressed mean (with
   ``all_to_all`` of the same bytes to every rank when chunk payloads differ in size, which
   ``all_gather`` cannot carry).
6. Every rank decodes chunk ``j`` from the same bytes, so all ranks hold bit-identical results.

Both rounds go through the group's :class:`~gradzip.comm.queue.CollectiveQueue`, queued when the
bucket is handed over, so every rank issues them in the same order however callbacks
interleave; each round's compression runs inside its launch, not in the caller. An empty chunk
(a bucket smaller than ``W``) is neither compressed nor sent. As with ``all_gather``, a codec's
payload shapes must depend only on the number of elements and the dtype, and so must its local
decode context (``ctx``), except for codecs that need a shared seed: their context comes from
``(seed, step, key)`` and each chunk's mean is drawn under its own key, so every rank re-derives
it by encoding zeros under that key (one extra encode of the bucket, for those codecs only).

Non-finite gradients (:mod:`gradzip.comm.nonfinite`): a rank whose bucket holds inf or NaN sends
NaN-marked payloads for every chunk in round 1, so every rank finds the marker among the payloads
of its own chunk and sends a NaN-marked mean in round 2, and every rank returns all NaN. Worker-
and server-side residual updates are staged by the caller and dropped for such a step.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import compat, nonfinite
from gradzip.comm.queue import CollectiveQueue
from gradzip.comm.traffic import ChunkPlan, plan_chunks
from gradzip.compressors import Compressor, Payload
from gradzip.compressors.kernels import wire
from gradzip.feedback import ErrorFeedback
from gradzip.metrics import StepMetrics


def chunk_key(key: Hashable, chunk: int) -> tuple:
    """Codec key of chunk ``chunk`` of bucket ``key`` in round 1 (seeds shared-seed codecs)."""
    return (key, chunk)


def mean_key(key: Hashable, chunk: int) -> tuple:
    """Codec key of the re-compressed mean of chunk ``chunk`` in round 2."""
    return (key, chunk, "mean")


def mean_of_payloads(compressor: Compressor, payloads: list[Payload], like: Tensor) -> Tensor:
    """Decode ``payloads`` (one per rank, rank 0 first), sum them in rank order and divide by
    their count; ``like`` gives shape, dtype and device. The order is fixed so that the
    single-process reference (:func:`gradzip.comm.reference.simulate_ranks`) matches bit for bit.

    Decoded payloads are finite, so a sum that is not overflowed near the dtype's maximum: it is
    then redone dividing each term first, and what still rounds past the maximum is saturated.
    On a device that check would be read on the host: there the decoded payloads are summed in
    fp64 (where no sum of fp32, fp16 or bf16 values overflows; fp64 terms are divided first),
    divided and saturated at ``like``'s range, equal to the host's result to rounding."""
    if not nonfinite.on_host(like):
        return _device_mean(compressor, payloads, like)
    total = compressor.decompress(payloads[0], like=like).clone()
    for payload in payloads[1:]:
        total += compressor.decompress(payload, like=like)
    if not nonfinite.is_finite(total):
        total = compressor.decompress(payloads[0], like=like).div(len(payloads))
        for payload in payloads[1:]:
            total += compressor.decompress(payload, like=like).div(len(payloads))
        return nonfinite.saturate_(total)
    return total.div_(len(payloads))


def _device_mean(compressor: Compressor, payloads: list[Payload], like: Tensor) -> Tensor:
    """:func:`mean_of_payloads` with nothing read on the host (see there)."""
    count = len(payloads)
    if like.dtype == torch.float64:
        total = compressor.decompress(payloads[0], like=like).div(count)
        for payload in payloads[1:]:
            total += compressor.decompress(payload, like=like).div(count)
        return nonfinite.saturate_(total)
    total = compressor.decompress(payloads[0], like=like).to(torch.float64)
    for payload in payloads[1:]:
        total += compressor.decompress(payload, like=like)
    return nonfinite.saturate(total.div_(count), like.dtype).to(like.dtype)


class TwoPhaseAllReduce:
    """The two-phase exchange of one process group (see the module docstring).

    Reached through :func:`gradzip.comm.make_reducer` with ``collective="twophase"`` (or
    ``auto``, when it sends the fewest bytes), which wraps it in a
    :class:`~gradzip.comm.reducer.CompressedReducer`.

    Args:
        compressor: a single-round codec; any, aggregatable or not.
        group: the process group (None: the default group).
        queue: the ordered launch queue shared by every reducer of ``group``.
        metrics: where bytes and times go.
        feedback: the worker-side error feedback (one residual per bucket key), or None.
        server_feedback: the server-side error feedback for the chunk this rank reduces (one
            residual per bucket key), or None.
        ledger: told when a bucket carried the NaN marker (the caller then puts back what the
            step changed); None for a ledger of its own.
    """

    def __init__(
        self,
        compressor: Compressor,
        *,
        group: dist.ProcessGroup | None = None,
        queue: CollectiveQueue | None = None,
        metrics: StepMetrics | None = None,
        feedback: ErrorFeedback | None = None,
        server_feedback: ErrorFeedback | None = None,
        ledger: nonfinite.StepLedger | None = None,
    ) -> None:
        assert not compressor.multi_round, "multi-round codecs bring their own reducer"
        self.compressor = compressor
        self.group = group
        self.queue = queue or CollectiveQueue()
        self.metrics = metrics or StepMetrics()
        self.feedback = feedback
        self.server_feedback = server_feedback
        self.ledger = ledger or nonfinite.StepLedger()

    def reduce(self, key: Hashable, grad: Tensor, *, step: int) -> Future:
        """Queue both rounds for ``grad`` and return at once.

        Args:
            key: the bucket's name across steps; keys both residuals and seeds the codec.
            grad: any shape, floating dtype, at least one element; read flat, not modified
                (it must stay unchanged until the future completes, as DDP's buckets do).
            step: the training step.

        Returns:
            a future whose value is the approximate mean over the group, ``grad``'s shape and
            dtype, bit-identical on every rank; all NaN if ``grad`` held inf or NaN on any rank.
            The future carries the collective's error if a collective failed.
        """
        assert grad.numel() > 0, "empty buckets take no collective; the caller returns them"
        world_size = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        plan = plan_chunks(self.compressor, grad.numel(), grad.dtype, world_size)
        flat = grad.reshape(-1)
        sent = plan.sent_bytes(rank)
        self.metrics.add_bucket(
            key, payload_bytes=plan.total_payload_nbytes, dense_bytes=wire.nbytes([grad]),
            collective="twophase", sent_bytes=sent, received_bytes=sent,
        )
        # Filled by the launches: this rank's round-1 payloads (templates for decoding every
        # chunk: payload shapes depend only on numel and dtype) and the receive buffers.
        own: list[Payload | None] = []
        recv_chunks = torch.empty(world_size * plan.payload_nbytes[rank], dtype=torch.uint8, device=grad.device)
        recv_means = torch.empty(plan.total_payload_nbytes, dtype=torch.uint8, device=grad.device)

        # Steps 1-3: compensate, compress every chunk, all_to_all.
        def launch_scatter() -> Future:
            with self.metrics.timed("compress_s", key):
                send = self._compress_chunks(key, flat, plan, step, own)
            work = dist.all_to_all_single(
                recv_chunks, send, output_split_sizes=[plan.payload_nbytes[rank]] * world_size,
                input_split_sizes=list(plan.payload_nbytes), group=self.group, async_op=True,
            )
            return self.metrics.track(work.get_future(), (key,))

        # Steps 4-5: average this rank's chunk, re-compress it, all_gather.
        def launch_gather() -> Future:
            send = self._reduce_own_chunk(key, flat, plan, rank, step, own, recv_chunks)
            if len(set(plan.payload_nbytes)) == 1:
                work = compat.all_gather_single(recv_means, send, group=self.group, async_op=True)
            else:
                work = dist.all_to_all_single(
                    recv_means, send.repeat(world_size), output_split_sizes=list(plan.payload_nbytes),
                    input_split_sizes=[send.numel()] * world_size, group=self.group, async_op=True,
                )
            return self.metrics.track(work.get_future(), (key,))

        # Step 6: decode every chunk's mean.
        shared_seed = self.compressor.needs_shared_seed

        def finish(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            with self.metrics.timed("decompress_s", key):
                out = torch.empty_like(flat)
                offset = 0
                flags = []  # on a device: whether each chunk's mean carried the marker
                for j, (start, size) in enumerate(zip(plan.offsets, plan.sizes)):
                    if size == 0:
                        continue
                    template = self._mean_template(key, j, size, step, out) if shared_seed else own[j]
                    part = recv_means[offset : offset + plan.payload_nbytes[j]]
                    offset += plan.payload_nbytes[j]
                    ctx = template.ctx
                    if self.compressor.needs_shared_seed:
                        # The owner compressed this mean under mean_key; a shared-seed codec's
                        # ctx (Random-K's positions) follows the key, and every rank derives it.
                        ctx = self.compressor.compress(out.new_zeros(size), step=step, key=mean_key(key, j)).ctx
                    payload = Payload(wire.from_bytes(part, template.tensors), ctx)
                    bad = nonfinite.received(payload.tensors)
                    if bad is True:
                        return self.ledger.marked_result(step, grad)
                    if bad is not False:
                        flags.append(bad)
                    out[start : start + size] = self.compressor.decompress(payload, like=out[start : start + size])
                if flags:
                    bad = torch.stack(flags).any()
                    self.ledger.note(step, bad)
                    nonfinite.poison_where(out, bad)
            return out.view(grad.shape)

        scattered = self.queue.submit(launch_scatter, device=grad.device)
        return self.queue.submit(launch_gather, after=scattered, device=grad.device).then(finish)

    def _mean_template(self, key: Hashable, chunk: int, size: int, step: int, like: Tensor) -> Payload:
        """The decode context of chunk ``chunk``'s mean for a codec that draws it from
        ``(seed, step, key)`` (Random-K's positions): encoding zeros under the same key draws it."""
        return self.compressor.compress(like.new_zeros(size), step=step, key=mean_key(key, chunk))

    def _compress_chunks(
        self, key: Hashable, flat: Tensor, plan: ChunkPlan, step: int, own: list[Payload | None]
    ) -> Tensor:
        """Steps 1-2; fills ``own`` with the chunk payloads and returns them as one byte buffer
        (NaN-marked payloads if ``flat`` holds inf or NaN)."""
        compensated = flat if self.feedback is None else self.feedback.compensate(key, flat, step=step)
        compensated, sendable = nonfinite.input_check(flat, compensated)
        if sendable is False:
            compensated = torch.zeros_like(compensated)  # codecs need not accept inf or NaN
        decoded = torch.zeros_like(compensated) if self.feedback is not None and sendable is not False else None
        for j, (start, size) in enumerate(zip(plan.offsets, plan.sizes)):
            if size == 0:
                own.append(None)
                continue
            chunk = compensated[start : start + size]
            payload = self.compressor.compress(chunk, step=step, key=chunk_key(key, j))
            if sendable is False:
                payload = nonfinite.marked(payload)
            assert payload.nbytes == plan.payload_nbytes[j], (
                f"{self.compressor.name}: chunk payload of {payload.nbytes} bytes, formula says {plan.payload_nbytes[j]}"
            )
            own.append(payload)
            if decoded is not None:
                decoded[start : start + size] = self.compressor.decompress(payload, like=chunk)
        if decoded is not None:
            self.feedback.update(key, compensated, decoded, step=step)
        if isinstance(sendable, Tensor):  # on a device: the marker where the bucket is not finite
            return wire.to_bytes(t for p in own if p is not None for t in nonfinite.mark(p.tensors, sendable))
        return wire.to_bytes(t for p in own if p is not None for t in p.tensors)

    def _reduce_own_chunk(
        self, key: Hashable, flat: Tensor, plan: ChunkPlan, rank: int, step: int,
        own: list[Payload | None], recv_chunks: Tensor,
    ) -> Tensor:
        """Step 4; returns the compressed mean of this rank's chunk as bytes (empty if the chunk is)."""
        size = plan.sizes[rank]
        if size == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device)
        template = own[rank]
        like = flat.new_empty(size)
        world_size = len(plan.sizes)
        with self.metrics.timed("decompress_s", key):
            rows = recv_chunks.view(world_size, -1)
            payloads = [Payload(wire.from_bytes(rows[i], template.tensors), template.ctx) for i in range(world_size)]
            bad = nonfinite.received([t for p in payloads for t in p.tensors])
            if bad is True:
                # Some rank's bucket was not finite: pass the marker on to every rank in round 2.
                self.ledger.mark_nonfinite(step)
                blank = self.compressor.compress(like.zero_(), step=step, key=mean_key(key, rank))
                return wire.to_bytes(nonfinite.marked(blank).tensors)
            mean = mean_of_payloads(self.compressor, payloads, like)
        with self.metrics.timed("compress_s", key):
            server = self.server_feedback
            compensated = mean if server is None else server.compensate(key, mean, step=step)
            payload = self.compressor.compress(compensated, step=step, key=mean_key(key, rank))
            if server is not None:
                server.update(key, compensated, self.compressor.decompress(payload, like=compensated), step=step)
            if isinstance(bad, Tensor):  # on a device: pass the marker on where some rank sent it
                self.ledger.note(step, bad)
                return wire.to_bytes(nonfinite.mark(payload.tensors, ~bad))
            return wire.to_bytes(payload.tensors)

    def state_dict(self) -> dict[str, Any]:
        """The server-side residuals (they differ across ranks); the worker-side ones belong to
        the wrapping reducer."""
        return {"server_feedback": None if self.server_feedback is None else self.server_feedback.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; the ledger forgets its non-finite steps (step
        numbers restart from the loaded state)."""
        self.ledger.clear()
        if self.server_feedback is not None and state.get("server_feedback") is not None:
            self.server_feedback.load_state_dict(state["server_feedback"])

