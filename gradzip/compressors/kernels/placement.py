"""Tensors on the input's device without waiting for it.

A blocking copy from host to device (``cpu_tensor.to("cuda")``, ``torch.tensor(x, device=...)``)
waits for every kernel queued on the stream; inside a DDP hook that stalls backward until the
GPU catches up. Codecs draw some tensors on the host on purpose (a seeded CPU generator gives
the same numbers whatever the device, so a CUDA rank and the CPU reference agree): those go
through pinned memory without blocking (:func:`to_device`), and scalars are filled on the device
(:func:`scalar`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """``t`` on ``device``. A host tensor bound for a CUDA device goes through pinned memory,
    non-blocking (the caching host allocator keeps the pinned buffer until the copy is done),
    so the host does not wait for the stream; a host tensor bound for another non-CPU device is
    copied non-blocking too (meta tensors in the tests); anything else is ``t.to(device)``."""
    device = torch.device(device)
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=t.device.type == "cpu" and device.type != "cpu")


def scalar(value: float | int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A 0-d tensor holding ``value`` on ``device``, filled there (no host-to-device copy)."""
    return torch.full((), value, dtype=dtype, device=device)
