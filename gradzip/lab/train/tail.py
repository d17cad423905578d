"""Reading a run's ``metrics.jsonl`` while the run appends to it: the lines completed since the
last read, never a line still being written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsTail:
    """The records rank 0 of ``gradzip train`` has appended to ``path`` since the last :meth:`read`.

    Args:
        path: the run's ``metrics.jsonl``; it may not exist yet.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        """The complete lines added since the last call, as dicts (unparsable lines skipped); a
        line without its newline yet is read by a later call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        records = []
        for line in chunk[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records
