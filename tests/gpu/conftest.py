"""Fixtures of the GPU tier (``tests/conftest.py`` gives these modules the ``gpu`` tier and skips
them where torch sees no GPU): one NCCL process group of this process alone, and PyTorch's sync
check around code that must not make the host wait for the device."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def nccl_group():
    """NCCL at world size 1 on ``cuda:0``, for the whole session (DDP, FSDP and the reducers)."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


@contextlib.contextmanager
def _no_host_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture
def no_host_sync():
    """A context manager that fails at the first operation making the host wait for the device
    (``torch.cuda.set_sync_debug_mode("error")``)."""
    return _no_host_sync
