"""Run a function on N real gloo ranks, for tests and benchmarks.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes on this machine, joins them
into one gloo process group over loopback, calls ``fn(rank, world_size, *args)`` in each, and
returns the per-rank return values (anything ``torch.save`` can write). A rank that raises makes
the call raise with that rank's traceback; a rank that does not finish within ``timeout_s`` is
killed and the call raises ``TimeoutError``.

Where the platform has it, ranks are forked from a multiprocessing fork server that imported
torch, torch.distributed and gradzip once (and whatever :func:`preload` added before the first
call), so a rank starts in milliseconds instead of importing torch for seconds; each rank is
still a fresh process that has run no code of the caller's. Each rank runs with the caller's
environment as it is at the call (as a spawned process would). Elsewhere ranks are spawned.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: modules the fork server imports once for every rank it starts
_PRELOAD = ["__main__", "torch", "torch.distributed", "gradzip"]


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too, so ranks start with them loaded.

    Takes effect when the fork server starts, at the first :func:`run_ranks` of the process
    (a name that does not import is passed over there, as multiprocessing does). Modules should
    only define things when imported: the server forks every rank from that state.
    """
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


#: what gloo says when a peer went away ("Connection closed by peer", "Connection reset by peer",
#: a broken pipe): the consequence of another rank's failure, not its cause
_AFTERMATH = ("by peer", "Broken pipe")


def _start_method() -> str:
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, timeout_s: float, env: dict[str, str]
) -> None:
    # ``port``: the parent's TCPStore, listening since before the ranks started (no port race)
    # A forked rank has the fork server's environment, from when it started; the caller's counts.
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "value": value}, result_path)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks, each its own process.

    Args:
        fn: a module-level function (spawned processes import it by name).
        world_size: number of ranks, >= 1.
        timeout_s: wall-clock limit for the whole run, and the collectives' timeout.

    Returns:
        the return values, indexed by rank.

    Raises:
        RuntimeError: if a rank raised (its traceback is in the message).
        TimeoutError: if the ranks did not finish in ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    method = _start_method()
    if method == "forkserver":
        mp.set_forkserver_preload(_PRELOAD)
    # the parent owns the rendezvous store on a port the kernel picked: nothing can take it between
    # choosing and binding, as with a port found free and released
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    with tempfile.TemporaryDirectory(prefix="gradzip-ranks-") as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, store.port, out_dir, fn, args, timeout_s, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=method,
        )
        deadline = timeout_s + 30  # spawning and importing torch take a few seconds per rank
        import time

        start = time.monotonic()
        while not ctx.join(timeout=1.0):
            if time.monotonic() - start > deadline:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.kill()
                raise TimeoutError(f"ranks did not finish within {deadline:.0f} s")
        records = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            exists = os.path.exists(path)
            records.append(torch.load(path, weights_only=False) if exists else {"ok": False, "error": "exited without a result\n"})
        failed = [(rank, r["error"]) for rank, r in enumerate(records) if not r["ok"]]
        if failed:
            # a rank that raised first makes its peers fail with "closed by peer": its error leads
            failed.sort(key=lambda item: any(mark in item[1] for mark in _AFTERMATH))
            raise RuntimeError("".join(f"rank {rank} failed:\n{error}" for rank, error in failed))
        results = [r["value"] for r in records]
        return results
