"""Files written whole or not at all: a temporary file beside the target, fsync, rename.

A reader (a resumed run, another rank loading the token cache) sees either the old file or the
new one, never a torn write; a failure leaves no temporary file behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Create or replace ``path`` with what ``write`` puts into the binary file it is given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path``, atomically."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``data`` to ``path``, atomically."""
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: Path, text: str) -> None:
    """``text`` (UTF-8) to ``path``, atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))
