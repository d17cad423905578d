"""Issue collectives in one order on every rank.

Multi-round reducers issue later rounds from future callbacks. With several buckets in flight,
callbacks finish in a timing-dependent order, and collectives issued straight from them can
reach the process group in a different order on different ranks: gloo then mismatches sizes or
hangs (this is what breaks PyTorch's ``powerSGD_hook`` on gloo with several buckets). Here every
round is queued when its bucket is hooked, in hook order (identical on all ranks), and launched
strictly first in, first out, each round only once the round it depends on has completed.

On CUDA (NCCL) the queue keeps stream order as well (see :mod:`gradzip.comm.devices`): a task
submitted with its tensors' ``device`` records where the submitter's stream stood, and its launch
waits for that (it may run later, from another future's callback on another stream); its result
future carries the device, so whoever waits on it (DDP) waits for the collective and the work
after it, and the parts of a ``collect_all`` are joined on a side stream, not the caller's.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.futures import Future

from gradzip.comm import devices

Launch = Callable[[], Future]


@dataclass
class _Task:
    launch: Launch
    after: Future | None
    device: torch.device | None
    ready: devices.ReadyMark
    result: Future


class CollectiveQueue:
    """A FIFO of collective launches for one process group.

    ``submit(launch, after=f)`` returns a future at once; ``launch()`` is called (on whichever
    thread drains the queue) when every earlier task has been launched and ``f`` has completed.
    ``launch`` does its local compute, issues one collective and returns its future; the result
    future completes with that future's value. If ``after`` or the launch fails, the result
    future carries the exception and the queue moves on. ``device`` (the device of the
    tensors the launch reads and the collective writes) makes the result future a CUDA future
    there; None or a CPU device gives a plain one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when every task has been launched
        self._tasks: deque[_Task] = deque()
        self._launching = 0  # tasks taken off the deque whose launch has not returned yet
        self._draining = False
        self._again = False

    def submit(self, launch: Launch, *, after: Future | None = None, device: torch.device | None = None) -> Future:
        """Queue ``launch`` behind every task submitted before it; returns its result future."""
        task = _Task(launch, after, device, devices.ReadyMark(device), devices.new_future(device))
        with self._lock:
            self._tasks.append(task)
        if after is not None:
            after.add_done_callback(lambda _fut: self._drain())
        self._drain()
        return task.result

    def pending(self) -> int:
        """Tasks not launched yet."""
        with self._lock:
            return len(self._tasks)

    def wait_launched(self) -> None:
        """Block until every task submitted so far has been launched (its collective issued).

        DDP issues collectives of its own once the last bucket has been hooked (the all_reduce of
        the unused-parameter map under ``find_unused_parameters=True``); waiting here in the last
        bucket's hook puts every round of the pass before them, in the same order on every rank.
        Tasks whose ``after`` has not completed are waited for.
        """
        with self._lock:
            while self._tasks or self._launching:
                self._idle.wait()

    def _next_ready(self) -> _Task | None:
        with self._lock:
            if not self._tasks:
                return None
            head = self._tasks[0]
            if head.after is not None and not head.after.done():
                return None
            self._launching += 1
            return self._tasks.popleft()

    def _drain(self) -> None:
        # One drainer at a time keeps launches in order; a call that finds another drainer
        # active asks it to look again instead of launching concurrently.
        with self._lock:
            if self._draining:
                self._again = True
                return
            self._draining = True
        try:
            while True:
                task = self._next_ready()
                if task is None:
                    with self._lock:
                        if not self._again:
                            self._draining = False
                            return
                        self._again = False
                    continue
                try:
                    self._start(task)
                finally:
                    with self._lock:
                        self._launching -= 1
                        if not self._tasks and not self._launching:
                            self._idle.notify_all()
        except BaseException:
            with self._lock:
                self._draining = False
            raise

    @staticmethod
    def _start(task: _Task) -> None:
        try:
            if task.after is not None:
                task.after.wait()  # done already; re-raises its exception (on CUDA: stream order too)
            task.ready.wait()
            fut = task.launch()
        except Exception as exc:  # noqa: BLE001 - handed to the waiter, not swallowed
            task.result.set_exception(exc)
            return

        def _forward(done: Future) -> None:
            try:
                value = done.value()
                if devices.is_cuda(task.device) and isinstance(value, list):
                    # collect_all's future has no devices: its callback runs on the caller's
                    # stream, which must not wait for the collectives; join them on a side one.
                    with torch.cuda.stream(devices.side_stream(task.device)):
                        task.result.set_result(devices.settle_parts(value))
                    return
                task.result.set_result(devices.settle_parts(value))
            except Exception as exc:  # noqa: BLE001
                task.result.set_exception(exc)

        fut.add_done_callback(_forward)


#: a future already done with a value (see :func:`gradzip.comm.devices.completed`)
completed = devices.completed
