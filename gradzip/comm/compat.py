"""Collective calls under the names this code uses, on every torch it supports (``torch>=2.4``).

``dist.all_gather_single`` and ``dist.reduce_scatter_single`` are the newer names of
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (which newer torch deprecates); torch
before them (2.11, say, the GPU machines' image) has the old names only. Looked up at each call,
so that tests which wrap ``dist``'s functions see every call.
"""

from __future__ import annotations

import torch.distributed as dist


def all_gather_single(output, input, **kwargs):
    """``dist.all_gather_single`` (``all_gather_into_tensor`` where torch lacks it)."""
    call = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return call(output, input, **kwargs)


def reduce_scatter_single(output, input, **kwargs):
    """``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` where torch lacks it)."""
    call = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return call(output, input, **kwargs)
