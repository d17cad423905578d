"""Checkpoints that a crash cannot half-write.

Layout under ``OUT/checkpoints/``: one folder per saved step, ``step-000300/``, holding
``shared.pt`` (model, optimizer, scheduler, step, config; written by rank 0) and
``rank-R.pt`` for every rank (its compressor and error-feedback state and its data generator,
which differ across ranks). Every file is written to a temporary name, fsynced and renamed;
``latest`` (a one-line text file naming the folder) is replaced last, after all ranks have
written, so it always names a complete checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` via a temporary file, fsync and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(out: str | Path, step: int, *, shared: dict[str, Any], per_rank: dict[str, Any], rank: int) -> Path:
    """Save this rank's part of the checkpoint of ``step``; rank 0 also writes the shared part
    and, once every rank has finished (a barrier), points ``latest`` at it.

    Returns:
        the checkpoint folder.
    """
    folder = Path(out) / "checkpoints" / f"step-{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_save(per_rank, folder / f"rank-{rank}.pt")
    if rank == 0:
        atomic_save(shared, folder / "shared.pt")
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        atomic_write_text(Path(out) / "checkpoints" / "latest", folder.name + "\n")
    return folder


def latest_checkpoint(out: str | Path) -> Path | None:
    """The folder ``latest`` names, or None if there is none."""
    pointer = Path(out) / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    folder = pointer.parent / pointer.read_text().strip()
    return folder if folder.is_dir() else None
