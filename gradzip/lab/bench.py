"""``gradzip bench``: codec throughput against one elementwise pass, measured side by side.

For each codec: compress + decompress throughput (GB/s of dense input), payload bytes against
the documented formula, compression ratio, relative error ``||x - D(C(x))|| / ||x||``, and
``ratio_to_elementwise``: codec throughput over the throughput of ``x.abs()`` on the same tensor
in the same run. Codec and baseline are timed alike: interleaved, each repeat allocating its
outputs afresh (``x.abs()`` a new tensor, the codec its payload and decoded tensor), medians
over the repeats, after one untimed warm-up of each, on one clock: this process's CPU time by
default (on a machine shared with other jobs it does not count the time the process waits for a
core), or wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor

from gradzip.compressors import Compressor, build, list_compressors
from gradzip.compressors.kernels import fused, native
from gradzip.compressors.spec import split_spec_list
from gradzip.lab.bench_input import bench_input, heavy_tailed_gradient

__all__ = ["heavy_tailed_gradient", "measure", "run", "split_specs"]

FIELDS = ("codec", "gbps", "payload_bytes", "formula_bytes", "compression_ratio", "rel_error", "ratio_to_elementwise")

#: the codecs benchmarked when ``--codecs`` is not given (powersgd is a two-round reducer)
DEFAULT_CODECS = (
    "fp16",
    "bf16",
    "topk:ratio=0.01",
    "dgc:ratio=0.01",
    "threshold:tau=0.01",
    "randomk:ratio=0.01",
    "qsgd:bits=4,bucket=512",
    "terngrad",
    "uniform:bits=8",
    "uniform:bits=4",
    "natural",
    "signsgd",
    "efsignsgd",
    "topk:ratio=0.01+uniform:bits=8",
)


def split_specs(text: str) -> list[str]:
    """``--codecs`` split by the list rule of every option (:func:`gradzip.compressors.spec.split_spec_list`)."""
    return split_spec_list(text, name="--codecs")


def _median_s(timings: list[float]) -> float:
    return statistics.median(timings)


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def measure(codec: Compressor, x: Tensor, *, repeats: int, clock: str = "cpu") -> dict:
    """Time ``codec`` against ``x.abs()``, interleaved, and return one result row."""
    dense_bytes = x.numel() * x.element_size()
    compiled_before = sum(fused.compile_seconds.values())
    first_start = time.perf_counter()
    payload = codec.compress(x, step=0, key=0)
    decoded = codec.decompress(payload, like=x)
    first_call_s = time.perf_counter() - first_start
    compile_s = sum(fused.compile_seconds.values()) - compiled_before
    rel_error = float((x.double() - decoded.double()).norm() / x.double().norm().clamp(min=1e-300))
    payload_bytes = payload.nbytes
    del payload, decoded
    x.abs()

    def run_codec(step: int) -> Callable[[], object]:
        return lambda: codec.decompress(codec.compress(x, step=step, key=0), like=x)

    timer = CLOCKS[clock]
    codec_s, base_s = [], []
    for step in range(1, repeats + 1):
        base_s.append(_timed(x.abs, timer))
        codec_s.append(_timed(run_codec(step), timer))
    gbps = dense_bytes / _median_s(codec_s) / 1e9
    base_gbps = dense_bytes / _median_s(base_s) / 1e9
    return {
        "codec": codec.spec,
        "gbps": gbps,
        "payload_bytes": payload_bytes,
        "formula_bytes": codec.payload_nbytes(x.numel(), x.dtype),
        "compression_ratio": dense_bytes / payload_bytes,
        "rel_error": rel_error,
        "ratio_to_elementwise": gbps / base_gbps,
        "elementwise_gbps": base_gbps,
        "first_call_s": first_call_s,
        "compile_s": compile_s,
    }


def _timed(fn: Callable[[], object], timer: Callable[[], float]) -> float:
    start = timer()
    result = fn()
    elapsed = timer() - start
    del result
    return elapsed


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.size_mb) and 0 < args.size_mb <= 4096):
        raise ValueError(f"--size-mb must be in (0, 4096]; got {args.size_mb}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1; got {args.repeats}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1; got {args.threads}")
    specs = split_specs(args.codecs) if args.codecs else list(DEFAULT_CODECS)
    codecs = [build(spec) for spec in specs]
    for codec in codecs:
        if codec.multi_round:
            raise ValueError(f"{codec.name} is a multi-round reducer; bench times single-round codecs")
    torch.set_num_threads(args.threads)
    numel = int(args.size_mb * (1 << 20)) // 4
    x, source = bench_input(numel, source=args.input, checkpoint=args.checkpoint)
    rows = [measure(codec, x, repeats=args.repeats, clock=args.clock) for codec in codecs]
    note = (
        f"{source}, {numel:,} fp32 elements ({numel * 4 / 1e6:.1f} MB), {args.threads} thread(s), "
        f"{args.clock} clock; medians of {args.repeats} interleaved repeats; baseline x.abs(); codec "
        "and baseline both allocate their outputs each repeat; kernels "
        + ("compiled (first call of each codec, compilation included, untimed: see 'first s')" if fused.enabled() else "eager (GRADZIP_COMPILE=0)")
        + f"; {native.status()}"
    )
    if args.json:
        print(json.dumps([{k: row[k] for k in FIELDS} for row in rows], indent=2))
        print(note, file=sys.stderr)
        return 0
    print(note)
    header = (
        f"{'codec':<34} {'GB/s':>6} {'abs GB/s':>8} {'vs abs':>7} {'payload B':>11} {'formula B':>11} "
        f"{'ratio':>7} {'rel err':>8} {'first s':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['codec']:<34} {r['gbps']:>6.2f} {r['elementwise_gbps']:>8.2f} {r['ratio_to_elementwise']:>7.2f} "
            f"{r['payload_bytes']:>11,} "
            f"{r['formula_bytes']:>11,} {r['compression_ratio']:>6.1f}x {r['rel_error']:>8.4f} {r['first_call_s']:>8.1f}"
        )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="codec throughput, payload and error against one elementwise pass")
    p.add_argument("--size-mb", type=float, default=25.0, help="tensor size in MB of fp32 (default 25)")
    p.add_argument(
        "--codecs",
        default=None,
        help=f"comma-separated specs (default: a set covering {', '.join(n for n in list_compressors() if n not in ('none', 'powersgd'))})",
    )
    p.add_argument("--repeats", type=int, default=9, help="timed repeats per codec; medians are reported (default 9)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: this process's CPU time, robust to other jobs on the machine (default); wall: elapsed time",
    )
    p.add_argument(
        "--input",
        choices=("auto", "model", "synthetic"),
        default="auto",
        help="model: a gradient of the main job's model on its corpus (needs the tokenizer cache that gradzip train "
        "fills); synthetic: heavy-tailed; auto (default): model when available, else synthetic",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="a main-job run or checkpoint folder: take the gradient of its trained model (with --input model/auto)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list with the fields " + ", ".join(FIELDS))
    p.set_defaults(func=run)
