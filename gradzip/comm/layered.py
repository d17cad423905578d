"""A codec per layer inside a DDP bucket, one exchange per bucket.

A DDP bucket is one flat buffer holding several parameters' gradients end to end (``shapes``
gives them in order). Under a per-layer plan each of those views takes its own codec (a spec per
layer: ``none``, ``fp16``, ``topk:ratio=0.001``, ...), and the payloads of the whole bucket
travel together, one set of collectives per bucket whatever the number of layers:

- every floating payload tensor of an aggregatable codec (``none``, ``fp16``, ``bf16``,
  ``randomk``), divided by ``world_size``, goes into one all_reduce per dtype (fp32 and fp16
  at most, in practice);
- every other layer's payload is packed as bytes into one ``all_gather``; every rank decodes all
  ranks' payloads of each layer in rank order and averages them, as the ``allgather`` route does;
- the ``int8`` layers (:mod:`gradzip.compressors.int8sum`) add a round: their group scales, laid
  end to end, go into one ``all_reduce`` MAX launched with the collectives above; once it is
  back, their int8 codes on the agreed scales go into one ``all_reduce`` SUM.

A bucket whose layers all take one elementwise codec (``none``, ``fp16``, ``bf16``) and hold no
residual is encoded and decoded as one layer: the same all_reduce of the same bytes, without a
pass per layer. A bucket whose layers all take one ``int8`` spec is coded as one layer too: its
groups run over the flat bucket (a group may straddle two layers) and its residual is kept flat
under the bucket's key, as the ``int8`` codec's own reducer
(:class:`~gradzip.comm.int8sum.Int8SumReducer`) does, so that for an fp32 gradient the result is
that reducer's to the bit (the residual stays in the gradient's dtype here, in fp32 there); the
residuals are laid out per layer again when the plan changes. Each layer's bytes in the
metrics are then its codes and the scales of the groups that start in it.

Bytes: the aggregatable part ``A_d`` of dtype ``d`` sends ``2 (W-1) A_d // W``; the gathered part
``G`` sends ``(W-1) G``; ``A_d`` and ``G`` are sums of the layers' ``payload_nbytes(numel)``. The
``int8`` layers send ``2 (W-1) S // W`` for their ``S = 4 sum ceil(numel / group)`` bytes of scales
(``4 ceil(N / group)`` for a bucket of ``N`` elements coded whole) and ``2 (W-1) C // W`` for their
``C = sum numel`` bytes of codes.

Low-rank plans (``powersgd:approx_rank=r`` per layer, ``none`` for a dense layer) go to PowerSGD's
two-round reducer with a rank per layer (:class:`~gradzip.comm.powersgd.PowerSGDReducer`): round
1 carries every layer's ``P`` and the dense layers, round 2 every ``Q``. A plan mixes low-rank
layers with ``none`` only.

Codec options that act on the step (``start_step``) do not apply in a plan: the schedule that
sets the plan decides when a layer is compressed.

Error feedback is per layer, keyed ``(bucket, layer)``, for the codecs that keep it (their
``error_feedback``), and stays with the layer when its codec or ratio changes (a change of plan
moves nothing); a layer sent dense, or by a codec without it (``fp16``, ``bf16``, QSGD), sends
its residual with it and keeps none. When a bucket moves between the single-round and the
low-rank exchange its residuals move along. Non-finite gradients follow :mod:`gradzip.comm.nonfinite`: a rank with inf or NaN in
the bucket poisons every floating payload tensor (and sends +inf scales for its ``int8`` layers, so
that no rank sends their codes), and every rank returns all NaN.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import nonfinite
from gradzip.comm.int8sum import mean_of_codes
from gradzip.comm.int8sum import sent_nbytes as int8_sent_nbytes
from gradzip.comm.powersgd import PowerSGDReducer, orthogonalize, product
from gradzip.comm.queue import CollectiveQueue, completed
from gradzip.comm.settling import SettlingReducer
from gradzip.comm.traffic import allgather_bytes, allreduce_bytes
from gradzip.comm.twophase import mean_of_payloads
from gradzip.compressors import Compressor, Payload, build, seeded_generator
from gradzip.compressors.int8sum import group_rounded, group_scales, group_values, levels_for
from gradzip.compressors.kernels import wire
from gradzip.compressors.lowrank import matrix_view_shape
from gradzip.keys import is_bucket_key, tensor_key
from gradzip.metrics import QualityAccumulator, StepMetrics

DENSE = "none"
#: the codec whose layers take the two-round summed exchange (scales agreed by MAX, then codes)
INT8 = "int8"
#: the codec whose plans go to PowerSGD's reducer
LOW_RANK = "powersgd"
#: codecs that act element by element: a run of layers under one of them is one layer
ELEMENTWISE = (DENSE, "fp16", "bf16")


def _summed_part(payload: Payload, reduced: dict[torch.dtype, Tensor], cursor: dict[torch.dtype, int]) -> Payload:
    """``payload``'s tensors as summed: the next pieces of the all_reduced buffer of each dtype
    (``cursor`` says where each dtype's next piece starts, and moves past it)."""
    tensors = []
    for t in payload.tensors:
        start = cursor[t.dtype]
        tensors.append(reduced[t.dtype][start : start + t.numel()].view(t.shape))
        cursor[t.dtype] = start + t.numel()
    return Payload(tuple(tensors), payload.ctx)


def offsets_of(shapes: Sequence[torch.Size]) -> list[int]:
    """Where each of ``shapes`` starts in the flat bucket."""
    out, total = [], 0
    for shape in shapes:
        out.append(total)
        total += torch.Size(shape).numel()
    return out


def summed(codec: Compressor) -> bool:
    """Whether a layer of ``codec`` joins the bucket's all_reduce: aggregatable, and every
    payload tensor floating (an integer part would be summed over ranks too)."""
    if not codec.aggregatable or codec.multi_round:
        return False
    probe = codec.compress(torch.zeros(8), step=0, key="layered-probe")
    return all(t.is_floating_point() for t in probe.tensors)


class LayeredReducer(SettlingReducer):
    """Averages buckets with a codec per layer (see the module docstring).

    Call :meth:`set_plan` for a bucket before :meth:`reduce`; a bucket without a plan travels
    dense.

    Args:
        group: the process group (None: the default group).
        queue: the ordered launch queue shared by every reducer of ``group``.
        metrics: where bytes (per layer too) and times go.
        ledger: the steps whose gradient was not finite, shared by every reducer of one hook.
    """

    feedback_dtype = None  # each layer's residual in its gradient's dtype

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None = None,
        queue: CollectiveQueue | None = None,
        metrics: StepMetrics | None = None,
        ledger: nonfinite.StepLedger | None = None,
    ) -> None:
        super().__init__(None, group=group, queue=queue, metrics=metrics, ledger=ledger)
        self.plans: dict[Hashable, tuple[str, ...]] = {}
        self.low_rank_keys: set[Hashable] = set()
        self._family: dict[Hashable, bool] = {}  # key -> whether its last exchange was low-rank
        self._codecs: dict[str, tuple[Compressor, bool]] = {}
        self._lock = threading.Lock()
        self.powersgd: PowerSGDReducer | None = None

    # -- plans -------------------------------------------------------------------------------

    def codec(self, spec: str) -> Compressor:
        """The built codec of ``spec`` (cached; with the NaN-marker slot where its payload has
        no floating tensor)."""
        return self._entry(spec)[0]

    def _entry(self, spec: str) -> tuple[Compressor, bool]:
        with self._lock:
            entry = self._codecs.get(spec)
        if entry is None:
            codec = build(spec)
            if codec.multi_round and codec.name not in (LOW_RANK, INT8):
                raise ValueError(f"a per-layer plan takes powersgd, int8 and single-round codecs, not {codec.name}")
            if not codec.multi_round:
                codec = nonfinite.with_marker_slot(codec)
            entry = (codec, summed(codec))
            with self._lock:
                self._codecs[spec] = entry
        return entry

    def set_plan(self, key: Hashable, plan: Sequence[str]) -> None:
        """Use ``plan`` (one codec spec per layer of bucket ``key``, in bucket order) from the
        next :meth:`reduce` of ``key`` on.

        Raises:
            ValueError: for an unknown spec, a multi-round codec other than powersgd and int8, or
                a plan that mixes powersgd with codecs other than ``none``.
        """
        plan = tuple(plan)
        codecs = [self.codec(spec) for spec in plan]
        low_rank = any(c.name == LOW_RANK for c in codecs)
        if low_rank and any(c.name not in (LOW_RANK, DENSE) for c in codecs):
            raise ValueError(f"a per-layer plan mixes powersgd only with none; got {', '.join(sorted(set(plan)))}")
        if low_rank and len({c.replace(approx_rank=1).spec for c in codecs if c.name == LOW_RANK}) > 1:
            raise ValueError("the powersgd layers of a plan must differ in approx_rank only")
        self.plans[key] = plan
        if low_rank:
            first = next(c for c in codecs if c.name == LOW_RANK)
            if self.powersgd is None:
                self.powersgd = PowerSGDReducer(first, group=self.group, queue=self.queue, metrics=self.metrics,
                                                ledger=self.ledger)
            self.powersgd.layer_codecs[key] = [c if c.name == LOW_RANK else None for c in codecs]
            self.low_rank_keys.add(key)
        else:
            self.low_rank_keys.discard(key)

    def _follow(self, key: Hashable, shapes: list[torch.Size], step: int) -> None:
        """Move bucket ``key``'s residuals to the exchange its plan now takes (single-round or
        low-rank), shaped as that exchange keeps them (flat, or PowerSGD's matrix view). Only a
        step that ``key``'s reduce closes is settled first: other buckets of this step may still
        be in flight, and their updates stay undoable until the step is known to be finite."""
        low = key in self.low_rank_keys
        before = self._family.get(key)
        if before is None and self.powersgd is not None:
            # a key not seen before (DDP laid its buckets out anew): its layers' residuals are
            # wherever the exchange of their last bucket kept them
            other = self.feedback if low else self.powersgd.feedback
            held = any(tensor_key(key, i) in other.residuals for i in range(len(shapes)))
            before = (not low) if held else low
        if (low if before is None else before) == low:
            self._family[key] = low
            return
        self._family[key] = low
        for reducer in (self, self.powersgd):
            reducer.settle_closed(key, step)
        source, target = (self.feedback, self.powersgd.feedback) if low else (self.powersgd.feedback, self.feedback)
        for i, shape in enumerate(shapes):
            residual = source.take(tensor_key(key, i))
            if residual is None or residual.numel() != shape.numel():
                continue
            view = matrix_view_shape(shape) if low else None
            residual = residual.reshape(view if view is not None else (-1,))
            target.put(tensor_key(key, i), residual)

    def plan(self, key: Hashable, n_layers: int) -> tuple[str, ...]:
        """The plan of ``key`` (all ``none`` if unset or of another length)."""
        plan = self.plans.get(key)
        return plan if plan is not None and len(plan) == n_layers else (DENSE,) * n_layers

    # -- the exchange -------------------------------------------------------------------------

    def reduce(
        self, key: Hashable, grad: Tensor, *, step: int, shapes: Sequence[torch.Size] | None = None,
        flush: bool = True,
    ) -> Future:
        """Start averaging bucket ``key`` with its plan; returns at once.

        Args:
            key: the bucket's name across steps (its index).
            grad: the flat bucket (any floating dtype); not modified, must stay unchanged until
                the future completes.
            step: the training step (codec seeds).
            shapes: the shapes of the layers laid end to end in ``grad`` (None: one layer).
            flush: accepted for the reducer interface; nothing is held back.

        Returns:
            a future whose value is the mean over ranks, ``grad``'s shape and dtype; all NaN on
            every rank if any rank's bucket held inf or NaN.

        Raises:
            ValueError: if ``shapes`` do not add up to ``grad.numel()``, or the plan has ``int8``
                layers and the group more than 127 ranks.
        """
        shapes = [torch.Size(s) for s in shapes] if shapes is not None else [grad.shape]
        offsets = offsets_of(shapes)
        if sum(s.numel() for s in shapes) != grad.numel():
            raise ValueError(f"shapes cover {sum(s.numel() for s in shapes)} elements but the bucket holds {grad.numel()}")
        low_rank = key in self.low_rank_keys
        # residuals move to PowerSGD's memory laid out per layer, and come back that way
        if low_rank:
            self._lay_out(key, shapes, step, whole=False)
        self._follow(key, shapes, step)
        if not low_rank:
            self._lay_out(key, shapes, step, whole=self._whole_int8(self.plan(key, len(shapes))))
        if low_rank:
            return self.powersgd.reduce(key, grad, step=step, shapes=shapes, flush=flush)
        self._begin(key, step)
        if grad.numel() == 0:
            return completed(grad.clone())
        return self._launch(key, grad, step, shapes, offsets)

    def _launch(self, key: Hashable, grad: Tensor, step: int, shapes: list[torch.Size], offsets: list[int]) -> Future:
        world_size = dist.get_world_size(self.group)
        plan = self.plan(key, len(shapes))
        entries = [self._entry(spec) for spec in plan]
        coded = [i for i, (codec, _) in enumerate(entries) if codec.name == INT8]  # the int8 layers
        levels = levels_for(world_size) if coded else 0
        flat = grad.reshape(-1)
        itemsize = grad.element_size()
        whole_int8 = self._whole_int8(plan)
        if whole_int8:
            layer_bytes = whole_int8_layer_bytes(entries[0][0], shapes)
        else:
            layer_bytes = [codec.payload_nbytes(s.numel(), grad.dtype) for (codec, _), s in zip(entries, shapes)]
        self.metrics.add_layers(key, [
            {"codec": spec, "numel": s.numel(), "payload_bytes": b} for spec, s, b in zip(plan, shapes, layer_bytes)
        ])
        keys = [tensor_key(key, i) for i in range(len(shapes))]  # where each layer's residual lives
        if whole_int8 or self._one_piece(key, plan, entries):
            # Every layer takes the same cast (or none) and carries no residual: the bucket is
            # exchanged as one layer. The payloads lie end to end in the all_reduce either way, so
            # the result is the same to the bit, without a compress, a check and a decompress per
            # layer. All at int8: one layer whose groups and residual run over the flat bucket.
            shapes, offsets, entries, keys = [torch.Size([grad.numel()])], [0], entries[:1], [key]
            coded = [0] if whole_int8 else []
        box: dict[str, Any] = {}
        monitored = self.metrics.wants_quality(step)
        n_scales = [entries[i][0].n_scales(shapes[i].numel()) for i in coded]
        scales = torch.zeros(sum(n_scales), dtype=torch.float32, device=grad.device)
        codes = torch.zeros(sum(shapes[i].numel() for i in coded), dtype=torch.int8, device=grad.device)

        def encode() -> None:
            sendable = True
            payloads, sent_x, decoded = [], [], []
            for (codec, _), shape, o, lkey in zip(entries, shapes, offsets, keys):
                piece = flat[o : o + shape.numel()]
                dense = codec.name == DENSE
                keeps = not dense and codec.error_feedback
                if keeps:
                    x = self.feedback.compensate(lkey, piece, step=step)
                else:  # no residual of its own (dense, fp16, bf16, QSGD): one an earlier codec left travels with it
                    x = self.feedback.compensate(lkey, piece, step=step) if lkey in self.feedback.residuals else piece
                    self.feedback.drop(lkey, step=step)
                x, ok = nonfinite.checked_input(piece, x)
                sendable = sendable and ok
                if codec.name == INT8:  # coded in the second round, on the agreed scales
                    if ok and x.dtype == torch.float64:  # finite beyond fp32 must not read as inf scales
                        x = nonfinite.saturate(x, torch.float32)
                    payloads.append(None)
                    sent_x.append(x)
                    decoded.append(None)
                    continue
                payload = codec.compress(x if ok or dense else torch.zeros_like(x), step=step, key=lkey)
                # decoded for the residual, and for the quality figures where asked
                d = codec.decompress(payload, like=x) if keeps or (monitored and not dense) else None
                if keeps:
                    self.feedback.update(lkey, x, d, step=step)
                assert dense or payload.nbytes == codec.payload_nbytes(shape.numel(), grad.dtype), (
                    f"{codec.name}: payload of {payload.nbytes} bytes, formula says "
                    f"{codec.payload_nbytes(shape.numel(), grad.dtype)}")
                payloads.append(payload)
                sent_x.append(x)
                decoded.append(d)
            if not sendable:
                payloads = [None if p is None else nonfinite.marked(p) for p in payloads]
                scales.fill_(float("inf"))  # the int8 marker: every rank's MAX turns +inf
            elif coded:
                parts = [group_scales(sent_x[i], entries[i][0].group) for i in coded]
                scales.copy_(parts[0] if len(parts) == 1 else torch.cat(parts))
            box["payloads"], box["sent"], box["decoded"], box["keys"] = payloads, sent_x, decoded, keys

        def launch() -> Future:
            with self.metrics.timed("compress_s", key):
                encode()
                reduce_parts: dict[torch.dtype, list[Tensor]] = {}
                gather_parts: list[Tensor] = []
                for (codec, summed_), payload in zip(entries, box["payloads"]):
                    if codec.name == INT8:
                        continue
                    if summed_:
                        for t in payload.tensors:
                            reduce_parts.setdefault(t.dtype, []).append(t.reshape(-1).div(world_size))
                    else:
                        gather_parts.extend(payload.tensors)
                # each part is a new tensor (the division): one part needs no copy
                box["reduced"] = {d: parts[0] if len(parts) == 1 else torch.cat(parts) for d, parts in reduce_parts.items()}
                box["gather_like"] = gather_parts
                send = wire.to_bytes(gather_parts).to(grad.device)
                box["recv"] = torch.empty(world_size * send.numel(), dtype=torch.uint8, device=grad.device)
            # The bytes handed to the collectives, per the module docstring's formula.
            sent = sum(allreduce_bytes(wire.nbytes([t]), world_size) for t in box["reduced"].values())
            sent += allgather_bytes(send.numel(), world_size)
            if coded:
                sent += int8_sent_nbytes(scales.numel(), codes.numel(), world_size)
            self.metrics.add_bucket(
                key, payload_bytes=sum(layer_bytes), dense_bytes=grad.numel() * itemsize, collective="layered",
                compressed=any(codec.name != DENSE for codec, _ in entries), sent_bytes=sent, received_bytes=sent,
                codec="layered",
            )
            if monitored and not coded:
                self._record_quality(key, grad, box)
            works = [dist.all_reduce(t, group=self.group, async_op=True).get_future() for t in box["reduced"].values()]
            if send.numel():
                works.append(dist.all_gather_single(box["recv"], send, group=self.group, async_op=True).get_future())
            if coded:
                works.append(dist.all_reduce(scales, op=dist.ReduceOp.MAX, group=self.group, async_op=True).get_future())
            works = [self.metrics.track(w, (key,)) for w in works]
            return works[0] if len(works) == 1 else torch.futures.collect_all(works)

        def launch_codes() -> Future:
            if not nonfinite.is_finite(scales):  # the same MAX on every rank: all skip together
                box["skip"] = True
                return completed(None)
            with self.metrics.timed("compress_s", key):
                start, parts = 0, []
                for i, n in zip(coded, n_scales):
                    codec, x = entries[i][0], box["sent"][i]
                    agreed = scales[start : start + n]
                    steps = group_rounded(x, agreed, levels, codec.group)  # whole numbers, fp32
                    parts.append(steps)
                    if codec.error_feedback or monitored:
                        d = group_values(steps, agreed, levels, codec.group).to(x.dtype)
                        box["decoded"][i] = d
                        if codec.error_feedback:  # what this rank's codes carry, so the rounding is fed back
                            self.feedback.update(keys[i], x, d, step=step)
                    start += n
                codes.copy_(parts[0] if len(parts) == 1 else torch.cat(parts))
            if monitored:
                self._record_quality(key, grad, box)
            work = dist.all_reduce(codes, group=self.group, async_op=True)
            return self.metrics.track(work.get_future(), (key,))

        def decode(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            if box.get("skip"):
                return self.ledger.marked_result(step, grad)
            with self.metrics.timed("decompress_s", key):
                return self._decode(box, entries, shapes, offsets, grad, step, world_size, (scales, codes, levels))

        first = self.queue.submit(launch, device=grad.device)
        last = self.queue.submit(launch_codes, after=first, device=grad.device) if coded else first
        return last.then(decode)

    def _decode(self, box, entries, shapes, offsets, grad: Tensor, step: int, world_size: int, int8_parts) -> Tensor:
        reduced = box["reduced"]
        rows = box["recv"].view(world_size, -1)
        gathered = [wire.from_bytes(rows[r], box["gather_like"]) for r in range(world_size)]
        if nonfinite.received_marker(reduced.values()) or any(nonfinite.received_marker(g) for g in gathered):
            return self.ledger.marked_result(step, grad)
        scales, codes, levels = int8_parts
        cursor = {d: 0 for d in reduced}
        if len(entries) == 1 and entries[0][0].name == INT8:
            # a bucket coded whole at int8: its decode is the result, not copied
            return mean_of_codes(codes, scales, levels, world_size, entries[0][0].group, grad.dtype).view(grad.shape)
        if len(entries) == 1 and entries[0][1]:
            # one summed layer (a bucket sent in one piece): its decode is the result, not copied
            (codec, _), payload = entries[0], box["payloads"][0]
            return codec.decompress(_summed_part(payload, reduced, cursor), like=grad).view(grad.shape)
        out = torch.empty_like(grad.reshape(-1))
        g_index = scale_at = code_at = 0
        for (codec, summed_), payload, shape, o in zip(entries, box["payloads"], shapes, offsets):
            like = grad.reshape(-1)[o : o + shape.numel()]
            if codec.name == INT8:
                n = codec.n_scales(shape.numel())
                out[o : o + shape.numel()] = mean_of_codes(
                    codes[code_at : code_at + shape.numel()], scales[scale_at : scale_at + n], levels, world_size,
                    codec.group, grad.dtype)
                scale_at, code_at = scale_at + n, code_at + shape.numel()
            elif summed_:
                out[o : o + shape.numel()] = codec.decompress(_summed_part(payload, reduced, cursor), like=like)
            else:
                n = len(payload.tensors)
                ranks = [Payload(tuple(g[g_index : g_index + n]), payload.ctx) for g in gathered]
                g_index += n
                out[o : o + shape.numel()] = mean_of_payloads(codec, ranks, like)
        return out.view(grad.shape)

    def _whole_int8(self, plan: Sequence[str]) -> bool:
        """Whether a bucket under ``plan`` is coded whole at ``int8``: several layers, one
        ``int8`` spec for all."""
        return len(plan) > 1 and len(set(plan)) == 1 and self.codec(plan[0]).name == INT8

    def _lay_out(self, key: Hashable, shapes: list[torch.Size], step: int, *, whole: bool) -> None:
        """Move bucket ``key``'s residuals to the layout its exchange keeps this step: flat under
        ``key`` for a bucket coded whole (``whole``), else one per layer. A layer that held none
        owes zeros. A bucket key also takes what older layouts' entries hold of its parameters
        (DDP lays its buckets out anew; :mod:`gradzip.keys`). As :meth:`_follow`, only a step
        that ``key``'s reduce closes is settled first."""
        feedback = self.feedback
        keys = [tensor_key(key, i) for i in range(len(shapes))]
        if whole:
            if key in feedback.residuals:
                return
            # a plain key's layers, or any entry holding a bucket key's parameters
            needed = any(k in feedback.residuals for k in keys) or bool(feedback.holders(key))
        else:
            own = set(keys)
            needed = key in feedback.residuals or any(k not in own for k in feedback.holders(key))
        if not needed:
            return
        self.settle_closed(key, step)
        if key not in feedback.residuals:
            if is_bucket_key(key):
                feedback.gather(key)
            else:
                pieces = [feedback.take(k) for k in keys]
                like = next(p for p in pieces if p is not None)
                feedback.put(key, torch.cat([
                    p.reshape(-1) if p is not None and p.numel() == s.numel()
                    else torch.zeros(s.numel(), dtype=like.dtype, device=like.device)
                    for p, s in zip(pieces, shapes)
                ]))
        if whole:
            return
        flat = feedback.take(key).reshape(-1)
        if flat.numel() != sum(s.numel() for s in shapes):
            return  # a plain key whose layers changed: it restarts at zero, as ErrorFeedback's keys do
        for k, s, o in zip(keys, shapes, offsets_of(shapes)):
            feedback.put(k, flat[o : o + s.numel()])

    def _one_piece(self, key: Hashable, plan: Sequence[str], entries: list[tuple[Compressor, bool]]) -> bool:
        """Whether bucket ``key`` can go as one layer: several layers, one plan entry that acts
        element by element without error feedback, no layer holding a residual."""
        codec = entries[0][0]
        return (len(plan) > 1 and len(set(plan)) == 1 and codec.name in ELEMENTWISE and not codec.error_feedback
                and not any(tensor_key(key, i) in self.feedback.residuals for i in range(len(plan))))

    def _record_quality(self, key: Hashable, grad: Tensor, box: dict[str, Any]) -> None:
        acc = QualityAccumulator()
        for x, d, lkey in zip(box["sent"], box["decoded"], box["keys"]):
            if d is None:
                acc.add_exact(x)
            else:
                acc.add(x, d, difference=self.feedback.residuals.get(lkey))
                acc.add_residual(self.feedback.residuals.get(lkey))
        acc.add_gradient(grad)
        self.metrics.add_quality(key, acc.figures())

    def probe_errors(
        self, key: Hashable, grad: Tensor, shapes: Sequence[torch.Size], specs: Sequence[Sequence[str]], *, step: int
    ) -> list[tuple[float, list[float]]]:
        """Price codecs on each layer of a bucket locally: no collective, no state change.

        Args:
            key, grad, shapes, step: as :meth:`reduce`.
            specs: per layer, the codec specs to price.

        Returns:
            per layer, ``(||x||^2, [||x - D(C(x))||^2 per spec])`` in float64 arithmetic, with ``x``
            the layer plus the residual it carries (what its codec would be handed). PowerSGD is
            priced by one power iteration from a ``Q`` drawn from ``(seed, step, layer)``, ``int8``
            at the group's levels on this rank's own scales (:func:`int8_error`); a rank
            at which the layer would travel dense has error 0.
        """
        shapes = [torch.Size(s) for s in shapes]
        world_size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        feedback = self.powersgd.feedback if key in self.low_rank_keys and self.powersgd is not None else self.feedback
        flat = grad.reshape(-1)
        out = []
        owed = _layer_residuals(feedback.residuals, key, shapes)
        for i, (shape, o, residual) in enumerate(zip(shapes, offsets_of(shapes), owed)):
            x = flat[o : o + shape.numel()].float()
            if residual is not None:
                x = x + residual.float()
            errors = []
            for spec in specs[i]:
                codec = self.codec(spec)
                if codec.name == INT8:
                    errors.append(int8_error(codec, x, world_size))
                    continue
                if codec.multi_round:
                    errors.append(low_rank_error(codec, x, shape, step=step, key=tensor_key(key, i)))
                    continue
                decoded = codec.decompress(codec.compress(x, step=step, key=tensor_key(key, i)), like=x)
                errors.append(float(torch.linalg.vector_norm((x - decoded).double())) ** 2)
            out.append((float(torch.linalg.vector_norm(x.double())) ** 2, errors))
        return out

    # -- steps and state ---------------------------------------------------------------------

    def settle(self) -> None:
        """End the current step now (see :meth:`gradzip.comm.settling.SettlingReducer.settle`),
        the low-rank layers' reducer too."""
        super().settle()
        if self.powersgd is not None:
            self.powersgd.settle()

    def residual(self, key: Hashable, shapes: Sequence[torch.Size]) -> Tensor | None:
        """The error this rank still owes bucket ``key``, laid out flat (None if nothing)."""
        feedback = self.powersgd.feedback if key in self.low_rank_keys else self.feedback
        shapes = [torch.Size(s) for s in shapes]
        out, found = torch.zeros(sum(s.numel() for s in shapes)), False
        for shape, o, r in zip(shapes, offsets_of(shapes), _layer_residuals(feedback.residuals, key, shapes)):
            if r is not None:
                out[o : o + shape.numel()] = r.float()
                found = True
        return out if found else None

    def state_dict(self) -> dict[str, Any]:
        """Plans and per-layer residuals (they differ across ranks), after settling the step."""
        self.settle()
        return {
            "plans": {k: list(v) for k, v in self.plans.items()},
            "feedback": self.feedback.state_dict(),
            "powersgd": None if self.powersgd is None else self.powersgd.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        super().load_state_dict(state)
        self.low_rank_keys = set()
        for key, plan in state["plans"].items():
            self.set_plan(key, plan)
        self._family = {key: key in self.low_rank_keys for key in self.plans}
        if state["powersgd"] is not None and self.powersgd is not None:
            self.powersgd.load_state_dict(state["powersgd"])


def _layer_residuals(residuals: dict[Hashable, Tensor], key: Hashable, shapes: list[torch.Size]) -> list[Tensor | None]:
    """Each layer's residual of bucket ``key``, flat (None where it owes nothing): its own, or its
    piece of the bucket's flat residual (a bucket coded whole)."""
    whole = residuals.get(key)
    if whole is not None and whole.numel() == sum(s.numel() for s in shapes):
        flat = whole.reshape(-1)
        return [flat[o : o + s.numel()] for s, o in zip(shapes, offsets_of(shapes))]
    out = []
    for i, shape in enumerate(shapes):
        r = residuals.get(tensor_key(key, i))
        out.append(r.reshape(-1) if r is not None and r.numel() == shape.numel() else None)
    return out


def whole_int8_layer_bytes(codec, shapes: Sequence[torch.Size]) -> list[int]:
    """Each layer's payload bytes in a bucket coded whole at ``int8`` (``codec``): its codes, and
    4 bytes for each group that starts in it; they add up to ``codec.payload_nbytes(N)``."""
    out, start = [], 0
    for shape in shapes:
        end = start + torch.Size(shape).numel()
        starts = -(-end // codec.group) - -(-start // codec.group)  # groups g with start <= g * group < end
        out.append(end - start + 4 * starts)
        start = end
    return out


def low_rank_error(codec, x: Tensor, shape: torch.Size, *, step: int, key: Hashable) -> float:
    """``||M - P Q^T||^2`` of one power iteration of ``codec`` (PowerSGD) on ``x`` viewed as its
    matrix, from a ``Q`` drawn from ``(codec.seed, step, key)``; 0 where the layer travels dense."""
    if not codec.compresses(shape):
        return 0.0
    n, m = matrix_view_shape(shape)
    mat = x.reshape(n, m).float()
    gen = seeded_generator(codec.seed, step, key)
    q = torch.randn(m, codec.effective_rank(n, m), generator=gen)
    p = orthogonalize(product(mat, q))
    approx = p @ product(mat.T, p).T
    return float(torch.linalg.vector_norm((mat - approx).double())) ** 2


def int8_error(codec, x: Tensor, world_size: int) -> float:
    """``||x - D(C(x))||^2`` of ``int8`` on flat fp32 ``x`` at the levels of ``world_size`` ranks, on
    this rank's own scales (the agreed ones are no smaller, so this is a lower bound)."""
    levels = levels_for(world_size)
    scales = group_scales(x, codec.group)
    decoded = group_values(group_rounded(x, scales, levels, codec.group), scales, levels, codec.group)
    return float(torch.linalg.vector_norm((x - decoded).double())) ** 2
