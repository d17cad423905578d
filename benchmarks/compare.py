"""The README's headline table: time to loss on slow links, gradzip's codecs beside PyTorch's hooks.

Runs ``gradzip compare`` at each bandwidth (emulated hosts; needs root), then prints one
Markdown table over all of them and checks the bars:

- at 100 Mbit/s the best gradzip codec reaches the target loss sooner than every PyTorch hook
  that completes, with a step-time speedup of at least 90 % of the measured limit;
- at 20 Mbit/s it reaches the target at least 4x sooner than ``none``;
- ``auto`` (where run): its step at most 3% slower than ``none``'s and at most 5% slower than
  the fastest fixed gradzip codec's of the same run, its final validation loss within 1% of
  ``none``'s (same steps).

    PYTHONPATH=$PWD python benchmarks/compare.py --out runs/bench-compare
    PYTHONPATH=$PWD python benchmarks/compare.py --out runs/bench-compare --table-only   # re-print

Each bandwidth's folder holds report.md, results.json and the plots.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

COMPRESSORS = "none,fp16,torch:fp16,torch:powersgd,powersgd:approx_rank=4,topk:ratio=0.01,auto"
BANDWIDTHS = "100mbit,20mbit,1gbit"


def is_gradzip_codec(label: str) -> bool:
    return label not in ("limit", "none") and not label.startswith("torch:")


def auto_bar(link: str, rows: list[dict]) -> str | None:
    """Issue 9's bar for one setting: ``auto`` against ``none`` and the fastest fixed codec."""
    by_label = {r["compressor"]: r for r in rows if r["status"] == "ok" and r["step_s"] is not None}
    auto, dense = by_label.get("auto"), by_label.get("none")
    fixed = [r for label, r in by_label.items() if is_gradzip_codec(label) and label != "auto"]
    if auto is None or dense is None:
        return None
    vs_dense = auto["step_s"] / dense["step_s"] - 1
    loss = auto["final_val_loss"] / dense["final_val_loss"] - 1
    best = min(fixed, key=lambda r: r["step_s"]) if fixed else dense
    vs_best = auto["step_s"] / min(best["step_s"], dense["step_s"]) - 1
    ok = vs_dense <= 0.03 and vs_best <= 0.05 and abs(loss) <= 0.01
    return (
        f"{link}: auto step {auto['step_s']:.2f} s, {vs_dense:+.1%} against none, {vs_best:+.1%} against the fastest "
        f"({best['compressor']} {best['step_s']:.2f} s); final val loss {loss:+.2%} against none: "
        f"bar {'met' if ok else 'NOT met'}"
    )


def best_codec(rows: list[dict]) -> dict | None:
    """The gradzip codec that reached the target soonest (None if none did)."""
    done = [r for r in rows if is_gradzip_codec(r["compressor"]) and r["time_to_target_s"] is not None]
    return min(done, key=lambda r: r["time_to_target_s"]) if done else None


def check_bars(results: dict[str, list[dict]]) -> list[str]:
    """One line per bar: what was measured and whether it holds."""
    lines = []
    rows = results.get("100mbit")
    if rows:
        best = best_codec(rows)
        hooks = [r for r in rows if r["compressor"].startswith("torch:") and r["status"] == "ok"]
        if best is None:
            lines.append("100mbit: no gradzip codec reached the target: bar NOT met")
        else:
            beaten = [h["time_to_target_s"] is None or best["time_to_target_s"] < h["time_to_target_s"] for h in hooks]
            frac = best["fraction_of_limit"] or 0.0
            hook_text = ", ".join(
                f"{h['compressor']} {h['time_to_target_s']:.0f} s" if h["time_to_target_s"] is not None
                else f"{h['compressor']} not reached" for h in hooks
            )  # fmt: skip
            ok = all(beaten) and frac >= 0.9
            lines.append(
                f"100mbit: best gradzip codec {best['compressor']} reached the target in {best['time_to_target_s']:.0f} s "
                f"({hook_text}); step-time speedup {best['speedup']:.2f}x = {frac:.0%} of the limit: "
                f"bar {'met' if ok else 'NOT met'}"
            )
    rows = results.get("20mbit")
    if rows:
        best = best_codec(rows)
        ratio = best["time_to_target_speedup"] if best else None
        if ratio is None:
            lines.append("20mbit: no time-to-target ratio against none: bar NOT met")
        else:
            lines.append(
                f"20mbit: best gradzip codec {best['compressor']} reached the target {ratio:.2f}x sooner than none: "
                f"bar {'met' if ratio >= 4 else 'NOT met'}"
            )
    for link, rows in results.items():
        line = auto_bar(link, rows)
        if line:
            lines.append(line)
    return lines


def headline_table(results: dict[str, list[dict]]) -> str:
    head = ["link", "compressor", "step s", "speedup", "of limit", "time to target s", "vs none", "final val loss",
            "wire MB/rank for exchange"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def num(value, fmt, suffix=""):
        return "-" if value is None else format(value, fmt) + suffix

    for link, rows in results.items():
        for r in rows:
            limit = r["compressor"] == "limit"
            ttt = "n/a" if limit else ("not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f}")
            status = "" if r["status"] == "ok" else f" ({r['status']})"
            lines.append("| " + " | ".join([
                link, f"`{r['compressor']}`{status}", num(r["step_s"], ".2f"), num(r["speedup"], ".2f", "x"),
                num(r["fraction_of_limit"], ".0%"), ttt, num(r["time_to_target_speedup"], ".2f", "x"),
                "-" if limit else num(r["final_val_loss"], ".3f"),
                num(None if r["wire_bytes_exchange"] is None else r["wire_bytes_exchange"] / 1e6, ",.1f"),
            ]) + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench-compare")
    p.add_argument("--bandwidths", default=BANDWIDTHS)
    p.add_argument("--compressors", default=COMPRESSORS)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--adapt-every", type=int, default=10, help="auto's window in steps (train's default 50 is past a short run)")
    p.add_argument("--network", default="emulated", help="emulated (root) or loopback")
    p.add_argument("--table-only", action="store_true", help="print the table from earlier results")
    args = p.parse_args()
    out = Path(args.out)
    results = {}
    for bandwidth in args.bandwidths.split(","):
        folder = out / bandwidth
        if not args.table_only:
            cmd = [sys.executable, "-m", "gradzip", "compare", "--compressors", args.compressors,
                   "--world-size", str(args.world_size), "--bandwidth", bandwidth, "--network", args.network,
                   "--steps", str(args.steps), "--eval-every", str(args.eval_every),
                   "--eval-batches", str(args.eval_batches), "--adapt-every", str(args.adapt_every),
                   "--out", str(folder)]  # fmt: skip
            print("$ " + " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=False)
        if (folder / "results.json").exists():
            results[bandwidth] = json.loads((folder / "results.json").read_text())
    table = headline_table(results)
    bars = check_bars(results)
    print("\n" + table + "\n\n" + "\n".join(bars))
    (out / "table.md").write_text(table + "\n\n" + "\n".join(f"- {b}" for b in bars) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
