"""Bytes per worker and time per bucket: all_gather vs two-phase vs dense all_reduce.

For each world size, spawns that many gloo ranks on loopback and sends one fp32 bucket through

- ``dense``: the raw bucket, ring ``all_reduce`` (``none`` codec);
- each codec through ``all_gather`` of its payloads and through the two-phase compressed
  all_reduce (:mod:`gradzip.comm.twophase`).

Bytes per worker are counted two ways: by the formulas the reducer records in its metrics
(:mod:`gradzip.comm.traffic`), and measured as the growth of ``wchar`` in ``/proc/self/io``
around the exchange (every byte the rank's process writes, gloo's sockets included, message
headers too). Time per bucket is the median over repeats on the slowest rank, compression
included. Loopback on a shared machine: the times say little about a real network; the bytes
are the point.

    python benchmarks/collectives.py                      # world sizes 2..8, 1 M elements
    python benchmarks/collectives.py --world-sizes 2,4 --numel 65536 --repeats 3

Writes OUT/collectives.json, OUT/collectives.md (the table) and OUT/collectives.png (bytes per
worker against world size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gradzip.comm import make_reducer
from gradzip.compressors import build
from gradzip.testing import run_ranks

DEFAULT_CODECS = "efsignsgd,topk:ratio=0.01"


def written_bytes() -> int:
    """Bytes this process has written so far (``wchar`` of ``/proc/self/io``, all threads)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def methods(codecs: list[str]) -> list[tuple[str, str, str]]:
    """``(label, codec spec, collective)`` for every exchange measured."""
    out = [("dense fp32 all_reduce", "none", "allreduce")]
    for spec in codecs:
        out.append((f"{spec} all_gather", spec, "allgather"))
        out.append((f"{spec} two-phase", spec, "twophase"))
    return out


def _bench_rank(rank: int, world_size: int, numel: int, codecs: list[str], repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(rank)
    grad = torch.randn(numel, generator=gen)
    rows = []
    for label, spec, collective in methods(codecs):
        reducer = make_reducer(spec, collective=collective)
        reducer.reduce("bucket", grad, step=0).wait()  # warm-up: allocations, first connection use
        reducer.metrics.pop()
        times, written, counted = [], [], []
        for step in range(1, repeats + 1):
            dist.barrier()
            before = written_bytes()
            start = time.perf_counter()
            reducer.reduce("bucket", grad, step=step).wait()
            times.append(time.perf_counter() - start)
            written.append(written_bytes() - before)
            metrics = reducer.metrics.pop()
            counted.append(metrics["sent_bytes"])
            route = metrics["buckets"]["bucket"]["collective"]
        rows.append(
            {
                "method": label,
                "spec": spec,
                "collective": route,
                "world_size": world_size,
                "rank": rank,
                "numel": numel,
                "sent_bytes": counted[-1],
                "written_bytes": statistics.median(written),
                "time_s": statistics.median(times),
            }
        )
    return rows


def measure(world_sizes: list[int], numel: int, codecs: list[str], repeats: int) -> list[dict]:
    """One row per (world size, method): bytes per worker (mean over ranks) and seconds (slowest rank)."""
    table = []
    for world_size in world_sizes:
        ranks = run_ranks(_bench_rank, world_size, numel, codecs, repeats, timeout_s=600)
        for i, row in enumerate(ranks[0]):
            per_rank = [r[i] for r in ranks]
            table.append(
                {
                    "world_size": world_size,
                    "method": row["method"],
                    "spec": row["spec"],
                    "collective": row["collective"],
                    "numel": numel,
                    "sent_bytes_per_worker": statistics.mean(r["sent_bytes"] for r in per_rank),
                    "written_bytes_per_worker": statistics.mean(r["written_bytes"] for r in per_rank),
                    "time_s": max(r["time_s"] for r in per_rank),
                }
            )
        print(f"world size {world_size}: done", flush=True)
    return table


def ratios(table: list[dict], codecs: list[str]) -> list[dict]:
    """Per codec and world size: bytes of all_gather and of dense all_reduce over two-phase."""
    index = {(r["world_size"], r["method"]): r for r in table}
    out = []
    for world_size in sorted({r["world_size"] for r in table}):
        dense = index[(world_size, "dense fp32 all_reduce")]["sent_bytes_per_worker"]
        for spec in codecs:
            two = index[(world_size, f"{spec} two-phase")]["sent_bytes_per_worker"]
            gather = index[(world_size, f"{spec} all_gather")]["sent_bytes_per_worker"]
            out.append(
                {"world_size": world_size, "spec": spec, "allgather_over_twophase": gather / two, "dense_over_twophase": dense / two}
            )
    return out


def markdown(table: list[dict], ratio_rows: list[dict], numel: int) -> str:
    """Three tables: kB sent per worker (counted / measured), ms per bucket, and the ratios."""
    method_names = list(dict.fromkeys(r["method"] for r in table))
    index = {(r["world_size"], r["method"]): r for r in table}
    world_sizes = sorted({r["world_size"] for r in table})
    header = "| world size | " + " | ".join(method_names) + " |"
    rule = "|---:|" + "---:|" * len(method_names)
    lines = [
        f"One bucket of {numel:,} fp32 elements ({numel * 4 / 1e6:.2f} MB). kB sent per worker, counted by the "
        "formula / measured (wchar):",
        "",
        header,
        rule,
    ]
    for w in world_sizes:
        cells = [
            f"{index[(w, m)]['sent_bytes_per_worker'] / 1e3:,.1f} / {index[(w, m)]['written_bytes_per_worker'] / 1e3:,.1f}"
            for m in method_names
        ]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines += ["", "ms per bucket (median of the repeats, slowest rank, compression included):", "", header, rule]
    for w in world_sizes:
        lines.append(f"| {w} | " + " | ".join(f"{index[(w, m)]['time_s'] * 1000:.1f}" for m in method_names) + " |")
    lines += ["", "Bytes per worker relative to two-phase (counted):", ""]
    lines += ["| world size | codec | all_gather / two-phase | dense all_reduce / two-phase |", "|---:|---|---:|---:|"]
    for r in ratio_rows:
        lines.append(
            f"| {r['world_size']} | {r['spec']} | {r['allgather_over_twophase']:.2f}x | {r['dense_over_twophase']:.1f}x |"
        )
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: Path, numel: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    for method in dict.fromkeys(r["method"] for r in table):
        rows = [r for r in table if r["method"] == method]
        xs = [r["world_size"] for r in rows]
        line = ax.plot(xs, [r["sent_bytes_per_worker"] / 1e6 for r in rows], "o-", label=method)[0]
        ax.plot(xs, [r["written_bytes_per_worker"] / 1e6 for r in rows], "x", color=line.get_color(), markersize=8)
    ax.set_yscale("log")
    ax.set_xlabel("world size (gloo ranks on loopback)")
    ax.set_ylabel("MB sent per worker per bucket")
    ax.set_title(f"One {numel * 4 / 1e6:.1f} MB fp32 bucket: lines counted, x measured (wchar)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,3,4,5,6,7,8", help="comma-separated (default 2..8)")
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements in the fp32 bucket (default 1 M)")
    parser.add_argument("--codecs", default=DEFAULT_CODECS, help=f"comma-separated specs (default {DEFAULT_CODECS})")
    parser.add_argument("--repeats", type=int, default=5, help="timed exchanges per method (default 5)")
    parser.add_argument("--out", default="benchmarks/results/collectives", help="output folder")
    args = parser.parse_args(argv)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    if any(w < 2 for w in world_sizes):
        raise SystemExit("--world-sizes must be integers >= 2")
    if args.numel < 1 or args.repeats < 1:
        raise SystemExit("--numel and --repeats must be >= 1")
    codecs = [s for s in args.codecs.split(",") if s]
    for spec in codecs:
        build(spec)  # a bad spec fails here, not in every rank

    table = measure(world_sizes, args.numel, codecs, args.repeats)
    ratio_rows = ratios(table, codecs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "collectives.json").write_text(json.dumps({"rows": table, "ratios": ratio_rows}, indent=2) + "\n")
    text = markdown(table, ratio_rows, args.numel)
    (out / "collectives.md").write_text(text)
    plot(table, out / "collectives.png", args.numel)
    print(text)
    print(f"wrote {out}/collectives.json, collectives.md, collectives.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
