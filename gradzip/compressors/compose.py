"""Composition: ``topk:ratio=0.01+uniform:bits=8`` encodes the kept values with a second codec.

The first codec must be a sparsifier (its payload leads with ``k`` values, see
:mod:`gradzip.compressors.sparse`); the second encodes those ``k`` values as a 1-D tensor, and
its payload replaces them on the wire. Chains of more than two nest to the right.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from gradzip.compressors.base import Compressor, Payload
from gradzip.compressors.kernels import wire


class Composed(Compressor):
    """A sparsifier whose values are encoded by another codec (``outer+inner``).

    Properties follow the parts: aggregatable if both are (Random-K with fp16 values, say),
    unbiased if both are, a shared seed if either needs one, error feedback if either uses it.

    Args:
        codecs: two or more built codecs; all but the last must send values (``topk``,
            ``randomk``, ``dgc``, ``threshold``), none may be multi-round.

    Payload: the outer codec's payload with its ``k`` values replaced by the inner codec's
    payload for ``k`` elements: ``outer.payload_nbytes(n) - k * itemsize(dtype) +
    inner.payload_nbytes(k)`` bytes, where ``k = outer.values_numel(n)``.

    Raises:
        ValueError: for fewer than two codecs, a first codec that sends no values, or a
            multi-round codec.
    """

    name = "composed"

    def __init__(self, codecs: Sequence[Compressor]) -> None:
        super().__init__()
        codecs = list(codecs)
        if len(codecs) < 2:
            raise ValueError(f"a composition needs at least two codecs; got {len(codecs)}")
        for codec in codecs:
            if codec.multi_round:
                raise ValueError(f"{codec.name} takes several collective rounds and cannot be composed")
        for codec in codecs[:-1]:
            if not getattr(codec, "sends_values", False):
                raise ValueError(
                    f"in a composition every codec but the last must be a sparsifier "
                    f"(topk, randomk, dgc, threshold); {codec.name} is not"
                )
        self.outer = codecs[0]
        self.inner = codecs[1] if len(codecs) == 2 else Composed(codecs[1:])
        parts = (self.outer, self.inner)
        self.aggregatable = all(c.aggregatable for c in parts)
        self.unbiased = all(c.unbiased for c in parts)
        self.needs_shared_seed = any(c.needs_shared_seed for c in parts)
        self.error_feedback = any(c.error_feedback for c in parts)
        # start_step belongs to the exchange, so the composition starts when its last part does.
        self.start_step = max(c.start_step for c in parts)

    @property
    def spec(self) -> str:
        """``outer.spec + "+" + inner.spec``."""
        return f"{self.outer.spec}+{self.inner.spec}"

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """``outer.payload_nbytes(n) - k * itemsize(dtype) + inner.payload_nbytes(k)``."""
        k = self.outer.values_numel(numel)
        return self.outer.payload_nbytes(numel, dtype) - k * wire.dtype_nbytes(dtype) + self.inner.payload_nbytes(k, dtype)

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """Args: x of any shape and floating dtype. Returns: the inner payload, then the outer rest."""
        outer = self.outer.compress(x, step=step, key=key)
        inner = self.inner.compress(outer.tensors[0], step=step, key=(key, "values"))
        return Payload(inner.tensors + outer.tensors[1:], ctx=(outer.ctx, inner.ctx, len(inner.tensors)))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: the outer decode of the inner-decoded values, shaped and typed as ``like``."""
        outer_ctx, inner_ctx, inner_count = payload.ctx
        k = self.outer.values_numel(like.numel())
        values_like = torch.empty(k, dtype=like.dtype, device=like.device)
        values = self.inner.decompress(Payload(payload.tensors[:inner_count], inner_ctx), like=values_like)
        return self.outer.decompress(Payload((values,) + payload.tensors[inner_count:], outer_ctx), like=like)
