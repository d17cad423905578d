"""Chunked orthonormal DCT-II of a tensor, as DeMo transforms its momentum.

A 1-D tensor of ``n`` elements is cut into chunks of ``c = chunk_side(n, chunk)`` consecutive
elements; a 2-D tensor (m x n) into blocks of ``chunk_side(m, chunk) x chunk_side(n, chunk)``
with a 2-D DCT per block (DeMo's reference code, bloc97/DeMo ``TransformDCT``). Tensors of more
dimensions are viewed as 2-D (first dimension x the rest); a 0-d tensor as 1-D of one element.
The transform is orthonormal, so decode(encode(x)) == x up to rounding.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor


def chunk_side(size: int, chunk: int) -> int:
    """The largest divisor of ``size`` that is at most ``chunk`` (``size`` itself when smaller):
    the chunk length along a dimension of ``size`` elements."""
    best = 1
    for d in range(1, min(size, chunk) + 1):
        if size % d == 0:
            best = d
    return best


@functools.lru_cache(maxsize=64)
def _dct_matrix(n: int, dtype: torch.dtype, device: str) -> Tensor:
    """The orthonormal DCT-II matrix ``D`` (n x n), ``D[i, k] = c_k cos(pi (2 i + 1) k / (2 n))``,
    ``c_0 = sqrt(1 / n)``, ``c_k = sqrt(2 / n)``: coefficients are ``x @ D``, and ``x = X @ D^T``."""
    i = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    k = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[:, 0] = math.sqrt(1.0 / n)
    return d.to(dtype=dtype, device=device)


def matrix_shape(shape: torch.Size) -> tuple[int, ...]:
    """The 1-D or 2-D shape a tensor of ``shape`` is transformed as."""
    if len(shape) == 0:
        return (1,)
    if len(shape) <= 2:
        return tuple(shape)
    return (shape[0], math.prod(shape[1:]))


def chunk_layout(shape: torch.Size, chunk: int) -> tuple[int, int]:
    """``(chunks, chunk_numel)`` of a tensor of ``shape``."""
    dims = matrix_shape(shape)
    sides = [chunk_side(s, chunk) for s in dims]
    chunk_numel = math.prod(sides)
    return math.prod(dims) // chunk_numel, chunk_numel


def encode(x: Tensor, chunk: int) -> Tensor:
    """DCT coefficients of ``x`` per chunk, shape ``(chunks, chunk_numel)`` (see the module docstring)."""
    dims = matrix_shape(x.shape)
    x = x.reshape(dims)
    if len(dims) == 1:
        side = chunk_side(dims[0], chunk)
        return x.view(-1, side) @ _dct_matrix(side, x.dtype, str(x.device))
    rows, cols = (chunk_side(s, chunk) for s in dims)
    blocks = x.view(dims[0] // rows, rows, dims[1] // cols, cols)
    coeffs = torch.einsum("yhxw,hb,wd->yxbd", blocks, _dct_matrix(rows, x.dtype, str(x.device)),
                          _dct_matrix(cols, x.dtype, str(x.device)))
    return coeffs.reshape(-1, rows * cols)


def decode(coeffs: Tensor, shape: torch.Size, chunk: int) -> Tensor:
    """The tensor of ``shape`` whose :func:`encode` is ``coeffs`` (the inverse transform)."""
    dims = matrix_shape(shape)
    if len(dims) == 1:
        side = chunk_side(dims[0], chunk)
        return (coeffs @ _dct_matrix(side, coeffs.dtype, str(coeffs.device)).T).reshape(shape)
    rows, cols = (chunk_side(s, chunk) for s in dims)
    blocks = coeffs.view(dims[0] // rows, dims[1] // cols, rows, cols)
    x = torch.einsum("yxbd,hb,wd->yhxw", blocks, _dct_matrix(rows, coeffs.dtype, str(coeffs.device)),
                     _dct_matrix(cols, coeffs.dtype, str(coeffs.device)))
    return x.reshape(shape)
