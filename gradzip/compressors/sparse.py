"""Sparsifiers: send a few values and where they go."""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from gradzip import wire
from gradzip.compressors import register
from gradzip.compressors.base import Compressor, Payload, check_ratio, kept_count


def _scatter(values: Tensor, indices: Tensor, like: Tensor) -> Tensor:
    out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
    out.index_put_((indices.long(),), values.to(like.dtype), accumulate=True)
    return out.reshape(like.shape)


@register
class TopK(Compressor):
    """Top-K: keep the ``k`` entries of largest magnitude (``topk:ratio=``).

    Source: Aji & Heafield, "Sparse Communication for Distributed Gradient Descent" (2017,
    arXiv 1704.05021); with error feedback as in Stich et al., "Sparsified SGD with Memory"
    (2018, arXiv 1809.07599). Biased; not aggregatable (ranks keep different indices), so the
    reducer gathers payloads. Used with error feedback.

    Args:
        ratio: kept fraction in (0, 1]; ``k = clamp(round(ratio * numel), 1, numel)``.

    Payload: ``k`` values in the input dtype and ``k`` indices in the narrowest integer dtype
    holding ``numel - 1`` (:func:`gradzip.wire.index_dtype`):
    ``k * (itemsize(dtype) + itemsize(index_dtype(numel)))`` bytes.

    Raises:
        ValueError: if ``ratio`` is not in (0, 1].
    """

    name = "topk"
    error_feedback = True

    def __init__(self, *, ratio: float = 0.01) -> None:
        super().__init__(ratio=ratio)
        self.ratio = check_ratio(ratio)

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """Args: x of any shape. Returns: ``Payload((values (k,), indices (k,)))``."""
        flat = x.reshape(-1)
        k = kept_count(flat.numel(), self.ratio)
        if k == flat.numel():
            indices = torch.arange(k, device=flat.device)
        else:
            indices = torch.topk(flat.abs(), k, sorted=False).indices
        return Payload((flat[indices], indices.to(wire.index_dtype(flat.numel()))))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: a dense tensor shaped as ``like``, zeros where nothing was kept."""
        values, indices = payload.tensors
        return _scatter(values, indices, like)

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        k = kept_count(numel, self.ratio)
        return k * (wire.dtype_nbytes(dtype) + wire.index_nbytes(numel))
