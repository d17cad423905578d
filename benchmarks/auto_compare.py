"""``auto`` against dense and fixed codecs with the main job, side by side on one link.

Runs ``gradzip train`` once per compressor with the same settings (sequentially, on this
machine's loopback unless the environment routes the workers over a slower link) and prints a
markdown table: median step time, its ratio to dense, final validation loss and its ratio to
dense, bytes per step, and the decisions ``auto`` made.

    PYTHONPATH=$PWD python benchmarks/auto_compare.py --steps 120 --adapt-every 20 --out runs/auto-compare
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DEFAULT_COMPRESSORS = ["none", "fp16", "powersgd:approx_rank=4", "auto"]


def run_one(compressor: str, args: argparse.Namespace) -> dict:
    out = Path(args.out) / compressor.replace(":", "_").replace("=", "")
    cmd = [sys.executable, "-m", "gradzip", "train", "--compressor", compressor, "--steps", str(args.steps),
           "--eval-every", str(args.steps), "--out", str(out), "--quiet", "--adapt-every", str(args.adapt_every),
           "--monitor-every", "0"] + args.train_args
    subprocess.run(cmd, check=True)
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Step 0 carries DDP's bucket rebuild and first-touch allocations: leave it out of the median.
    steps = sorted(r["step_s"] for r in records[1:])
    summary["step_s_median_from1"] = steps[len(steps) // 2]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--adapt-every", type=int, default=20)
    parser.add_argument("--compressors", default=";".join(DEFAULT_COMPRESSORS), help="specs separated by ';'")
    parser.add_argument("--out", default="runs/auto-compare")
    parser.add_argument("train_args", nargs="*", help="extra arguments for gradzip train (after --)")
    args = parser.parse_args()
    results = {c: run_one(c, args) for c in args.compressors.split(";")}
    dense = results.get("none")
    print(f"\n{args.steps} steps, 2 workers, loopback gloo; medians over steps 1..{args.steps - 1}\n")
    print("| compressor | step (ms) | vs dense | final val loss | vs dense | payload / step |")
    print("|---|---|---|---|---|---|")
    for name, s in results.items():
        step = s["step_s_median_from1"]
        ratio = step / dense["step_s_median_from1"] if dense else float("nan")
        val_ratio = s["final_val_loss"] / dense["final_val_loss"] if dense else float("nan")
        print(f"| {name} | {step * 1e3:.0f} | {ratio:.3f} | {s['final_val_loss']:.4f} | {val_ratio:.4f} | "
              f"{s['payload_bytes_per_step'] / 1e6:.2f} MB |")
    auto = results.get("auto")
    if auto is not None:
        print("\nauto's decisions:")
        for e in auto.get("monitor", {}).get("auto_decisions", []):
            if e.get("kind") == "switch":
                print(f"- step {e['step']}: bucket {e['bucket']}: {e['from']} -> {e['to']} ({e['reason']})")
            elif e.get("note"):
                print(f"- step {e['step']}: {e['note']}")
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
