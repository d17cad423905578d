"""What runs where: the device a group's collectives take, and futures that keep CUDA stream
order.

On CPU (gloo) every function here gives the plain thing (a ``Future()``, no events). On CUDA
(NCCL) three rules of ``torch.futures`` and ``torch.cuda`` matter:

- A future carries CUDA stream order only if it was made with ``devices=[...]`` and its value
  holds the tensors its consumers read: ``set_result`` then records an event on the current
  stream, ``wait()`` makes the waiter's stream wait for it, and ``then`` runs its callback on a
  pool stream that waits for it. A device-less ``Future()`` holding CUDA tensors hands them over
  with no ordering at all, so DDP (which waits on the hook's future, then copies the result on
  its own stream) could read a bucket before it is written.
- ``torch.futures.collect_all`` returns a device-less future whose value is the list of futures;
  each part must be waited on for its events to apply (:func:`settle_parts`).
- A blocking copy between host and device (``cpu_tensor.to("cuda")``, ``.cpu()``, ``.item()``)
  waits for every kernel queued on the stream: inside a DDP hook that stalls backward until the
  GPU catches up (see :mod:`gradzip.compressors.kernels.placement` for copies that do not).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future


def is_cuda(device: torch.device | str | None) -> bool:
    """Whether ``device`` is a CUDA device (None: no)."""
    return device is not None and torch.device(device).type == "cuda"


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s collectives take: the current CUDA device for NCCL,
    the CPU otherwise (gloo, MPI)."""
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def new_future(device: torch.device | str | None = None) -> Future:
    """An empty future that orders the CUDA streams of ``device`` (a plain one elsewhere)."""
    return Future(devices=[torch.device(device)]) if is_cuda(device) else Future()


def _devices_of(value: Any) -> list[torch.device]:
    """The CUDA devices of the tensors in ``value`` (a tensor, or lists and tuples of them)."""
    found: dict[torch.device, None] = {}
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Tensor):
            if item.device.type == "cuda":
                found[item.device] = None
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return list(found)


def completed(value: Any) -> Future:
    """A future that is already done with ``value``; on the CUDA devices of its tensors, ordered
    after the work queued so far on the current streams."""
    fut = Future(devices=_devices_of(value)) if _devices_of(value) else Future()
    fut.set_result(value)
    return fut


def settle_parts(value: Any) -> Any:
    """The value of a finished future with the futures of ``collect_all`` replaced by their
    values: each part is waited on (which makes the current stream wait for its CUDA events), so
    the tensors they hold can be read, and handed on, in stream order."""
    # collect_all hands back torch._C.Future objects, the base class of torch.futures.Future.
    if isinstance(value, list) and value and all(isinstance(v, torch._C.Future) for v in value):
        return [part.wait() for part in value]
    return value


class ReadyMark:
    """Where the current CUDA stream of ``device`` stands now (an event), so that work launched
    later from another thread or stream (a future's callback) can wait for it; a no-op on CPU."""

    def __init__(self, device: torch.device | str | None) -> None:
        self.event = None
        if is_cuda(device):
            self.device = torch.device(device)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(self.device))

    def wait(self) -> None:
        """Make the current stream wait for the mark (no host wait)."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)


_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_side_lock = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per CUDA device for bookkeeping that must not make the caller's stream wait
    (joining the parts of a ``collect_all``)."""
    with _side_lock:
        if device not in _side_streams:
            _side_streams[device] = torch.cuda.Stream(device)
        return _side_streams[device]
