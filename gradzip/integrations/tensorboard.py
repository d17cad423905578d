"""TensorBoard event files through ``torch.utils.tensorboard`` (needs the ``tensorboard`` package)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def summary_writer(log_dir: str | Path) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` writing to ``log_dir``.

    Raises:
        ImportError: if the ``tensorboard`` package is not installed (the message says how to get it).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # the optional dependency is missing
        raise ImportError("--tensorboard needs the 'tensorboard' package (pip install tensorboard)") from exc
    return SummaryWriter(log_dir=str(log_dir))
