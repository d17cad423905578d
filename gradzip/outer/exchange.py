"""The pseudo-gradient exchange of one fragment through a gradzip reducer.

A fragment's tensors are laid end to end in buckets (one dtype each, at most ``bucket_cap_mb``
MiB, or one tensor per bucket at 0), each handed to the reducer with the shapes of its tensors
and a key that names the same bucket at every outer step, ``("outer", fragment, bucket)``, so
error-feedback residuals and warm starts carry from one outer step to the next. Every bucket of
one exchange shares one reducer step number: a non-finite pseudo-gradient on any rank turns the
whole fragment's result into NaN on every rank (:mod:`gradzip.comm.nonfinite`) and the reducer puts
back what that step changed.

A replica of several ranks holds identical pseudo-gradients on each of them, so it shares the
exchange out instead of repeating it: bucket ``b`` of a fragment is exchanged (over the outer
group) only by the replica's rank ``b % replica_size``, which then broadcasts the mean to the
other ranks of its replica (over the replica group). The bytes between replicas are those of
one rank, spread over the replica's ranks.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import Reducer
from gradzip.comm.nonfinite import is_finite
from gradzip.comm.queue import completed


@dataclass(frozen=True)
class Bucket:
    """Tensors (indices into the parameter list) sent as one flat tensor under ``key``."""

    key: Hashable
    indices: tuple[int, ...]


def make_buckets(
    fragment: int, indices: Sequence[int], params: Sequence[Tensor], cap_bytes: int, *, share: int = 1
) -> list[Bucket]:
    """Split a fragment's tensors into buckets of one dtype and at most ``cap_bytes`` (a tensor
    larger than the cap travels alone; ``cap_bytes`` 0 sends every tensor alone). With
    ``share`` > 1 (ranks per replica) the cap is lowered to ``ceil(fragment bytes / share)``
    so that each rank of the replica gets a bucket where the tensors allow."""
    if share > 1 and cap_bytes > 0:
        total = sum(params[i].numel() * params[i].element_size() for i in indices)
        cap_bytes = min(cap_bytes, -(-total // share))
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in indices:
        by_dtype.setdefault(params[i].dtype, []).append(i)
    groups: list[list[int]] = []
    for members in by_dtype.values():
        current: list[int] = []
        size = 0
        for i in members:
            nbytes = params[i].numel() * params[i].element_size()
            if current and size + nbytes > cap_bytes:
                groups.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        groups.append(current)
    return [Bucket(("outer", fragment, b), tuple(g)) for b, g in enumerate(groups)]


@dataclass
class Exchange:
    """One fragment's exchange in flight (or resolved), and when to apply it.

    ``futures`` yield the mean flat bucket each (None for a bucket another rank of the replica
    exchanges); :meth:`result` waits for them.
    """

    fragment: int
    due: int  # the inner step after which its outer update is applied
    step: int  # the reducer's step number
    futures: list[Future | None] = field(default_factory=list)
    # with DiLoCo's carry: the fragment's parameters at the launch (what the replica does
    # meanwhile is kept when the update lands); None otherwise
    start: list[Tensor] | None = None

    def result(self) -> list[Tensor | None]:
        """The mean of every bucket this rank exchanges (flat; None for the others), waiting
        for the collectives.

        Raises:
            RuntimeError: if a collective failed (a replica gone, a timeout), naming the
                fragment and the reducer step.
        """
        try:
            return [None if f is None else f.wait() for f in self.futures]
        except Exception as exc:
            raise RuntimeError(
                f"outer exchange of fragment {self.fragment} (reducer step {self.step}) failed: {exc}. "
                "A replica may have stopped or the link timed out (the process group's timeout)."
            ) from exc

    def resolve(self) -> None:
        """Wait now and keep the results as completed futures (for a checkpoint)."""
        self.futures = [None if t is None else completed(t) for t in self.result()]


def launch(
    reducer: Reducer,
    buckets: Sequence[Bucket],
    pseudo: Mapping[int, Tensor],
    *,
    fragment: int,
    due: int,
    step: int,
    mine: Sequence[bool],
) -> Exchange:
    """Start averaging a fragment's pseudo-gradients (``pseudo[i]`` for every index in the
    buckets this rank exchanges, ``mine[b]``); returns at once. The flat tensors are this
    module's own, so the caller may go on changing the parameters while the collectives run."""
    futures: list[Future | None] = []
    last = max((b for b in range(len(buckets)) if mine[b]), default=-1)
    for b, bucket in enumerate(buckets):
        if not mine[b]:
            futures.append(None)
            continue
        flat = torch.cat([pseudo[i].reshape(-1) for i in bucket.indices])
        shapes = [pseudo[i].shape for i in bucket.indices]
        futures.append(reducer.reduce(bucket.key, flat, step=step, shapes=shapes, flush=b == last))
    return Exchange(fragment, due, step, futures)


def share_in_replica(
    buckets: Sequence[Bucket], results: Sequence[Tensor | None], like: Sequence[Tensor], group, owner_of
) -> list[Tensor]:
    """Every bucket's mean on every rank of the replica: each broadcast from the rank that
    exchanged it (``owner_of(b)``, a rank of ``group``), in bucket order on every rank."""
    out = []
    for b, (bucket, result) in enumerate(zip(buckets, results)):
        if result is None:
            numel = sum(like[i].numel() for i in bucket.indices)
            result = torch.empty(numel, dtype=like[bucket.indices[0]].dtype, device=like[bucket.indices[0]].device)
        dist.broadcast(result, group=group, group_src=owner_of(b))
        out.append(result)
    return out


def unflatten(buckets: Sequence[Bucket], results: Sequence[Tensor], like: Sequence[Tensor]) -> dict[int, Tensor] | None:
    """Per-tensor means from the bucket results, or None if any bucket is not finite (the NaN
    marker: some rank's pseudo-gradient held inf or NaN)."""
    if not all(is_finite(r) for r in results):
        return None
    out: dict[int, Tensor] = {}
    for bucket, flat in zip(buckets, results):
        offset = 0
        for i in bucket.indices:
            n = like[i].numel()
            out[i] = flat[offset : offset + n].view(like[i].shape)
            offset += n
    return out
