"""From runs to rows: time to the target loss, speedups against ``none`` and the ``limit``.

Definitions (per run; bytes are per rank over the whole run):

- ``step_s``: median wall time of a training step (rank 0).
- ``speedup``: ``step_s`` of ``none`` / ``step_s`` of the run. The ``limit`` row's speedup is the
  largest possible: its step is the compute alone (same workers, no gradient exchange).
- ``fraction_of_limit``: ``speedup`` / speedup of ``limit`` (1.0 = as fast as not communicating).
- ``compute_utilisation``: mean step time of ``limit`` (compute alone) / the run's mean step time.
  Means, not medians: an outer loop (DiLoCo) exchanges on one step in ``H``, which a median
  hides.
- ``time_to_target_s``: training wall time (``elapsed_s``: validation passes and checkpoints left
  out) at the first validation pass whose loss is at or below the target; None when never
  reached. The target is ``--target-loss``, or the final validation loss of ``none`` plus
  ``--target-margin`` (1 % by default).
- ``time_to_target_speedup``: ``time_to_target_s`` of ``none`` / that of the run.
- ``payload_bytes``: bytes the hook handed to collectives, summed over steps (rank 0's count);
  None where the hook cannot say (PyTorch's PowerSGD).
- ``sent_bytes``: bytes the hook says this rank sent over the wire, by the collectives' formulas
  (a ring all_reduce sends 2 (N-1)/N times its payload), summed over steps; None where unknown.
- ``link_changes``: under ``--link-schedule``, the link rate changes made during the run, each
  with the step and rate asked for and the last step recorded before and after it was made
  (:func:`gradzip.lab.compare.runner.applied_changes`); None without a schedule.
- ``wire_bytes``: bytes the hosts' interfaces sent during the run (Ethernet frames, mean over
  hosts), start-up included; ``wire_bytes_exchange`` subtracts the ``limit`` row's, which has the
  same start-up traffic (rendezvous, DDP's initial broadcast) and no gradient exchange.

With ``--repeats N`` every row runs once per round, the rows of a round one after the other.
Each round's rows are compared among themselves (a round's ``limit`` is the compute alone of
that round's runs), and :func:`merge_repeats` reports the median over the rounds of every timed
figure and ratio, with the range of ``compute_utilisation`` and ``time_to_target_s``. Losses and
payload bytes do not depend on timing and are the same in every round.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from gradzip.lab.compare.runner import RunResult

LIMIT = "limit"
BASELINE = "none"
TARGET_MARGIN = 0.01  # the default target is the baseline's final validation loss plus 1 %


def time_to_target(records: Sequence[dict[str, Any]], target: float) -> float | None:
    """``elapsed_s`` of the first record whose ``val_loss`` is <= ``target``, else None."""
    for record in records:
        val = record.get("val_loss")
        if val is not None and val <= target:
            return record["elapsed_s"]
    return None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def base_row(result: RunResult) -> dict[str, Any]:
    """The run's own figures (no comparison with other runs)."""
    records, summary = result.records, result.summary or {}
    payload_total = sum(r.get("payload_bytes", 0) for r in records)
    dense_total = sum(r.get("dense_bytes", 0) for r in records)
    payload_known = payload_total > 0 or dense_total == 0  # 0 of nonzero dense: the hook did not say
    sent_total = sum(r.get("sent_bytes", 0) for r in records)
    sent_known = any("sent_bytes" in r for r in records) and (sent_total > 0 or dense_total == 0)
    wire = result.tx_bytes
    return {
        "compressor": result.label,
        "status": result.status,
        "error": result.error,
        "steps": len(records),
        "wall_s": summary.get("wall_s"),
        "process_wall_s": result.process_wall_s,
        "step_s": _median([r["step_s"] for r in records]),
        "mean_step_s": statistics.fmean([r["step_s"] for r in records]) if records else None,
        "compute_s": summary.get("compute_s"),
        "compress_s": _median([r.get("compress_s", 0.0) + r.get("decompress_s", 0.0) for r in records]),
        "communicate_s": _median([r.get("communicate_s", 0.0) for r in records]),
        "exposed_communicate_s": summary.get("exposed_communicate_s"),
        "initial_val_loss": summary.get("initial_val_loss"),
        "final_val_loss": summary.get("final_val_loss"),
        "time_to_target_s": None,
        "payload_bytes": payload_total if payload_known else None,
        "payload_bytes_per_step": payload_total / len(records) if payload_known and records else None,
        "dense_bytes_per_step": dense_total / len(records) if records else None,
        "compression_ratio": dense_total / payload_total if payload_known and payload_total else None,
        "sent_bytes": sent_total if sent_known else None,
        "wire_bytes": sum(wire) / len(wire) if wire else None,
        "wire_bytes_exchange": None,
        "wire_bytes_per_host": wire,
        "link_changes": result.link_changes,
        "speedup": None,
        "fraction_of_limit": None,
        "compute_utilisation": None,
        "time_to_target_speedup": None,
    }


def compare_rows(results: Sequence[RunResult], *, target_loss: float | None = None,
                 target_margin: float = TARGET_MARGIN) -> tuple[list[dict], dict]:
    """One row per run, with the comparisons filled in.

    Args:
        results: the runs; the one labelled ``none`` is the baseline, ``limit`` the limit row.
        target_loss: the validation loss to reach; None takes the baseline's final one times
            ``1 + target_margin``.
        target_margin: the baseline's margin as a fraction (0.01: 1 %).

    Returns:
        (rows in the order of ``results``, ``{"target_loss", "target_source"}``).
    """
    rows = [base_row(r) for r in results]
    by_label = {row["compressor"]: row for row in rows}
    base = by_label.get(BASELINE)
    limit = by_label.get(LIMIT)
    base_ok = base is not None and base["status"] == "ok"
    limit_ok = limit is not None and limit["status"] == "ok"

    if target_loss is not None:
        source = "--target-loss"
    elif base_ok and base["final_val_loss"] is not None:
        target_loss = base["final_val_loss"] * (1 + target_margin)
        source = f"final validation loss of '{BASELINE}' ({base['final_val_loss']:.4f}) plus {target_margin:.0%}"
    else:
        source = f"none: '{BASELINE}' did not finish and no --target-loss was given"

    for row, result in zip(rows, results):
        if row["compressor"] != LIMIT and target_loss is not None:
            row["time_to_target_s"] = time_to_target(result.records, target_loss)
        if limit_ok and row["wire_bytes"] is not None and limit["wire_bytes"] is not None:
            row["wire_bytes_exchange"] = max(0.0, row["wire_bytes"] - limit["wire_bytes"])

    for row in rows:
        if limit_ok and row["status"] == "ok":
            row["compute_utilisation"] = _ratio(limit["mean_step_s"], row["mean_step_s"])
    limit_speedup = _ratio(base["step_s"], limit["step_s"]) if base_ok and limit_ok else None
    for row in rows:
        if row["status"] != "ok" or not base_ok:
            continue
        row["speedup"] = _ratio(base["step_s"], row["step_s"])
        row["fraction_of_limit"] = _ratio(row["speedup"], limit_speedup)
        row["time_to_target_speedup"] = _ratio(base["time_to_target_s"], row["time_to_target_s"])
    return rows, {"target_loss": target_loss, "target_source": source}


#: the figures that depend on timing: medians over the rounds in :func:`merge_repeats`
TIMED = ("wall_s", "process_wall_s", "step_s", "mean_step_s", "compute_s", "compress_s", "communicate_s",
         "exposed_communicate_s", "speedup", "fraction_of_limit", "compute_utilisation", "time_to_target_speedup",
         "wire_bytes", "wire_bytes_exchange")


def _median_time(times: list[float | None]) -> float | None:
    """The median of times to target, None (never reached) counting as slower than any time."""
    ordered = sorted(times, key=lambda t: (t is None, t or 0.0))
    middle = ordered[(len(ordered) - 1) // 2 : len(ordered) // 2 + 1]  # one or two values
    return None if None in middle else statistics.fmean(middle)


def merge_repeats(rounds: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per entry from the rows of several rounds (each round's rows in the same order,
    compared within the round by :func:`compare_rows`).

    A row's status is ``ok`` when every round's run was; otherwise the first failing round's
    status and error. Timed figures (:data:`TIMED`) are the median over the rounds that have
    them; ``time_to_target_s`` is the median over all rounds with a round that never reached the
    target counted as slower than any that did (None when most did not); ``*_range`` gives the
    smallest and largest round of ``compute_utilisation`` and ``time_to_target_s``; ``repeats``
    is the number of rounds. Everything else is the first round's.
    """
    assert rounds and all(len(r) == len(rounds[0]) for r in rounds), "every round has the same rows"
    merged = []
    for k, first in enumerate(rounds[0]):
        runs = [r[k] for r in rounds]
        assert all(run["compressor"] == first["compressor"] for run in runs)
        row = dict(first)
        failed = [run for run in runs if run["status"] != "ok"]
        if failed:
            row["status"], row["error"] = failed[0]["status"], failed[0]["error"]
        for key in TIMED:
            row[key] = _median([run[key] for run in runs if run[key] is not None])
        row["time_to_target_s"] = _median_time([run["time_to_target_s"] for run in runs])
        for key in ("compute_utilisation", "time_to_target_s"):
            known = [run[key] for run in runs if run[key] is not None]
            row[f"{key}_range"] = [min(known), max(known)] if known else None
        row["repeats"] = len(runs)
        merged.append(row)
    return merged
