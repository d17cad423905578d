"""Cost of the quality checks inside real training runs: checked steps beside unchecked ones.

Reads the ``metrics.jsonl`` of runs made with ``--monitor-every N`` (``gradzip train`` or the runs
under a ``gradzip compare`` folder). In each run the steps that carry quality figures are set
against the other steps of the same run (same processes, same codec, same minute of machine
load): the median extra seconds of a checked step, divided by N, is the monitoring's share of
the median step. Step 0 and steps before a codec's first compressed step are left out (start-up
and dense warm-up steps differ in cost).

    PYTHONPATH=$PWD python benchmarks/monitor_in_run.py runs/bench5/loopback/runs/*
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def checked(record: dict) -> bool:
    return any("quality" in bucket for bucket in (record.get("buckets") or {}).values())


def compressed(record: dict) -> bool:
    return record.get("payload_bytes", 0) < record.get("dense_bytes", 0)


def run_share(path: Path, monitor_every: int) -> dict | None:
    """Median step seconds with and without checks in one run, and the share at ``monitor_every``."""
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "step_s" in r and r["step"] > 0]
    if any(compressed(r) for r in records):  # leave out a dense warm-up before compression starts
        first = min(r["step"] for r in records if compressed(r))
        records = [r for r in records if r["step"] >= first]
    on = [r["step_s"] for r in records if checked(r)]
    off = [r["step_s"] for r in records if not checked(r)]
    if not on or not off:
        return None
    step_on, step_off = statistics.median(on), statistics.median(off)
    extra = step_on - step_off
    return {
        "run": path.name, "checked_steps": len(on), "unchecked_steps": len(off), "step_checked_s": step_on,
        "step_unchecked_s": step_off, "extra_per_check_s": extra, "share": extra / monitor_every / step_off,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run folders holding metrics.jsonl")
    p.add_argument("--monitor-every", type=int, default=10, help="N the runs were made with")
    args = p.parse_args()
    print("| run | checked / unchecked steps | step, checked (s) | step, unchecked (s) | extra per check (s) "
          f"| share of a step at --monitor-every {args.monitor_every} |")
    print("|---|---|---|---|---|---|")
    for path in args.runs:
        row = run_share(path, args.monitor_every) if (path / "metrics.jsonl").exists() else None
        if row is None:
            continue
        print(f"| {row['run']} | {row['checked_steps']} / {row['unchecked_steps']} | {row['step_checked_s']:.3f} "
              f"| {row['step_unchecked_s']:.3f} | {row['extra_per_check_s']:+.3f} | {row['share']:+.2%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
