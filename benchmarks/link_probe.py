"""What a link probe costs: all_reduces of the auto reducer's figure all_reduce's size (a few
hundred bytes) and of a probe's sizes (:meth:`gradzip.control.link.LinkEstimator.probe_bytes`:
eight latencies' worth of bytes, 64 KiB to 8 MiB), timed side by side on real gloo ranks, rows
interleaved, medians of ``--repeats`` rounds. Also what the estimator reads from those times:
the latency from the small all_reduce, the bandwidth from the probe-sized ones.

    PYTHONPATH=$PWD python benchmarks/link_probe.py --world-size 2 --repeats 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from gradzip.comm.traffic import allreduce_bytes
from gradzip.control.link import LinkEstimator
from gradzip.testing import run_ranks

SIZES = [800, 64 << 10, 1 << 20, 8 << 20]  # the figures alone, then probes


def _rank(rank: int, world_size: int, repeats: int) -> dict[int, list[float]]:
    torch.set_num_threads(1)
    tensors = {size: torch.zeros(size // 8, dtype=torch.float64) for size in SIZES}
    times: dict[int, list[float]] = {size: [] for size in SIZES}
    for _ in range(repeats):
        for size in SIZES:  # interleaved: a noisy moment hits every size
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensors[size], op=dist.ReduceOp.MAX)
            times[size].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    results = run_ranks(_rank, args.world_size, args.repeats)
    # min over ranks per round, as the auto reducer reduces figures_s, then the median
    medians = {size: statistics.median(min(r[size][i] for r in results) for i in range(args.repeats)) for size in SIZES}
    print(f"{args.world_size} gloo ranks, {args.repeats} interleaved rounds, min over ranks, median\n")
    print("| all_reduce | bytes sent per rank | time (ms) | extra over the figures alone (ms) |")
    print("|---|---|---|---|")
    for size in SIZES:
        sent = allreduce_bytes(size, args.world_size)
        print(f"| {size:,} B | {sent:,} | {medians[size] * 1e3:.3f} | {(medians[size] - medians[SIZES[0]]) * 1e3:.3f} |")
    for probe in SIZES[1:]:
        est = LinkEstimator()
        est.add([(1, allreduce_bytes(SIZES[0], args.world_size), medians[SIZES[0]]),
                 (1, allreduce_bytes(probe, args.world_size), medians[probe])])
        print(f"\nwith a {probe:,} B probe the estimator reads {est.link.latency_s * 1e3:.3f} ms per collective "
              f"and {est.link.mbit:,.0f} Mbit/s")


if __name__ == "__main__":
    main()
