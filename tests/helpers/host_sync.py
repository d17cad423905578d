"""Find host synchronisation on CPU: run code on ``meta`` tensors under :class:`NoHostSync`.

On CUDA, reading a device value on the host (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``), an op whose output size depends on the values (``nonzero``, boolean indexing,
``unique``) and a blocking copy between host and device each wait for the stream. A meta tensor
has no values, so code that runs on meta tensors decides nothing on the host from device
values; the dispatch mode here names the first op that would wait (instead of the meta kernel's
generic error) and refuses blocking copies between the host and the device, which meta
tensors would otherwise accept. ``torch.cuda.set_sync_debug_mode("error")`` is the same check
on a GPU (tests/gpu use it).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: ops whose output size (or value) the host must read from the device
_READS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.equal.default,
    aten.repeat_interleave.Tensor,
}


class HostSync(AssertionError):
    """Raised where code on device tensors would wait for the device on the host."""


def _device_tensors(args, kwargs) -> list[torch.Tensor]:
    flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
    return [a for a in flat if isinstance(a, torch.Tensor) and a.device.type != "cpu"]


class NoHostSync(TorchDispatchMode):
    """Raises :class:`HostSync` at the first op that would make the host wait for a device."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS and _device_tensors(args, kwargs):
            raise HostSync(f"{func} reads a device value on the host")
        if func is aten.index.Tensor and _device_tensors(args, kwargs):
            if any(i is not None and i.dtype == torch.bool for i in args[1]):
                raise HostSync("boolean indexing of a device tensor (a nonzero) reads its count on the host")
        if func is aten._to_copy.default:
            source, target = args[0].device, kwargs.get("device")
            if target is not None and torch.device(target).type != source.type and not kwargs.get("non_blocking", False):
                raise HostSync(f"a blocking copy from {source} to {target}")
        if func is aten.copy_.default:
            target, source = args[0], args[1]
            crossing = target.device.type != source.device.type and source.dim() > 0
            if crossing and not (len(args) > 2 and args[2]) and not kwargs.get("non_blocking", False):
                raise HostSync(f"a blocking copy from {source.device} to {target.device}")
        return func(*args, **kwargs)
