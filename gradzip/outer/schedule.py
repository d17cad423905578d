"""When each fragment of the parameters is exchanged and when its outer update lands.

Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication: Towards
a Distributed Free Lunch", arXiv 2501.18512) splits the parameters into ``F`` fragments and
synchronises them on a staggered schedule: every fragment once per ``H`` inner steps, the
fragments spread evenly through the cycle, so that the bytes on the link are spread too.
Fragments are strided over the parameter tensors (fragment ``p`` holds tensors ``p, p + F,
p + 2F, ...``), as the paper strides them over layers, which it found slightly better than
consecutive blocks. An exchange launched after inner step ``t`` lands (its outer update is
applied) after inner step ``t + delay``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradzip.compressors import check_int


def strided_fragments(n_tensors: int, fragments: int) -> list[list[int]]:
    """Tensor indices of each fragment: fragment ``p`` holds ``p, p + F, p + 2F, ...``."""
    return [list(range(p, n_tensors, fragments)) for p in range(fragments)]


@dataclass(frozen=True)
class Schedule:
    """The staggered schedule of ``fragments`` exchanges per ``sync_every`` inner steps.

    Args:
        sync_every: ``H``, inner steps between two exchanges of one fragment (>= 1).
        fragments: ``F``, in ``[1, min(n_tensors, sync_every)]``: at most one fragment starts
            its exchange per inner step, and every fragment holds a tensor.
        delay: inner steps between launching a fragment's exchange and applying its outer
            update, in ``[0, sync_every - 1]``: a fragment's update lands before its next
            exchange starts, so each fragment's reducer has one step in flight and knows its
            outcome (finite or skipped on every rank) before its next step starts, as the
            reducers' non-finite guard requires. Exchanges of several fragments may be in flight
            at once (``delay >= sync_every // fragments``). 0 is synchronous DiLoCo.
        n_tensors: parameter tensors being trained (>= 1).

    Raises:
        ValueError: naming the setting and its allowed range.
    """

    sync_every: int
    fragments: int
    delay: int
    n_tensors: int

    def __post_init__(self) -> None:
        check_int(self.n_tensors, name="number of parameter tensors", low=1)
        check_int(self.sync_every, name="sync_every", low=1)
        high = min(self.n_tensors, self.sync_every)
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) or not 1 <= self.fragments <= high:
            raise ValueError(
                f"fragments must be an integer in [1, {high}] (at most the {self.n_tensors} parameter tensors "
                f"and at most sync_every={self.sync_every}); got {self.fragments!r}"
            )
        if isinstance(self.delay, bool) or not isinstance(self.delay, int) or not 0 <= self.delay < self.sync_every:
            raise ValueError(
                f"delay must be an integer in [0, {self.sync_every - 1}] (fewer than sync_every = {self.sync_every} "
                f"inner steps: a fragment's update lands before its next exchange starts); got {self.delay!r}"
            )

    def send_offset(self, fragment: int) -> int:
        """Position in the cycle, in ``[1, H]``, of the inner step after which ``fragment``'s
        exchange starts: ``floor(H * (p + 1) / F)`` (the last fragment at ``H``, as DiLoCo)."""
        return self.sync_every * (fragment + 1) // self.fragments

    def sends_after(self, inner_step: int) -> list[int]:
        """Fragments whose exchange starts after inner step ``inner_step`` (counted from 1)."""
        return [p for p in range(self.fragments) if (inner_step - self.send_offset(p)) % self.sync_every == 0]
