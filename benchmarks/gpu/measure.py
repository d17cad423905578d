"""Codec and DDP-hook speed on one GPU: what ``benchmarks/gpu/run.sh`` measures.

Codecs: every registered codec (default parameters) encodes and decodes one gradient of
``--numel`` elements (100 M) in each of ``--dtypes`` (fp32, bf16), beside one elementwise pass
(``x.abs()``) and a device copy (``x.clone()``, the memory-bandwidth limit). All of them allocate
their outputs, as the reducers do. Rows are interleaved (every row once, then every row again,
``--repeats`` times) and timed with CUDA events; the median counts. Speed is GB/s of input
(``numel * itemsize / seconds``). PowerSGD and SEPARATE, which work on matrices in their own
reducers, are timed through their arithmetic on the gradient viewed as a square-ish matrix
(PowerSGD: ``P = M Q``, QR of ``P``, ``Q = M^T P``; decode ``P Q^T``; SEPARATE: ``M A`` and back).
Each row runs once untimed first (kernels compile then; the seconds are reported).

Hooks: DDP at world size 1 (NCCL) on a stack of bias-free linear layers in buckets of
``--bucket-mb``; the backward pass is timed with each hook, interleaved, beside PyTorch's
``noop_hook`` (no communication at all): a hook's cost per bucket is its backward time less
noop's, divided by the buckets. PyTorch's ``allreduce_hook``, ``fp16_compress_hook`` and
``powerSGD_hook`` (rank 4) run beside gradzip's hook with every codec.

Writes ``<device>.json`` (format ``gradzip-gpu-bench/1``, what ``gradzip simulate`` reads) and
``<device>.md`` into ``--out`` (default: ``$OUT`` when set, else ``benchmarks/results/gpu``),
after each section, so that a run cut short keeps what it measured. ``--check`` runs the whole
thing on the CPU with gloo, tiny sizes and one repeat into a temporary folder, and reads the
JSON back as ``gradzip simulate`` does: the CPU-side check that CI runs.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # measure this checkout, not an installed copy

from gradzip.compressors import REGISTRY, build  # noqa: E402
from gradzip.compressors.kernels import fused  # noqa: E402

FORMAT = "gradzip-gpu-bench/1"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: extra specs timed beside the registry's defaults
EXTRA_SPECS = ("uniform:rounding=stochastic",)
#: a codec at or above this fraction of one elementwise pass's speed meets the bar
BAR = 0.5
#: seconds after which ``--check`` prints every thread's stack and exits (it takes about 10)
CHECK_LIMIT_S = 240


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=100_000_000, help="elements of the codec benchmark's gradient (default 100 M)")
    p.add_argument("--dtypes", default="fp32,bf16", help="gradient dtypes of the codec benchmark, of fp32, bf16, fp16")
    p.add_argument("--codecs", default="all", help="comma-separated specs, or 'all' (every registered codec)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each row; the median counts (default 5)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap of the hook benchmark, MiB (default 25)")
    p.add_argument("--layers", type=int, default=4, help="linear layers of the hook benchmark's model (default 4)")
    p.add_argument("--width", type=int, default=4096, help="width of those layers (default 4096: 64 MiB of fp32 each)")
    p.add_argument("--codec-budget-s", type=float, default=170.0, help="seconds for the codec rows; later repeats are skipped")
    p.add_argument("--hook-budget-s", type=float, default=100.0, help="seconds for the hook rows; later repeats are skipped")
    p.add_argument("--skip-hooks", action="store_true", help="measure the codecs only")
    p.add_argument("--out", default=None, help="folder for the JSON and Markdown (default $OUT, else benchmarks/results/gpu)")
    p.add_argument(
        "--check", action="store_true", help="CPU-side check: gloo, tiny sizes, fp32, one repeat, a temporary folder"
    )
    args = p.parse_args(argv)
    if args.numel < 4096:
        p.error(f"--numel must be at least 4096; got {args.numel}")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1; got {args.repeats}")
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        p.error(f"--dtypes takes {', '.join(DTYPES)}; got {', '.join(unknown)}")
    if args.check:
        args.numel, args.repeats, args.layers, args.width, args.bucket_mb = (1 << 14) + 37, 1, 2, 64, 0.01
        args.dtypes = "fp32"
    return args


# -- timing ---------------------------------------------------------------------------------


class Timer:
    """Seconds of GPU work between marks (CUDA events), or of wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def codec_rows(specs: list[str], x: torch.Tensor) -> dict[str, tuple[Callable, Callable]]:
    """``spec -> (encode, decode)``: ``encode()`` returns what ``decode(it)`` takes."""
    rows: dict[str, tuple[Callable, Callable]] = {
        "abs": (lambda: x.abs(), lambda _: None),
        "copy": (lambda: x.clone(), lambda _: None),
    }
    for spec in specs:
        codec = build(spec)
        if codec.name == "powersgd":
            rows[spec] = _powersgd_fns(codec, x)
        elif codec.name == "separate":
            rows[spec] = _separate_fns(codec, x)
        elif codec.name == "radius":
            rows[spec] = _radius_fns(codec, x)
        else:
            rows[spec] = (
                lambda codec=codec: codec.compress(x, step=1, key="bench"),
                lambda payload, codec=codec: codec.decompress(payload, like=x),
            )
    return rows


def _matrix(x: torch.Tensor) -> torch.Tensor:
    """``x`` (its first ``n * (numel // n)`` elements) as an ``n x m`` matrix, ``n`` about sqrt(numel)."""
    n = 1 << (x.numel().bit_length() // 2)
    return x[: n * (x.numel() // n)].view(n, -1)


def _powersgd_fns(codec, x: torch.Tensor):
    from gradzip.comm.powersgd import orthogonalize, product

    matrix = _matrix(x)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(matrix.shape[1], codec.approx_rank, generator=gen).to(x.device)

    def encode():
        m = matrix.float()  # the reducer works on the compensated gradient in fp32
        p = orthogonalize(product(m, q))
        return p, product(m.T, p)

    def decode(factors):
        p, q_new = factors
        return (p @ q_new.T).to(x.dtype)

    return encode, decode


def _separate_fns(codec, x: torch.Tensor):
    matrix = _matrix(x)

    def encode():
        return codec.encode(matrix, step=1, key="bench")

    def decode(payload):
        return codec.decode(payload, matrix.shape[1], step=1, key="bench", out=torch.empty_like(matrix))

    return encode, decode


def _radius_fns(codec, x: torch.Tensor):
    """A step between refreshes: gather the kept ranges, scatter them back. The ranges are chosen
    once, from ``x`` standing in for the all-reduced mean (a refresh, once per ``period`` steps,
    is not timed)."""
    index = codec.covered(codec.select(x), x.numel())

    def encode():
        return x.index_select(0, index)

    def decode(values):
        return torch.zeros_like(x).index_copy_(0, index, values)

    return encode, decode


def measure_codecs(args, device: torch.device, specs: list[str], report: dict) -> None:
    """The codec section: fills ``report["baselines"]`` and ``report["codecs"]``."""
    timer = Timer(device)
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(args.numel, generator=gen, device=device).to(dtype)
        rows = codec_rows(specs, x)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
        status: dict[str, str] = {}
        compile_s: dict[str, float] = {}
        deadline = time.monotonic() + args.codec_budget_s / len(args.dtypes.split(","))
        for name, (encode, decode) in rows.items():  # untimed first run: compiles, allocates
            if time.monotonic() > deadline:
                status[name] = "skipped: out of time"
                continue
            before = sum(fused.compile_seconds.values())
            try:
                start = time.perf_counter()
                decode(encode())
                timer.sync()
                compile_s[name] = round(time.perf_counter() - start, 3) if sum(fused.compile_seconds.values()) > before else 0.0
            except Exception as exc:  # noqa: BLE001 - one codec's failure is a row of the table
                status[name] = f"failed: {type(exc).__name__}: {exc}"[:300]
        for _ in range(args.repeats):
            for name, (encode, decode) in rows.items():
                if name in status or time.monotonic() > deadline:
                    continue
                timer.sync()
                t0 = timer.mark()
                payload = encode()
                t1 = timer.mark()
                out = decode(payload)
                t2 = timer.mark()
                times[name].append((timer.seconds(t0, t1), timer.seconds(t1, t2)))
                del payload, out
        nbytes = x.numel() * x.element_size()
        base = {name: statistics.median(sum(t) for t in times[name]) if times[name] else None for name in ("abs", "copy")}
        report["baselines"].append({
            "dtype": dtype_name, "abs_s": base["abs"], "copy_s": base["copy"],
            "abs_gbps": nbytes / base["abs"] / 1e9 if base["abs"] else None,
            "copy_gbps": nbytes / base["copy"] / 1e9 if base["copy"] else None,
        })
        for name in rows:
            if name in ("abs", "copy"):
                continue
            row = {"codec": build(name).name, "spec": build(name).spec, "dtype": dtype_name, "repeats": len(times[name])}
            if times[name]:
                enc = statistics.median(t[0] for t in times[name])
                dec = statistics.median(t[1] for t in times[name])
                total = statistics.median(sum(t) for t in times[name])
                row.update(
                    encode_s=enc, decode_s=dec, encode_decode_s=total, gbps=nbytes / total / 1e9,
                    vs_abs=base["abs"] / total if base["abs"] else None,
                    vs_copy=base["copy"] / total if base["copy"] else None,
                    first_run_s=compile_s.get(name), host_reads=build(name).host_reads,
                )
                row["meets_bar"] = row["vs_abs"] is not None and row["vs_abs"] >= BAR
            row["status"] = status.get(name, "ok" if times[name] else "skipped: out of time")
            report["codecs"].append(row)
        del x, rows


# -- hooks ----------------------------------------------------------------------------------


def _hook_states() -> dict[str, tuple[object, Callable]]:
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    import gradzip

    hooks: dict[str, tuple[object, Callable]] = {
        "torch:noop": (None, debugging_hooks.noop_hook),
        "torch:allreduce": (None, default_hooks.allreduce_hook),
        "torch:fp16": (None, default_hooks.fp16_compress_hook),
        "torch:powersgd:rank=4": (
            torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2),
            torch_powersgd.powerSGD_hook,
        ),
    }
    for name in sorted(REGISTRY):
        hooks[f"gradzip:{name}"] = (gradzip.CompressionState(name), gradzip.compression_hook)
    return hooks


#: hooks that get one bucket on gloo: PyTorch's ``powerSGD_hook`` waits on its own collectives
#: inside future callbacks, which run on gloo's worker threads; with several buckets in flight
#: those threads all end up waiting and the backward pass never returns (NCCL is unaffected)
GLOO_ONE_BUCKET = frozenset({"torch:powersgd:rank=4"})


def measure_hooks(args, device: torch.device, report: dict) -> None:
    """The hook section: fills ``report["hooks"]``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    timer = Timer(device)
    deadline = time.monotonic() + args.hook_budget_s
    gen = torch.Generator().manual_seed(0)
    batch = torch.randn(16, args.width, generator=gen).to(device)
    models: dict[str, DDP] = {}
    one_bucket = {name for name in GLOO_ONE_BUCKET if device.type != "cuda"}
    hooks = _hook_states()
    for name, (state, hook) in hooks.items():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            layers = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
        cap = 1e6 if name in one_bucket else args.bucket_mb
        ddp = DDP(layers.to(device), device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cap)
        ddp.register_comm_hook(state, hook)
        models[name] = ddp
    status: dict[str, str] = {}
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(3):  # DDP rebuilds its buckets after the first step; powerSGD_hook starts at the third
        for name, ddp in models.items():
            if name in status:
                continue
            try:
                ddp.zero_grad(set_to_none=False)
                ddp(batch).square().mean().backward()
            except Exception as exc:  # noqa: BLE001
                status[name] = f"failed: {type(exc).__name__}: {exc}"[:300]
    # gradzip's metrics key each bucket of a pass by its index: the buckets of one pass
    buckets = len(hooks["gradzip:none"][0].metrics.pop()["buckets"])
    for _ in range(args.repeats):
        for name, ddp in models.items():
            if name in status or time.monotonic() > deadline:
                continue
            ddp.zero_grad(set_to_none=False)
            loss = ddp(batch).square().mean()
            timer.sync()
            t0 = timer.mark()
            loss.backward()
            t1 = timer.mark()
            times[name].append(timer.seconds(t0, t1))
    noop = statistics.median(times["torch:noop"]) if times["torch:noop"] else None
    for name in models:
        row = {"hook": name, "bucket_mb": args.bucket_mb, "buckets": buckets, "repeats": len(times[name])}
        if times[name]:
            backward = statistics.median(times[name])
            row["backward_s"] = backward
            if name in one_bucket:
                row["bucket_mb"], row["buckets"] = None, 1
                row["note"] = "one bucket on gloo (see GLOO_ONE_BUCKET): no per-bucket figure"
            elif noop is not None and buckets:
                row["per_bucket_s"] = (backward - noop) / buckets
        row["status"] = status.get(name, "ok" if times[name] else "skipped: out of time")
        report["hooks"].append(row)


# -- output ---------------------------------------------------------------------------------


def device_slug(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-check"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def markdown(report: dict) -> str:
    dev = report["device"]
    lines = [
        f"# Codec and hook speed on {dev['name']}",
        "",
        f"torch {dev['torch']}, CUDA {dev['cuda']}, kernels {'compiled' if dev['compiled'] else 'eager'}; "
        f"{report['numel']:,} elements, median of up to {report['repeats']} interleaved runs (CUDA events). "
        f"GB/s of input; `vs abs`: the codec's speed over one elementwise pass (`x.abs()`), the bar is {BAR:g}.",
        "",
        "| dtype | x.abs() GB/s | copy GB/s |",
        "|---|---:|---:|",
    ]
    for b in report["baselines"]:
        lines.append(f"| {b['dtype']} | {_num(b['abs_gbps'])} | {_num(b['copy_gbps'])} |")
    lines += [
        "",
        "| codec | dtype | encode ms | decode ms | GB/s | vs abs | vs copy | meets bar | reads on host | first run s | status |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for r in report["codecs"]:
        lines.append(
            f"| `{r['spec']}` | {r['dtype']} | {_ms(r.get('encode_s'))} | {_ms(r.get('decode_s'))} | {_num(r.get('gbps'))} "
            f"| {_num(r.get('vs_abs'), 2)} | {_num(r.get('vs_copy'), 2)} | {'yes' if r.get('meets_bar') else 'no'} "
            f"| {'yes' if r.get('host_reads') else 'no'} | {_num(r.get('first_run_s'), 1)} | {r['status']} |"
        )
    if report["hooks"]:
        lines += [
            "",
            f"DDP at world size 1, {report['hooks'][0]['buckets']} buckets of {report['hooks'][0]['bucket_mb']:g} MiB; "
            "per bucket: backward time less `torch:noop`'s, over the buckets.",
            "",
            "| hook | backward ms | per bucket ms | status |",
            "|---|---:|---:|---|",
        ]
        for h in report["hooks"]:
            per = h.get("per_bucket_s")
            lines.append(
                f"| `{h['hook']}` | {_num(h['backward_s'] * 1e3) if h.get('backward_s') else '-'} "
                f"| {_num(per * 1e3, 3) if per is not None else '-'} | {h['status']} |"
            )
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else _num(seconds * 1e3, 3)


def _num(value, digits: int = 1) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:,.{digits}f}"


def write(report: dict, out: Path, slug: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{slug}.json", out / f"{slug}.md"
    json_path.write_text(json.dumps(report, indent=2))
    md_path.write_text(markdown(report))
    return json_path, md_path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:
        # a hang in CI should say where: every thread's stack, then exit 1
        faulthandler.dump_traceback_later(CHECK_LIMIT_S, exit=True)
        device = torch.device("cpu")
        os.environ.setdefault(fused.ENV, "0")  # the check runs the pipeline, not the compiler
    else:
        if not torch.cuda.is_available():
            print("measure.py: no CUDA device; use --check for the CPU-side check", file=sys.stderr)
            return 2
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    out = Path(args.out or os.environ.get("OUT") or ROOT / "benchmarks" / "results" / "gpu")
    if args.check and args.out is None:
        out = Path(tempfile.mkdtemp(prefix="gradzip-gpu-check-"))
    specs = sorted(REGISTRY) + list(EXTRA_SPECS) if args.codecs == "all" else [s.strip() for s in args.codecs.split(",")]
    report = {
        "format": FORMAT,
        "device": {
            "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (check)",
            "torch": torch.__version__, "cuda": torch.version.cuda, "compiled": fused.enabled(),
        },
        "numel": args.numel, "repeats": args.repeats, "bar": BAR,
        "baselines": [], "codecs": [], "hooks": [],
    }
    slug = device_slug(device)
    measure_codecs(args, device, specs, report)
    paths = write(report, out, slug)
    if not args.skip_hooks:
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        try:
            measure_hooks(args, device, report)
        finally:
            dist.destroy_process_group()
        paths = write(report, out, slug)
    report["compile_seconds"] = dict(fused.compile_seconds)
    paths = write(report, out, slug)
    if args.check:
        from gradzip.lab.simulate.gpu_speeds import load_results

        [(_, data)] = load_results([paths[0]])  # as gradzip simulate reads it
        bad = [r for r in data["codecs"] if r["status"] != "ok"] + [h for h in data["hooks"] if h["status"] != "ok"]
        if bad or not data["codecs"] or (not args.skip_hooks and not data["hooks"]):
            print(f"measure.py --check: rows not measured: {bad}", file=sys.stderr)
            return 1
    print(markdown(report))
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
