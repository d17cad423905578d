"""Keys that name a DDP bucket by the parameters it holds, so that state follows the tensors.

DDP lays gradients into buckets once from the parameter order and again, after the first
backward pass, in the order gradients became ready; a bucket's ``index()`` then names other
tensors, of the same shape or not. The hook names a bucket by its parameters instead:
``("params", (p0, p1, ...), (n0, n1, ...))``, the stable number of each parameter (its place in
the model, see :class:`gradzip.ddp.CompressionState`) and its element count, in the bucket's
order. One gradient of such a bucket is named ``("param", p)`` (:func:`tensor_key`), whatever
bucket holds it.

Keys are plain tuples of str and int: their ``repr`` seeds generators the same way in every
process, and they load from checkpoints with ``torch.load(weights_only=True)``.

A flat residual stored under a bucket key follows its parameters into a new layout through
:func:`regroup`: the residuals of the old buckets are cut into per-parameter pieces and the new
bucket's residual is laid out from them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

BUCKET = "params"
TENSOR = "param"


def bucket_key(params: Sequence[int], numels: Sequence[int]) -> tuple:
    """The key of a bucket holding parameters ``params`` (stable numbers) of ``numels`` elements,
    laid end to end in this order."""
    assert len(params) == len(numels), "one element count per parameter"
    return (BUCKET, tuple(int(p) for p in params), tuple(int(n) for n in numels))


def is_bucket_key(key: Hashable) -> bool:
    """Whether ``key`` was made by :func:`bucket_key`."""
    return isinstance(key, tuple) and len(key) == 3 and key[0] == BUCKET


def tensor_key(key: Hashable, i: int) -> Hashable:
    """The key of gradient ``i`` of the bucket ``key``: ``("param", p)`` for a bucket key (the
    same in every bucket that holds parameter ``p``), else ``(key, i)``."""
    if is_bucket_key(key):
        return (TENSOR, key[1][i])
    return (key, i)


def label(key: Hashable) -> str:
    """A short name for reports: ``params 4-9`` for a bucket of parameters 4 to 9 (in any
    order), ``params 1,5`` otherwise, ``param 3`` for one; ``str(key)`` for other keys. Buckets of
    one layout hold disjoint parameters, so their labels differ."""
    if not is_bucket_key(key) or not key[1]:
        return str(key)
    params = sorted(key[1])
    if len(params) == 1:
        return f"param {params[0]}"
    if params[-1] - params[0] == len(params) - 1:
        return f"params {params[0]}-{params[-1]}"
    return "params " + ",".join(map(str, params))


def _pieces(key: Hashable) -> list[tuple[int, int]] | None:
    """``[(parameter, numel), ...]`` laid out under ``key``; None for a key that names no
    parameters (a plain bucket index, a parameter name)."""
    if is_bucket_key(key):
        return list(zip(key[1], key[2]))
    if isinstance(key, tuple) and len(key) == 2 and key[0] == TENSOR:
        return [(key[1], -1)]  # a whole parameter, any shape
    return None


def holders(store: dict[Hashable, Tensor], key: Hashable) -> list[Hashable]:
    """The keys of ``store`` other than ``key`` that hold some of ``key``'s parameters (none for a
    key that names no parameters)."""
    wanted = _pieces(key)
    if wanted is None:
        return []
    params = {p for p, _ in wanted}
    return [k for k in list(store) if k != key and (pieces := _pieces(k)) and params & {p for p, _ in pieces}]


def regroup(store: dict[Hashable, Tensor], key: Hashable, *, follow: bool = True) -> Tensor | None:
    """Lay out ``store[key]`` from entries of ``store`` that hold its parameters under other keys.

    Called when ``key`` is missing from ``store``. Every other entry sharing a parameter with
    ``key`` is removed; with ``follow``, its values are cut per parameter, the pieces of ``key``'s
    parameters are laid end to end (zeros for a parameter no entry held) into a new flat entry
    ``store[key]``, and the pieces of other parameters stay in ``store`` under their
    :func:`tensor_key` until a bucket claims them. Without ``follow`` (entries that hold part of
    a bucket, not whole parameters) nothing is carried over.

    Args:
        store: key -> tensor, entries laid out as their key says (any shape, read flat).
        key: a bucket key or a tensor key; other keys are left alone.
        follow: carry the values over (True) or drop them (False).

    Returns:
        the new ``store[key]`` (flat, in the dtype and on the device of the pieces), or None if
        no entry held any of ``key``'s parameters (or ``follow`` is False).
    """
    wanted = _pieces(key)
    if wanted is None:
        return None
    overlapping = holders(store, key)
    if not overlapping:
        return None
    if not follow:
        for k in overlapping:
            del store[k]
        return None
    loose: dict[int, Tensor] = {}
    for k in overlapping:
        flat, offset = store.pop(k).reshape(-1), 0
        for p, n in _pieces(k):
            n = flat.numel() if n < 0 else n
            loose[p] = flat[offset : offset + n]
            offset += n
        assert offset == flat.numel(), f"{k!r} lays out {offset} elements, its entry holds {flat.numel()}"
    like = next(iter(loose.values()))
    numels = [loose[p].numel() if n < 0 else n for p, n in wanted]
    out = torch.zeros(sum(numels), dtype=like.dtype, device=like.device)
    offset = 0
    for (p, _), n in zip(wanted, numels):
        piece = loose.pop(p, None)
        if piece is not None:
            assert piece.numel() == n, f"parameter {p} holds {piece.numel()} elements, {key!r} says {n}"
            out[offset : offset + n] = piece.to(out.dtype)
        offset += n
    for p, piece in loose.items():
        store[(TENSOR, p)] = piece.clone()  # a view would keep the old bucket's storage alive
    store[key] = out
    return out
