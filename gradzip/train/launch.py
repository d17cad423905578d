"""Start the main job: N local workers spawned here, or one rank under torchrun.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment) this process is one rank
and runs it. Otherwise the launcher prepares the data once (so workers find the tokenizer
cached), spawns ``world_size`` processes on a free loopback port and waits; when one fails the
others are stopped and the error is reported in one line.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.multiprocessing as mp

from gradzip.testing import free_port
from gradzip.train.config import TrainConfig
from gradzip.train.data import Corpus
from gradzip.train.hooks import make_hook


class WorkerFailed(RuntimeError):
    """A worker process died or raised; the message names the rank."""


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _spawned(local_rank: int, cfg: TrainConfig, port: int) -> None:
    from gradzip.train.loop import train_worker

    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(cfg.world_size),
        LOCAL_WORLD_SIZE=str(cfg.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    train_worker(cfg)


def launch(cfg: TrainConfig) -> dict[str, Any] | None:
    """Validate, then train. Returns rank 0's summary where this process ran or spawned rank 0.

    Raises:
        ValueError: for bad settings (before any worker starts).
        WorkerFailed: if a worker fails.
    """
    cfg.validate()
    make_hook(cfg.compressor, collective=cfg.collective, min_compress_bytes=cfg.min_compress_bytes)  # a bad spec fails here, in one line, not in every worker
    Corpus.load(cfg.data, cfg.vocab_size).check_fits(cfg.seq_len)
    if under_torchrun():
        from gradzip.train.loop import train_worker

        return train_worker(cfg)
    ctx = mp.start_processes(
        _spawned, args=(cfg, free_port()), nprocs=cfg.world_size, join=False, start_method="spawn"
    )
    try:
        while not ctx.join():
            pass
    except mp.ProcessRaisedException as exc:
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else "error"
        raise WorkerFailed(f"worker rank {exc.error_index} failed: {last}") from None
    except mp.ProcessExitedException as exc:
        raise WorkerFailed(f"worker rank {exc.error_index} died (exit code {exc.exit_code})") from None
    except KeyboardInterrupt:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
        raise
    import json
    from pathlib import Path

    summary_path = Path(cfg.out) / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.exists() else None


def main_guard() -> None:
    if sys.platform == "win32":
        raise SystemExit("gradzip train needs a POSIX system")
