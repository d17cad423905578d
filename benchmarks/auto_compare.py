"""``auto`` against dense and fixed codecs with the main job, side by side on one link.

Runs ``gradzip train`` once per compressor with the same settings (sequentially) and prints a
markdown table: median step time, its ratio to dense, final validation loss and its ratio to
dense, bytes per step, and the decisions ``auto`` made.

Without ``--link-mbit`` the two workers talk over loopback. With it (root needed), each worker
runs in its own network namespace, joined by a veth pair with a ``tbf`` qdisc at that rate on
both ends, as the project's design notes describe; the workers start as one torchrun-style rank
each (``RANK``, ``WORLD_SIZE``, ``GLOO_SOCKET_IFNAME``).

    PYTHONPATH=$PWD python benchmarks/auto_compare.py --steps 120 --adapt-every 20 --out runs/auto-compare
    PYTHONPATH=$PWD python benchmarks/auto_compare.py --link-mbit 100 --compressors "none;auto"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

NETNS = ("gzbench-a", "gzbench-b")
VETH = ("gzbencha", "gzbenchb")
ADDRS = ("10.209.0.1", "10.209.0.2")

DEFAULT_COMPRESSORS = ["none", "fp16", "powersgd:approx_rank=4", "auto"]


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


@contextmanager
def slow_link(rate_mbit: float):
    """Two network namespaces joined by a veth pair shaped by ``tbf`` at ``rate_mbit`` each way."""
    for ns in NETNS:
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
    try:
        for ns in NETNS:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        burst_kbit = max(32, int(rate_mbit * 1000 / 250 * 2))  # two timer ticks' worth at HZ=250
        for ns, dev, addr in zip(NETNS, VETH, ADDRS):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                "burst", f"{burst_kbit}kbit", "latency", "100ms")
        yield
    finally:
        for ns in NETNS:
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


def run_one(compressor: str, args: argparse.Namespace) -> dict:
    out = Path(args.out) / compressor.replace(":", "_").replace("=", "")
    train = ["-m", "gradzip", "train", "--compressor", compressor, "--steps", str(args.steps),
             "--eval-every", str(args.steps), "--out", str(out), "--quiet", "--adapt-every", str(args.adapt_every),
             "--monitor-every", "0"] + args.train_args
    if args.link_mbit is None:
        subprocess.run([sys.executable, *train], check=True)
    else:
        procs = []
        for rank, (ns, dev) in enumerate(zip(NETNS, VETH)):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR=ADDRS[0], MASTER_PORT="29611", GLOO_SOCKET_IFNAME=dev)
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *train], env=env))
        if any(p.wait() != 0 for p in procs):
            raise RuntimeError(f"gradzip train --compressor {compressor} failed")
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
    parser.add_argument("--link-mbit", type=float, default=None, help="shape a veth link to this rate (root)")
    parser.add_argument("train_args", nargs="*", help="extra arguments for gradzip train (after --)")
    args = parser.parse_args()
    if args.link_mbit is None:
        results = {c: run_one(c, args) for c in args.compressors.split(";")}
        where = "loopback gloo"
    else:
        with slow_link(args.link_mbit):
            results = {c: run_one(c, args) for c in args.compressors.split(";")}
        where = f"veth shaped to {args.link_mbit:g} Mbit/s"
    dense = results.get("none")
    print(f"\n{args.steps} steps, 2 workers, {where}; medians over steps 1..{args.steps - 1}\n")
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
                print(f"- step {e['step']}: {e['reason']}")
            elif e.get("note"):
                print(f"- step {e['step']}: {e['note']}")
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
