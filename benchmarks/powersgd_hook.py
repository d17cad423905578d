"""CPU cost of one PowerSGD exchange: gradzip's reducer beside PyTorch's ``powerSGD_hook``.

One process, a gloo group of one (the collectives cost next to nothing), the main job's default
model (3.7 M parameters) laid out as DDP's one bucket, approx rank 4, error feedback and warm
start on both sides. The two alternate on the same bucket; medians of ``--repeats`` after
``--warmup`` steps (PyTorch's hook is dense for its first 2). One thread, as each worker of a
4-worker run on this 2-core machine.

    PYTHONPATH=$PWD python benchmarks/powersgd_hook.py --repeats 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from gradzip.comm.powersgd import PowerSGDReducer
from gradzip.compressors import build
from gradzip.lab.train.config import TrainConfig
from gradzip.lab.train.model import build_model
from gradzip.testing import free_port


class Bucket:
    """The parts of DDP's ``GradBucket`` that ``powerSGD_hook`` reads (it has no Python constructor)."""

    def __init__(self, buffer: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
        self._buffer, self._params = buffer, params

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for p in self._params:
            out.append(self._buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    params = list(build_model(TrainConfig(), TrainConfig().vocab_size).parameters())[::-1]  # DDP's order
    shapes = [q.shape for q in params]
    gen = torch.Generator().manual_seed(0)
    bucket = torch.randn(sum(q.numel() for q in params), generator=gen) * 1e-3

    ours = PowerSGDReducer(build("powersgd:approx_rank=4"))
    theirs = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
    runs = {
        "gradzip powersgd:approx_rank=4": lambda step: ours.reduce(0, bucket.clone(), step=step, shapes=shapes).wait(),
        "torch powerSGD_hook (rank 4)": lambda step: torch_powersgd.powerSGD_hook(
            theirs, Bucket(bucket.clone(), params)
        ).wait(),
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.warmup + args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run(step)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    print(f"one {bucket.numel() * 4 / 1e6:.1f} MB bucket, {len(params)} tensors; medians of {args.repeats}")
    for name, values in times.items():
        print(f"{name:32s} {statistics.median(values) * 1e3:7.1f} ms  (min {min(values) * 1e3:.1f})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
