"""Cost of the quality checks (``--monitor-every``) on the main job's real gradient bucket.

Side by side in one process: the same reducer averages the same GPT-2 gradient bucket (the
main job's default model, 3.7 M parameters, one 14.9 MB bucket) with quality figures on and off,
alternating, and the median extra seconds of a checked step are set against the model's forward +
backward time (compute alone, the smallest a training step can be, so the percentage is an upper
bound). At ``--monitor-every N`` one step in N pays the extra.

    PYTHONPATH=$PWD python benchmarks/monitor_overhead.py --repeats 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from gradzip.comm import make_reducer
from gradzip.lab.train.config import TrainConfig
from gradzip.lab.train.data import Corpus, batch_generator, sample_batch
from gradzip.lab.train.model import build_model
from gradzip.metrics import StepMetrics
from gradzip.testing import free_port

CODECS = ["none", "fp16", "powersgd:approx_rank=4", "topk:ratio=0.01"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9, help="pairs of (checked, unchecked) steps per codec")
    parser.add_argument("--monitor-every", type=int, default=10)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)

    cfg = TrainConfig()
    corpus = Corpus.load(None, cfg.vocab_size)
    model = build_model(cfg, corpus.vocab_size)
    gen = batch_generator(0, 0)
    compute = []
    for _ in range(5):
        x, y = sample_batch(corpus.train, cfg.batch_size, cfg.seq_len, gen)
        model.zero_grad()
        start = time.perf_counter()
        model(input_ids=x, labels=y).loss.backward()
        compute.append(time.perf_counter() - start)
    compute_s = statistics.median(compute)
    params = [p for p in model.parameters() if p.grad is not None]
    bucket = torch.cat([p.grad.reshape(-1) for p in params])
    shapes = [p.grad.shape for p in params]

    print(f"bucket {bucket.numel():,} fp32 elements; forward + backward (1 thread) {compute_s * 1e3:.0f} ms\n")
    print(f"| codec | reduce, unchecked (ms) | reduce, checked (ms) | extra per check (ms) | "
          f"overhead at --monitor-every {args.monitor_every} |")
    print("|---|---|---|---|---|")
    for spec in CODECS:
        metrics = StepMetrics(monitor_every=1)
        reducer = make_reducer(spec, metrics=metrics)
        reducer.reduce(0, bucket, step=0, shapes=shapes).wait()  # warm-up: allocations, factors
        metrics.pop()
        on, off = [], []
        for i in range(2 * args.repeats):
            checked = i % 2 == 0
            metrics.monitor_every = 1 if checked else 0
            start = time.perf_counter()
            reducer.reduce(0, bucket, step=i + 1, shapes=shapes).wait()
            (on if checked else off).append(time.perf_counter() - start)
            metrics.pop()
        extra = max(0.0, statistics.median(on) - statistics.median(off))
        share = extra / args.monitor_every / compute_s
        print(f"| {spec} | {statistics.median(off) * 1e3:.1f} | {statistics.median(on) * 1e3:.1f} | "
              f"{extra * 1e3:.1f} | {share:.2%} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
