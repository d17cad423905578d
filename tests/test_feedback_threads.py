"""ErrorFeedback under two threads, as a reducer uses it: buckets compensated on DDP's hook thread
while the residuals of buckets whose collectives finished are stored from future callbacks."""

from __future__ import annotations

import sys
import threading

import torch

from gradzip.feedback import ErrorFeedback
from gradzip.keys import tensor_key

N = 400  # keys per thread


def _hook_side(memory: ErrorFeedback, errors: list) -> None:
    # a key the memory has never seen: compensate looks for its parameters under other keys
    try:
        for i in range(N):
            key = ("param", i)
            memory.compensate(key, torch.ones(3), step=1)
            memory.store(key, torch.full((3,), float(i)), step=1)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def _callback_side(memory: ErrorFeedback, errors: list) -> None:
    try:
        for i in range(N):
            memory.store(tensor_key(("params", (N + i,), (3,)), 0), torch.full((3,), -1.0), step=1)
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)


def test_compensating_and_storing_from_two_threads_keeps_every_residual():
    memory = ErrorFeedback(deferred=True)
    errors: list = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=f, args=(memory, errors)) for f in (_hook_side, _callback_side)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert set(memory.residuals) == {("param", i) for i in range(2 * N)}
    assert all(torch.equal(memory.residuals[("param", i)], torch.full((3,), float(i))) for i in range(N))
    assert all(torch.equal(memory.residuals[("param", N + i)], torch.full((3,), -1.0)) for i in range(N))
    memory.discard()  # a skipped step puts back what was there before it: nothing
    assert memory.residuals == {}
