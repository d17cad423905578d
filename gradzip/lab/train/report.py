"""What the main job writes and prints: metrics.jsonl, summary.json, loss.png, the summary table
(layer_ratios.png: :mod:`gradzip.lab.train.layer_ratios`)."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

#: the environment variable naming the command that runs the main job, set by ``gradzip finetune``
#: (an environment variable, so that spawned workers and torchrun's ranks say the same)
COMMAND_ENV = "GRADZIP_COMMAND"


def command() -> str:
    """The command the main job's lines start with: ``gradzip train`` or ``gradzip finetune``."""
    return os.environ.get(COMMAND_ENV, "gradzip train")


def status(text: str) -> None:
    """One line saying what the main job is doing before its progress bar starts (stdout, at once)."""
    print(f"{command()}: {text}", flush=True)


class ProgressLines:
    """The progress bar's place where stderr is not a terminal: one line per twentieth of the
    run (and the last step), with the bar's figures. Takes the calls the loop makes on tqdm's
    bar: ``set_postfix``, ``update``, ``close``."""

    def __init__(self, name: str, *, total: int, initial: int = 0, lines: int = 20) -> None:
        self.name, self.total, self.n = name, total, initial
        self.every = max(1, total // lines)
        self.postfix: dict[str, Any] = {}
        self.start = time.perf_counter()

    def set_postfix(self, postfix: dict[str, Any], refresh: bool = True) -> None:
        self.postfix = dict(postfix)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n >= self.total:
            figures = " ".join(f"{k} {v}" for k, v in self.postfix.items())
            elapsed = time.perf_counter() - self.start
            print(f"{self.name}: step {self.n}/{self.total} ({elapsed:.0f} s) {figures}".rstrip(), file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        pass


class RunLog:
    """Appends one JSON line per step to ``OUT/metrics.jsonl`` (rank 0 only).

    Args:
        start_step: a resumed run's first step: the records of earlier steps already in the file
            are kept (later ones, from the interrupted run, are dropped); 0 starts a new file.
    """

    def __init__(self, out: str | Path, *, start_step: int = 0) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "metrics.jsonl"
        kept = _read_records(path, before=start_step) if start_step else []
        self.records: list[dict[str, Any]] = []
        self._file = open(path, "w", buffering=1)  # noqa: SIM115 - closed in close()
        for record in kept:
            self.write(record)

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def _read_records(path: Path, *, before: int) -> list[dict[str, Any]]:
    """The records of steps before ``before`` in a metrics file (a torn last line is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] < before:
            records.append(record)
    return records


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarize(records: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """summary.json: the run's settings in ``fields`` plus medians and totals from ``records``."""
    payload = sum(r["payload_bytes"] for r in records)
    dense = sum(r["dense_bytes"] for r in records)
    steps = len(records)
    step_s = median([r["step_s"] for r in records])
    # None where the hook did not count its bytes (PyTorch's PowerSGD hook): 0 of a nonzero dense
    known = payload > 0 or dense == 0
    summary = dict(fields)
    summary.update(
        {
            "steps": steps,
            "payload_bytes_per_step": (payload / steps if steps else 0) if known else None,
            "sent_bytes_per_step": (sum(r.get("sent_bytes", 0) for r in records) / steps if steps else 0)
            if known else None,
            "dense_bytes_per_step": dense / steps if steps else 0,
            "compression_ratio": dense / payload if payload else None,
            "step_s_median": step_s,
            "step_s_mean": statistics.fmean([r["step_s"] for r in records]) if records else 0.0,
            "fwd_bwd_s_median": median([r["fwd_bwd_s"] for r in records]),
            "optimizer_s_median": median([r["optimizer_s"] for r in records]),
            "compress_s_median": median([r["compress_s"] + r["decompress_s"] for r in records]),
            "communicate_s_median": median([r["communicate_s"] for r in records]),
            "wall_s": records[-1]["elapsed_s"] if records else 0.0,
        }
    )
    unpeeled = [[b["unpeeled"] for b in r.get("buckets", {}).values() if "unpeeled" in b] for r in records]
    if any(unpeeled):  # a count sketch ran: how often part of its support took an estimate
        summary["unpeeled_steps"] = sum(1 for counts in unpeeled if sum(counts))
        summary["unpeeled_max"] = max(sum(counts) for counts in unpeeled)
    compute = summary.get("compute_s")
    if compute is not None and dense > 0:  # with no exchange at all, what is left is noise, not communication
        exposed = summary["fwd_bwd_s_median"] - compute - summary["compress_s_median"]
        summary["exposed_communicate_s"] = max(0.0, exposed)
    return summary


def unpeeled_note(s: dict[str, Any]) -> str | None:
    """The end-of-run note of a count sketch whose support did not all peel (None otherwise)."""
    if not s.get("unpeeled_steps"):
        return None
    return (f"the count sketch could not peel part of its support at {s['unpeeled_steps']} of {s['steps']} "
            f"steps (up to {s['unpeeled_max']:,} coordinates a step); those took median estimates, which "
            "collisions bias: a larger width (countsketch:width=...) peels more")


def divergence(records: list[dict[str, Any]], final_val_loss: float, *, diverged_at: int | None,
               skipped_in_a_row: int) -> str | None:
    """Why a run counts as diverged, in one line (None when it does not): it was stopped after
    ``skipped_in_a_row`` steps skipped in a row from step ``diverged_at`` on, or it ended with a
    validation loss that is not finite."""
    finite = [r for r in records if math.isfinite(r["loss"])]
    last = f"; the last finite train loss: {finite[-1]['loss']:.4g} at step {finite[-1]['step']}" if finite else ""
    if diverged_at is not None:
        return (f"diverged: from step {diverged_at} on every step had a non-finite gradient or update on some rank "
                f"and was skipped, so the run stopped after {skipped_in_a_row} in a row{last}; no checkpoint was "
                "written from the second of them on")
    if not math.isfinite(final_val_loss):
        return f"diverged: the final validation loss is {final_val_loss}{last}; the final checkpoint was not written"
    return None


def _fmt_bytes(n: float | None, *, unknown: str = "-") -> str:
    if n is None:
        return unknown
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"


def summary_table(s: dict[str, Any]) -> str:
    """The end-of-run table, as text."""
    ratio = s.get("compression_ratio")
    rows = [
        ("compressor", s["compressor"]),
        ("optimizer", s.get("optimizer", "adamw")),
        ("collective", s.get("collective", "auto")),
        ("world size", s["world_size"]),
        ("steps", s["steps"]),
        ("model", s.get("model", "-")),
        ("parameters", f"{s['parameters']:,}"),
        ("train loss (first -> last)", f"{s['initial_train_loss']:.3f} -> {s['final_train_loss']:.3f}"),
        ("val loss (start -> end)", f"{s['initial_val_loss']:.3f} -> {s['final_val_loss']:.3f}"),
        ("tokens/s (all workers)", f"{s['tokens_per_s']:,.0f}"),
        ("payload per step", _fmt_bytes(s["payload_bytes_per_step"], unknown="unknown (the hook does not count it)")),
        ("uncompressed per step", _fmt_bytes(s["dense_bytes_per_step"])),
        ("sent per worker per step", _fmt_bytes(s.get("sent_bytes_per_step"), unknown="unknown")),
        ("compression ratio", f"{ratio:.1f}x" if ratio else "-"),
    ]
    if (s.get("replica_size") or 1) > 1:  # --outer: the exchange inside a replica, beside the one between
        rows.append((f"inside replicas of {s['replica_size']} per step", _fmt_bytes(s["replica_payload_bytes_per_step"])))
    rows += [
        ("step time (median)", f"{s['step_s_median'] * 1000:.0f} ms"),
        ("step time (mean)", f"{s['step_s_mean'] * 1000:.0f} ms" if "step_s_mean" in s else "-"),
        ("  compute alone", f"{s['compute_s'] * 1000:.0f} ms" if s.get("compute_s") is not None else "-"),
        ("  compress + decompress", f"{s['compress_s_median'] * 1000:.0f} ms"),
        ("  communicate (in flight)", f"{s['communicate_s_median'] * 1000:.0f} ms"),
        ("  communicate (exposed)", f"{s['exposed_communicate_s'] * 1000:.0f} ms" if "exposed_communicate_s" in s else "-"),
        ("  optimizer", f"{s['optimizer_s_median'] * 1000:.0f} ms"),
        ("training time", f"{s['wall_s']:.1f} s (validation and checkpoints left out)"),
    ]
    if s.get("skipped_steps"):
        by_replica = s.get("skipped_steps_by_replica")
        where = ("each replica its own: " + ", ".join(map(str, by_replica)) if by_replica is not None
                 else "a non-finite gradient on some rank")
        rows.append(("skipped steps", f"{s['skipped_steps']} ({where})"))
    if s.get("diverged"):
        rows.append(("stopped", s["diverged"].split(":")[0]))
    width = max(len(k) for k, _ in rows)
    lines = ["", f"{command()}: summary", "-" * (width + 30)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def loss_curves(
    records: list[dict[str, Any]], initial_val_loss: float | None = None
) -> tuple[list[int], list[float], list[float], list[tuple[int, float]]]:
    """What :func:`plot_losses` draws: steps, train losses, their trailing mean over ``max(1,
    n // 20)`` steps (a window that follows the run's length, so a short run's curve does not lag
    behind its losses), and the validation points, the loss before training (``initial_val_loss``)
    at step 0 first."""
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    window = max(1, len(losses) // 20)
    smooth = []
    for i in range(len(losses)):
        recent = losses[max(0, i + 1 - window) : i + 1]
        smooth.append(sum(recent) / len(recent))
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if initial_val_loss is not None and not (val and val[0][0] == 0):
        val.insert(0, (0, initial_val_loss))
    return steps, losses, smooth, val


def plot_losses(records: list[dict[str, Any]], path: Path, title: str, initial_val_loss: float | None = None) -> None:
    """Train loss (raw and smoothed) and validation loss against step, as a PNG (see
    :func:`loss_curves`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses, smooth, val = loss_curves(records, initial_val_loss)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (rank 0)")
    ax.plot(steps, smooth, color="tab:blue", label="train, smoothed")
    if val:
        ax.plot(*zip(*val), "o-", color="tab:orange", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
