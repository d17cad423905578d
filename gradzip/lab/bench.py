"""``gradzip bench``: codec throughput against one elementwise pass, measured side by side.

For each codec: compress + decompress throughput (GB/s of dense input), payload bytes against
the documented formula, compression ratio, relative error ``||x - D(C(x))|| / ||x||``, and
``ratio_to_elementwise``: codec throughput over the throughput of ``x.abs()`` on the same tensor
in the same run. Codec and baseline are timed alike: interleaved, each repeat allocating its
outputs afresh (``x.abs()`` a new tensor, the codec its payload and decoded tensor), medians
over the repeats, after one untimed warm-up of each, on one clock: this process's CPU time by
default (on a machine shared with other jobs it does not count the time the process waits for a
core), or wall time.

Codecs that bring their own reducer (PowerSGD, SEPARATE, Radius, the count sketch, int8) are timed
through it: one ``reduce`` of the tensor as a DDP bucket (a ``rows x 1024`` matrix, and the
remainder flat) over a gloo process group of this process alone, whose collectives copy, so the
time is their encode, decode and error feedback. Their payload and relative error are those of the
second step (Radius's first is its dense refresh of the ranges), after one step of error
feedback; their formula is the codec's own for the bucket's shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradzip.compressors import Compressor, Payload, build
from gradzip.compressors.kernels import fused, native
from gradzip.compressors.spec import split_spec_list
from gradzip.compressors.values import check_int
from gradzip.lab.bench_input import bench_input, heavy_tailed_gradient
from gradzip.lab.options import codec_only, list_entry

__all__ = ["heavy_tailed_gradient", "measure", "run", "split_specs"]

FIELDS = ("codec", "gbps", "payload_bytes", "formula_bytes", "compression_ratio", "rel_error", "ratio_to_elementwise")

#: the codecs benchmarked when ``--codecs`` is not given
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
    "powersgd:approx_rank=4",
    "powersgd:approx_rank=4,factor_bits=8",
    "separate",
    "radius",
    "countsketch",
    "int8",
)

#: columns of the matrix a codec with its own reducer sees the tensor as
MATRIX_COLS = 1024


def split_specs(text: str) -> list[str]:
    """``--codecs`` split by the list rule of every option (:func:`gradzip.compressors.spec.split_spec_list`)."""
    return split_spec_list(text, name="--codecs")


def _median_s(timings: list[float]) -> float:
    return statistics.median(timings)


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def measure(codec: Compressor, x: Tensor, *, repeats: int, clock: str = "cpu") -> dict:
    """Time ``codec`` against ``x.abs()``, interleaved, and return one result row."""
    def encode_decode() -> tuple[Payload, Tensor]:
        payload = codec.compress(x, step=0, key=0)
        return payload, codec.decompress(payload, like=x)

    (payload, decoded), first_call_s, compile_s = _first_call(encode_decode)
    rel_error = _rel_error(x, decoded)
    payload_bytes = payload.nbytes
    del payload, decoded
    x.abs()

    def run_codec(step: int) -> Callable[[], object]:
        return lambda: codec.decompress(codec.compress(x, step=step, key=0), like=x)

    return _row(codec, x, run_codec, range(1, repeats + 1), clock, payload_bytes=payload_bytes,
                formula_bytes=codec.payload_nbytes(x.numel(), x.dtype), rel_error=rel_error,
                first_call_s=first_call_s, compile_s=compile_s)


def _row(codec: Compressor, x: Tensor, run: Callable[[int], Callable[[], object]], steps: range, clock: str,
         **figures: float) -> dict:
    """One result row: ``run(step)`` timed against ``x.abs()`` for each of ``steps``, interleaved,
    beside the ``figures`` measured untimed (payload, formula, error, first call)."""
    timer = CLOCKS[clock]
    codec_s, base_s = [], []
    for step in steps:
        base_s.append(_timed(x.abs, timer))
        codec_s.append(_timed(run(step), timer))
    dense_bytes = x.numel() * x.element_size()
    gbps = dense_bytes / _median_s(codec_s) / 1e9
    base_gbps = dense_bytes / _median_s(base_s) / 1e9
    return {
        "codec": codec.spec,
        "gbps": gbps,
        "payload_bytes": figures["payload_bytes"],
        "formula_bytes": figures["formula_bytes"],
        "compression_ratio": dense_bytes / figures["payload_bytes"],
        "rel_error": figures["rel_error"],
        "ratio_to_elementwise": gbps / base_gbps,
        "elementwise_gbps": base_gbps,
        "first_call_s": figures["first_call_s"],
        "compile_s": figures["compile_s"],
    }


def bucket_shapes(numel: int) -> list[torch.Size]:
    """The gradients a flat tensor of ``numel`` elements is read as by a codec with its own
    reducer: one ``numel // 1024 x 1024`` matrix, then the remainder as a flat tensor."""
    rows = numel // MATRIX_COLS
    shapes = [torch.Size((rows, MATRIX_COLS))] if rows else []
    if numel - rows * MATRIX_COLS:
        shapes.append(torch.Size((numel - rows * MATRIX_COLS,)))
    return shapes


def formula_nbytes(codec: Compressor, shapes: list[torch.Size], dtype: torch.dtype) -> int:
    """The documented payload of a bucket of ``shapes``: per matrix for the low-rank codecs, of the
    whole flat bucket for the others."""
    if hasattr(codec, "matrix_payload_nbytes"):
        return sum(codec.matrix_payload_nbytes(shape, dtype) for shape in shapes)
    return codec.payload_nbytes(sum(shape.numel() for shape in shapes), dtype)


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo group of this process alone for the reducers (see the module docstring), unless a
    default group exists already; the group made here is destroyed on leaving."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if made:
            dist.destroy_process_group()


def measure_reducer(codec: Compressor, x: Tensor, *, repeats: int, clock: str = "cpu") -> dict:
    """Time one ``reduce`` of ``x`` by ``codec``'s own reducer against ``x.abs()``, interleaved,
    and return one result row (see the module docstring); inside :func:`one_rank_group`."""
    from gradzip.comm import make_reducer
    from gradzip.metrics import StepMetrics

    assert dist.is_initialized() and dist.get_world_size() == 1, "measure_reducer runs inside one_rank_group()"
    shapes = bucket_shapes(x.numel())
    reducer = make_reducer(codec, metrics=StepMetrics())

    def run_reducer(step: int) -> Callable[[], object]:
        def once() -> Tensor:
            mean = reducer.reduce(0, x, step=step, shapes=shapes).wait()
            reducer.metrics.pop()  # one step's figures at a time
            return mean

        return once

    _, first_call_s, compile_s = _first_call(run_reducer(0))
    decoded = reducer.reduce(0, x, step=1, shapes=shapes).wait()
    payload_bytes = reducer.metrics.pop()["payload_bytes"]
    rel_error = _rel_error(x, decoded)
    del decoded
    return _row(codec, x, run_reducer, range(2, repeats + 2), clock, payload_bytes=payload_bytes,
                formula_bytes=formula_nbytes(codec, shapes, x.dtype), rel_error=rel_error,
                first_call_s=first_call_s, compile_s=compile_s)


def _first_call(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``fn()``'s result, its wall seconds, and the kernel compilation seconds they include."""
    compiled_before = sum(fused.compile_seconds.values())
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start, sum(fused.compile_seconds.values()) - compiled_before


def _rel_error(x: Tensor, decoded: Tensor) -> float:
    """``||x - decoded|| / ||x||``, in float64."""
    return float((x.double() - decoded.double()).norm() / x.double().norm().clamp(min=1e-300))


def _timed(fn: Callable[[], object], timer: Callable[[], float]) -> float:
    start = timer()
    result = fn()
    elapsed = timer() - start
    del result
    return elapsed


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.size_mb) and 0 < args.size_mb <= 4096):
        raise ValueError(f"--size-mb must be in (0, 4096]; got {args.size_mb}")
    check_int(args.repeats, name="--repeats", low=1, high=10**6)
    check_int(args.threads, name="--threads", low=1, high=1024)
    specs = split_specs(args.codecs) if args.codecs is not None else list(DEFAULT_CODECS)
    codecs = [list_entry("--codecs", spec, lambda s: build(codec_only(s, "bench"))) for spec in specs]
    torch.set_num_threads(args.threads)
    numel = int(args.size_mb * (1 << 20)) // 4
    x, source = bench_input(numel, source=args.input, checkpoint=args.checkpoint)
    with one_rank_group() if any(codec.multi_round for codec in codecs) else contextlib.nullcontext():
        rows = [(measure_reducer if codec.multi_round else measure)(codec, x, repeats=args.repeats, clock=args.clock)
                for codec in codecs]
    note = (
        f"{source}, {numel:,} fp32 elements ({numel * 4 / 2**20:.1f} MiB), {args.threads} thread(s), "
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
    p = sub.add_parser(
        "bench", help="codec throughput, payload and error against one elementwise pass",
        description="Encode and decode each codec on one rank over a tensor of --size-mb: the main job's gradient "
        "where its token ids are cached (or a trained run's with --checkpoint), else a heavy-tailed synthetic "
        "one. Prints the encode + decode throughput (medians of interleaved repeats) beside that of one elementwise "
        "pass (x.abs()) over the same tensor, the payload bytes against the formula's, and the relative error of the decode (for unbiased random projections such "
        "as separate it exceeds 1: they are right on average, not per draw).",
    )
    p.add_argument("--size-mb", type=float, default=25.0, help="tensor size in MiB (2^20 bytes) of fp32 (default 25)")
    p.add_argument(
        "--codecs",
        default=None,
        help=f"comma-separated specs (default: {','.join(DEFAULT_CODECS)}); powersgd, separate, radius, "
        f"countsketch and int8 go through their own reducer, the tensor read as a rows x {MATRIX_COLS} matrix",
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
