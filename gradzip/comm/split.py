"""Some parameters of every bucket sent through a reducer of their own.

``CompressionState("separate:embeddings=int8")`` sends the embedding tables by ``int8`` and every
other gradient by SEPARATE. A low-rank codec suits a layer's gradient, whose rank is small; an
embedding table's is row-sparse where the table is only looked up and of high rank where it is
also the output layer (tied weights, as in GPT-2), and a projection of rank 4 loses most of it.
The tables are few and their gradient is a small share of a transformer's (15% of the demo job's),
so a summable elementwise codec (``none``, ``fp16``, ``bf16``, ``int8``) keeps most of the ratio.

For a bucket holding both kinds, :class:`SplitReducer` copies the taken parameters' gradients into
one flat tensor and the others into a second, keyed by their own parameters
(:func:`gradzip.keys.bucket_key`), hands them to the side reducer and then to the main one (every
rank in that order, through the group's one queue), and lays both results back into the bucket's
order. A bucket of one kind goes to its reducer whole, with no copy. Both reducers share one
non-finite ledger: a rank with inf or NaN in either part makes that part all NaN on every rank,
and the whole bucket is returned all NaN; the step is put back in both.

Bytes: the main codec's payload formula on the other parameters plus the side codec's on the
taken ones (``numel * itemsize`` for ``none``, ``fp16``, ``bf16``; ``numel + 4 ceil(numel / 256)``
for ``int8``, or the raw bytes where those are no more), each in its own collectives.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import torch
from torch import Tensor
from torch.futures import Future

from gradzip.keys import bucket_key, is_bucket_key


class SplitReducer:
    """The parameters :meth:`take` names go to ``side``; everything else to ``main``.

    Args:
        main: the reducer of the codec the user named.
        side: the reducer of the taken parameters; ``main`` and ``side`` share the group's queue,
            metrics and non-finite ledger.
        option: the option that asked for the split, for error messages (``embeddings=int8``).
    """

    def __init__(self, main, side, *, option: str) -> None:
        self.main = main
        self.side = side
        self.option = option
        self.taken: frozenset[int] | None = None

    def take(self, params: Iterable[int]) -> None:
        """Send the parameters numbered ``params`` (:class:`gradzip.ddp.ParameterNumbers`) by the
        side reducer from now on."""
        self.taken = frozenset(int(p) for p in params)

    def reduce(
        self, key: Hashable, grad: Tensor, *, step: int, shapes: Sequence[torch.Size] | None = None, flush: bool = True
    ) -> Future:
        """Start averaging a bucket (see :class:`gradzip.comm.Reducer`); ``key`` must be a bucket key.

        Raises:
            ValueError: before :meth:`take` was called (the state was not bound to its model).
        """
        if self.taken is None or not is_bucket_key(key):
            raise ValueError(f"{self.option} needs the state bound to its model: CompressionState(...).bind(model)")
        params, numels = key[1], key[2]
        side = [i for i, p in enumerate(params) if p in self.taken]
        if not side:
            return self.main.reduce(key, grad, step=step, shapes=shapes, flush=flush)
        main = [i for i in range(len(params)) if params[i] not in self.taken]
        if not main:
            fut = self.side.reduce(key, grad, step=step, shapes=shapes)
            if flush:
                self.main.flush()  # what the main reducer holds back goes with the last bucket
            return fut
        shapes = [torch.Size(s) for s in shapes] if shapes is not None else [torch.Size([n]) for n in numels]
        flat = grad.reshape(-1)
        starts = [0]
        for n in numels:
            starts.append(starts[-1] + n)
        futures = []
        for part, reducer, release in ((side, self.side, True), (main, self.main, flush)):
            piece = torch.cat([flat[starts[i] : starts[i + 1]] for i in part])
            piece_key = bucket_key([params[i] for i in part], [numels[i] for i in part])
            futures.append(reducer.reduce(piece_key, piece, step=step, shapes=[shapes[i] for i in part], flush=release))

        def stitch(fut: Future) -> Tensor:
            out = torch.empty_like(flat)
            bad = torch.zeros((), dtype=torch.bool, device=flat.device)
            for part, done in zip((side, main), fut.value()):
                value = done.value().reshape(-1)
                # a reducer's result is finite or all NaN (the marker): its first element says which
                bad |= torch.isnan(value[:1]).any()
                at = 0
                for i in part:
                    out[starts[i] : starts[i + 1]].copy_(value[at : at + numels[i]])
                    at += numels[i]
            return out.masked_fill_(bad, float("nan")).view_as(grad)

        return torch.futures.collect_all(futures).then(stitch)

    def flush(self) -> None:
        self.main.flush()
        self.side.flush()

    def settle(self) -> None:
        self.main.settle()
        self.side.settle()

    def state_dict(self) -> dict:
        return {"main": self.main.state_dict(), "side": self.side.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.main.load_state_dict(state["main"])
        self.side.load_state_dict(state["side"])
