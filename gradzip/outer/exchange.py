"""The pseudo-gradient exchange of one fragment through a gradzip reducer.

A fragment's tensors are laid end to end in buckets (one dtype each, at most ``bucket_cap_mb``
MiB, or one tensor per bucket at 0), each handed to the reducer with the shapes of its tensors
and a key that names the same bucket at every outer step, ``("outer", fragment, bucket)``, so
error-feedback residuals and warm starts carry from one outer step to the next. Every bucket of
one exchange shares one reducer step number: a non-finite pseudo-gradient on any rank turns the
whole fragment's result into NaN on every rank (:mod:`gradzip.comm.guard`) and the reducer puts
back what that step changed.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.futures import Future

from gradzip.comm import Reducer
from gradzip.comm.guard import is_finite
from gradzip.comm.queue import completed


@dataclass(frozen=True)
class Bucket:
    """Tensors (indices into the parameter list) sent as one flat tensor under ``key``."""

    key: Hashable
    indices: tuple[int, ...]


def make_buckets(fragment: int, indices: Sequence[int], params: Sequence[Tensor], cap_bytes: int) -> list[Bucket]:
    """Split a fragment's tensors into buckets of one dtype and at most ``cap_bytes`` (a tensor
    larger than the cap travels alone; ``cap_bytes`` 0 sends every tensor alone)."""
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

    ``futures`` yield the mean flat bucket each; :meth:`result` waits for them.
    """

    fragment: int
    due: int  # the inner step after which its outer update is applied
    step: int  # the reducer's step number
    futures: list[Future] = field(default_factory=list)

    def result(self) -> list[Tensor]:
        """The mean of every bucket (flat), waiting for the collectives.

        Raises:
            RuntimeError: if a collective failed (a replica gone, a timeout), naming the
                fragment and the reducer step.
        """
        try:
            return [f.wait() for f in self.futures]
        except Exception as exc:
            raise RuntimeError(
                f"outer exchange of fragment {self.fragment} (reducer step {self.step}) failed: {exc}. "
                "A replica may have stopped or the link timed out (the process group's timeout)."
            ) from exc

    def resolve(self) -> None:
        """Wait now and keep the results as completed futures (for a checkpoint)."""
        self.futures = [completed(t) for t in self.result()]


def launch(
    reducer: Reducer, buckets: Sequence[Bucket], pseudo: Mapping[int, Tensor], *, fragment: int, due: int, step: int
) -> Exchange:
    """Start averaging a fragment's pseudo-gradients (``pseudo[i]`` for every index in the
    buckets); returns at once. The flat tensors are this module's own, so the caller may go on
    changing the parameters while the collectives run."""
    futures = []
    for b, bucket in enumerate(buckets):
        flat = torch.cat([pseudo[i].reshape(-1) for i in bucket.indices])
        shapes = [pseudo[i].shape for i in bucket.indices]
        futures.append(reducer.reduce(bucket.key, flat, step=step, shapes=shapes, flush=b == len(buckets) - 1))
    return Exchange(fragment, due, step, futures)


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
