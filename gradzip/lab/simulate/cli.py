"""``gradzip simulate``: the projection table and plot, or ``--calibrate`` against measured runs."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from gradzip.compressors.spec import split_spec_list
from gradzip.compressors.values import FLOAT_TEXT, INT_TEXT, check_int, check_number, shown
from gradzip.lab.cli import writable_folder
from gradzip.lab.options import codec_only, list_entry
from gradzip.lab.simulate.calibrate import (
    DEFAULT_LATENCY_US,
    TCP_GOODPUT,
    CalibrationRow,
    calibrate,
    fit_link_efficiency,
    fit_link_efficiency_on_comm,
    parse_rate_bits,
)
from gradzip.lab.simulate.collectives import ALGORITHMS
from gradzip.lab.simulate.exchange import COLLECTIVE_CHOICES, Method
from gradzip.lab.simulate.gpu_speeds import default_folders, load_results, measured_speeds
from gradzip.lab.simulate.presets import CLUSTERS, GBYTE, MODELS, get_cluster, model_shapes
from gradzip.lab.simulate.project import ProjectionRow, Scenario, project, state_note
from gradzip.lab.simulate.step import STRATEGIES, CodecSpeed

#: the largest GPU count the model takes: counts stay exact in its float64 arithmetic, and every
#: figure is computed from the count in constant time (no per-GPU work)
MAX_GPUS = 2**53
#: the most tokens per GPU per step the model takes (as exact in float64 as the GPU count)
MAX_TOKENS_PER_GPU = 2**53
#: options that only the calibration reads, and those that only the projection reads
CALIBRATION_ONLY = ("bandwidth", "latency_us", "link_efficiency")
PROJECTION_ONLY = (
    "model", "gpus", "cluster", "compressors", "strategy", "tokens_per_gpu", "mfu", "compute_s", "codec_gbps", "gpu_speeds",
    "grad_dtype", "bucket_cap_mb", "algorithm", "collective", "price_per_gpu_hour", "sweep", "out", "no_plot",
)
DEFAULT_COMPRESSORS = "none,fp16,powersgd:approx_rank=4,onebit-adam"
DEFAULT_SWEEP = "8,16,32,64,128,256,512,1024,2048,4096"
GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def split_specs(text: str) -> list[str]:
    """``--compressors`` split by the list rule of every option (:func:`gradzip.compressors.spec.split_spec_list`)."""
    return split_spec_list(text, name="--compressors")


def _positive_ints(text: str, name: str, high: int) -> list[int]:
    items = [v.strip() for v in text.split(",") if v.strip()]
    if not items or not all(INT_TEXT.fullmatch(v) for v in items):
        raise ValueError(f"{name} must be comma-separated integers in [1, {high}]; got {shown(text)}")
    values = [int(v) for v in items]
    if min(values) < 1 or max(values) > high:
        raise ValueError(f"{name} must be comma-separated integers in [1, {high}]; got {shown(text)}")
    return values


def check_options(args: argparse.Namespace) -> None:
    """Check every option before any work, whether or not this run reads it; refuse the
    calibration's options without ``--calibrate`` (the projection takes its links from
    ``--cluster``: they would change nothing), and the projection's options with it (a
    ``gradzip compare`` folder records its own model, codecs and world size).

    Raises:
        ValueError: naming the option and its allowed range.
    """
    check_int(args.gpus, name="--gpus", low=1, high=MAX_GPUS)
    _positive_ints(args.sweep, "--sweep", MAX_GPUS)
    check_int(args.tokens_per_gpu, name="--tokens-per-gpu", low=1, high=MAX_TOKENS_PER_GPU)
    check_number(args.mfu, name="--mfu", low=0, high=1, low_open=True)
    if args.compute_s is not None:
        check_number(args.compute_s, name="--compute-s", low=0, low_open=True)
    check_number(args.price_per_gpu_hour, name="--price-per-gpu-hour", low=0)
    check_number(args.bucket_cap_mb, name="--bucket-cap-mb", low=0, low_open=True)
    if args.latency_us is not None:
        check_number(args.latency_us, name="--latency-us", low=0)
    if args.bandwidth is not None:
        parse_rate_bits(args.bandwidth)
    link_efficiency(args.link_efficiency)
    if args.codec_gbps is not None and args.codec_gbps.strip() != "measure":
        codec_speeds([], args.codec_gbps)  # the rates' form; which codecs they name is read later
    if args.gpu_speeds is not None and args.gpu_speeds.strip() != "none" and not Path(args.gpu_speeds).exists():
        raise ValueError(f"--gpu-speeds must be a JSON file or folder of benchmarks/gpu/run.sh, or none; got {shown(args.gpu_speeds)}")
    given = [f"--{name.replace('_', '-')}" for name in CALIBRATION_ONLY if getattr(args, name) is not None]
    if given and not args.calibrate:
        raise ValueError(
            f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only with --calibrate; "
            "the projection takes its links from --cluster"
        )
    defaults = getattr(args, "projection_defaults", {})
    unused = [f"--{name.replace('_', '-')}" for name in PROJECTION_ONLY if name in defaults and getattr(args, name) != defaults[name]]
    if unused and args.calibrate:
        raise ValueError(
            f"{', '.join(unused)} appl{'ies' if len(unused) == 1 else 'y'} only without --calibrate, "
            "which reads the model, codecs and world size from the runs"
        )
    # last: it builds the model's shapes (transformers on the meta device), seconds where the
    # checks above take microseconds
    try:
        model_shapes(args.model)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None


def link_efficiency(text: str | None) -> float | str | None:
    """``--link-efficiency``: None, ``fit``, ``fit-comm`` or a fraction in (0, 1].

    Raises:
        ValueError: naming ``--link-efficiency`` for anything else.
    """
    if text is None or text.strip() in ("fit", "fit-comm"):
        return None if text is None else text.strip()
    message = f"--link-efficiency must be a fraction in (0, 1], 'fit' or 'fit-comm'; got {shown(text)}"
    if not FLOAT_TEXT.fullmatch(text.strip()):
        raise ValueError(message)
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(message)
    return value


def gpu_speeds(methods: list[Method], scenario: Scenario, where: str | None) -> dict[str, CodecSpeed]:
    """``--gpu-speeds``: codec speeds measured on a GPU (:mod:`gradzip.lab.simulate.gpu_speeds`),
    from a JSON file or a folder of them; None searches ``benchmarks/results/gpu``; ``none``
    turns them off.

    Raises:
        ValueError: naming ``--gpu-speeds`` for a file that is not the benchmark's.
    """
    if where is not None and where.strip() == "none":
        return {}
    paths = default_folders() if where is None else [Path(where)]  # checked by check_options
    return measured_speeds(methods, scenario.cluster.gpu, scenario.grad_dtype, load_results(paths))


def codec_speeds(methods: list[Method], codec_gbps: str | None) -> dict[str, CodecSpeed]:
    """``--codec-gbps``: GB/s of dense gradient encoded or decoded per second.

    None keeps the cluster preset's assumption; a number applies to every codec;
    ``name=GBPS,...`` sets codecs by name or full spec, ``default=GBPS`` the rest; ``measure``
    times each codec on this CPU.

    Raises:
        ValueError: naming ``codec-gbps`` for anything else.
    """
    if codec_gbps is None:
        return {}
    if codec_gbps.strip() == "measure":
        from gradzip.lab.simulate.codec_speed import measure_codec_speed

        return {m.spec: measure_codec_speed(m) for m in methods if not m.is_identity}
    rates: dict[str, float] = {}
    for item in codec_gbps.split(","):
        key, eq, value = item.rpartition("=") if "=" in item else ("default", "=", item)
        rate = float(value) if FLOAT_TEXT.fullmatch(value.strip()) else -1.0
        if not eq or not 0 < rate < math.inf or not key.strip():
            raise ValueError(
                f"--codec-gbps must be a number of GB/s > 0, name=GBPS items (default=GBPS for the rest) "
                f"or 'measure'; got {shown(codec_gbps)}"
            )
        rates[key.strip()] = rate
    out = {}
    for m in methods:
        name = m.spec.split(":", 1)[0]
        rate = rates.get(m.spec, rates.get(name, rates.get("default")))
        if rate is not None:
            out[m.spec] = CodecSpeed(rate * GBYTE, rate * GBYTE, f"given {rate:g} GB/s")
    return out


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The :class:`Scenario` the command line describes (options checked by :func:`check_options`)."""
    return Scenario(
        model=args.model,
        cluster=get_cluster(args.cluster),
        tokens_per_gpu=args.tokens_per_gpu,
        mfu=args.mfu,
        strategy=args.strategy,
        algorithm=args.algorithm,
        collective=args.collective,
        grad_dtype=GRAD_DTYPES[args.grad_dtype],
        bucket_cap_mb=args.bucket_cap_mb,
        compute_s=args.compute_s,
        price_per_gpu_hour=args.price_per_gpu_hour,
    )


def format_table(rows: list[ProjectionRow]) -> str:
    """A Markdown table of a projection."""
    header = (
        "| method | collectives | sent MB/GPU/step | step s | codec s | comm share | speedup vs none "
        "| of limit | GPU-h / 1B tokens | USD / 1B tokens |"
    )
    lines = [header, "|" + "---|" * 10]
    for row in rows:
        r = row.result
        lines.append(
            f"| {r.method} | {r.collectives} | {r.sent_bytes / 1e6:,.1f} | {r.step_s:.3f} | {r.codec_s:.3f} | {r.comm_share:.0%} "
            f"| {row.speedup:.2f}x | {row.fraction_of_limit:.0%} | {row.gpu_hours_per_btok:,.0f} "
            f"| {row.usd_per_btok:,.0f} |"
        )
    return "\n".join(lines)


def describe(scenario: Scenario, world_size: int, rows: list[ProjectionRow]) -> str:
    """The setup lines printed above the table."""
    shapes = model_shapes(scenario.model)
    cluster = scenario.cluster
    fabric = cluster.fabric()
    workload = scenario.workload()
    lines = [
        f"model: {scenario.model}, {shapes.numel / 1e9:.2f} B parameters ({shapes.description})",
        f"cluster: {cluster.name}, {world_size} GPUs in {fabric.nodes(world_size)} nodes: {cluster.description}",
        f"network: in-node {cluster.intra_gbyte_per_s:g} GB/s bus, {cluster.intra_latency_us:g} us/step; "
        f"between nodes {cluster.node_nic_bytes_per_s / 1e9:.2f} GB/s per node "
        f"({cluster.nics_per_node} x {cluster.nic_gbit:g} Gbit/s at {cluster.nic_efficiency:.0%}), "
        f"{cluster.inter_latency_us:g} us/step",
        f"step: {scenario.strategy}, {scenario.tokens_per_gpu} tokens/GPU ({scenario.tokens_per_gpu * world_size / 1e6:.2f} M "
        f"tokens per step), forward+backward {workload.fwd_bwd_s():.3f} s "
        + ("(given)" if scenario.compute_s is not None else f"at {scenario.mfu:.0%} MFU of {cluster.gpu.peak_flops / 1e12:g} TFLOPS")
        + f", optimizer {rows[0].result.optimizer_s:.3f} s, gradients {str(scenario.grad_dtype).removeprefix('torch.')}, "
        f"all_reduce algorithm {scenario.algorithm}",
        f"price: {scenario.price_per_gpu_hour:g} USD per GPU-hour",
    ]
    speeds = sorted({r.codec_speed for r in rows if r.codec_speed != "-"})
    if speeds:
        lines.append("codec throughput (GB/s of dense gradient): " + "; ".join(speeds))
    note = state_note(scenario, world_size)
    if note:
        lines.append(note)
    return "\n".join(lines)


def plot_speedup(scenario: Scenario, methods: list[Method], gpus: list[int], path: Path, speeds) -> dict:
    """Plot speedup vs dense against GPU count for every method, with the limit dashed; returns the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[float]] = {m.spec: [] for m in methods}
    curves["limit"] = []
    for p in gpus:
        rows = project(scenario, methods, p, speeds)
        curves["limit"].append(rows[0].speedup)
        for method, row in zip(methods, rows[1:]):
            curves[method.spec].append(row.speedup)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in curves.items():
        style = {"linestyle": "--", "color": "black"} if name == "limit" else {"marker": "o", "markersize": 3}
        ax.plot(gpus, values, label=name if name != "limit" else "limit (compute alone)", **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(p) for p in gpus], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.set_ylabel("speedup vs none (step time)")
    ax.set_title(f"{scenario.model} on {scenario.cluster.name}, {scenario.strategy}, {scenario.tokens_per_gpu} tokens/GPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"gpus": gpus, "speedup": curves}


def format_calibration(rows: list[CalibrationRow], *, fitted: bool = False) -> str:
    """A Markdown table of predicted vs measured step times (``fitted``: the ``none`` rows fixed the link)."""
    lines = [
        "| run | world_size | link Mbit/s | compressor | collective | measured s | predicted s | error "
        "| compute s | codec s | comm s (model / measured) | sent MB/rank/step (model / interface) |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        err = "-" if r.error is None else f"{r.error:+.1%}"
        if fitted and r.compressor == "none":
            err = "(fit)"
        measured = "-" if r.measured_step_s is None else f"{r.measured_step_s:.3f}"
        iface = "-" if r.measured_sent_bytes is None else f"{r.measured_sent_bytes / 1e6:.2f}"
        predicted = "-" if r.predicted_step_s is None else f"{r.predicted_step_s:.3f}"
        comm = "-" if r.measured_comm_s is None else f"{r.measured_comm_s:.3f}"
        # a run whose hook counted no bytes (PyTorch's PowerSGD) leaves the model nothing to price
        unknown = r.predicted_step_s is None and r.collective == "unknown"
        codec, model_comm, model_sent = (("-", "-", "-") if unknown else
                                         (f"{r.codec_s:.3f}", f"{r.comm_s:.3f}", f"{r.predicted_sent_bytes / 1e6:.2f}"))
        lines.append(
            f"| {Path(r.directory).name} | {r.world_size} | {r.bandwidth_mbit:g} | {r.compressor} | {r.collective} "
            f"| {measured} | {predicted} | {err} | {r.compute_s:.3f} | {codec} "
            f"| {model_comm} / {comm} | {model_sent} / {iface} |"
        )
    return "\n".join(lines)


def run_calibration(args: argparse.Namespace) -> int:
    choice = link_efficiency(args.link_efficiency)
    fit = choice == "fit"
    latency_us = DEFAULT_LATENCY_US if args.latency_us is None else args.latency_us
    efficiency = choice if isinstance(choice, float) else TCP_GOODPUT
    if choice == "fit-comm":
        efficiency = fit_link_efficiency_on_comm(args.calibrate, bandwidth=args.bandwidth, latency_us=latency_us)
    rows: list[CalibrationRow] = []
    for directory in args.calibrate:
        if fit:
            efficiency = fit_link_efficiency(directory, bandwidth=args.bandwidth, latency_us=latency_us)
        rows.extend(calibrate(directory, bandwidth=args.bandwidth, latency_us=latency_us, link_efficiency=efficiency))
    # With a fitted link the 'none' run is matched by construction, not predicted.
    errors = [abs(r.error) for r in rows if r.compressor != "limit" and r.error is not None and not (fit and r.compressor == "none")]
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    print(format_calibration(rows, fitted=fit))
    how = (
        "fitted on each directory's 'none' run" if fit
        else "fitted on the 'none' runs' collective seconds" if choice == "fit-comm"
        else "given" if args.link_efficiency else "TCP payload per Ethernet frame"
    )
    efficiencies = ", ".join(sorted({f"{r.link_efficiency:.3f}" for r in rows}))
    print(
        f"\nlink: tbf rate x {efficiencies} ({how}), {latency_us:g} us per collective step; "
        "prediction = compute alone (limit row) + codec seconds + collectives, not overlapped."
    )
    if errors:
        print(f"predicted runs: {len(errors)}, largest |error| {max(errors):.1%}, mean |error| {sum(errors) / len(errors):.1%}")
    return 0


def run(args: argparse.Namespace) -> int:
    check_options(args)
    if args.calibrate:
        return run_calibration(args)
    scenario = scenario_from_args(args)
    methods = [list_entry("--compressors", spec, lambda s: Method(codec_only(s, "simulate")))
               for spec in split_specs(args.compressors)]
    out = writable_folder(args.out, "--out")  # after the specs, so that a bad one leaves no folder
    sweep = sorted(set(_positive_ints(args.sweep, "--sweep", MAX_GPUS)) | {args.gpus})
    # Explicit rates win over measured ones, measured ones over the preset's assumption.
    speeds = {**gpu_speeds(methods, scenario, args.gpu_speeds), **codec_speeds(methods, args.codec_gbps)}
    rows = project(scenario, methods, args.gpus, speeds)
    setup = describe(scenario, args.gpus, rows)
    table = format_table(rows)
    data = {
        "setup": setup.splitlines(),
        "rows": [r.as_dict() for r in rows],
    }
    if not args.no_plot:
        data["sweep"] = plot_speedup(scenario, methods, sweep, out / "speedup_vs_gpus.png", speeds)
    (out / "projection.json").write_text(json.dumps(data, indent=2, default=str))
    (out / "projection.md").write_text(f"{setup}\n\n{table}\n")
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    print(setup)
    print()
    print(table)
    print(f"\nwrote {out / 'projection.md'}, {out / 'projection.json'}" + ("" if args.no_plot else f", {out / 'speedup_vs_gpus.png'}"))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="project step time, speedup and cost to large clusters (alpha-beta model), or calibrate it",
        description=(
            "Predict step time, communication share, speedup vs uncompressed DDP and cost per 1 B tokens "
            "for each codec on a cluster preset, with a plot of speedup against GPU count; or, with "
            "--calibrate, set the model's predictions beside the step times of 'gradzip compare' runs."
        ),
    )
    p.add_argument("--model", default="llama-7b", metavar="NAME|DIR",
                   help=f"model preset ({', '.join(sorted(MODELS))}) or a transformers model folder, whose config.json "
                   "gives the parameter shapes (default llama-7b)")
    p.add_argument("--gpus", type=int, default=1024, help="GPUs in the table, 1 to 2**53 (default 1024)")
    p.add_argument("--cluster", default="h100-100gbe", choices=list(CLUSTERS), help="cluster preset (default h100-100gbe)")
    p.add_argument("--compressors", default=DEFAULT_COMPRESSORS, help="comma-separated specs: codecs, onebit-adam[:warmup=W,fused=B], or DiLoCo as "
                   f"diloco:sync_every=H[,fragments=F,delay=D][+CODEC] (default {DEFAULT_COMPRESSORS})")
    p.add_argument("--strategy", default="ddp", choices=STRATEGIES, help="data parallelism (default ddp)")
    p.add_argument("--tokens-per-gpu", type=int, default=4096, help="tokens per GPU per step (default 4096)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of forward+backward (default 0.4)")
    p.add_argument("--compute-s", type=float, default=None, help="forward+backward seconds per step (overrides --mfu)")
    p.add_argument(
        "--codec-gbps", default=None,
        help="codec throughput, GB/s of dense gradient, for every codec; 'measure' times them on this CPU "
        "(default: the cluster preset's assumption)",
    )
    p.add_argument(
        "--gpu-speeds", default=None,
        help="codec speeds measured by benchmarks/gpu/run.sh: a JSON file or a folder of them, or 'none' "
        "(default: benchmarks/results/gpu/*.json where present, else the cluster preset's assumption; "
        "--codec-gbps wins over both)",
    )
    p.add_argument("--grad-dtype", default="fp32", choices=sorted(GRAD_DTYPES), help="gradient dtype (default fp32)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket cap, MiB (default 25)")
    p.add_argument("--algorithm", default="auto", choices=ALGORITHMS, help="all_reduce algorithm (default auto)")
    p.add_argument(
        "--collective", default="auto", choices=COLLECTIVE_CHOICES,
        help="exchange for non-aggregatable codecs (default auto: the faster per bucket)",
    )
    p.add_argument("--price-per-gpu-hour", type=float, default=3.5, help="USD per GPU-hour (default 3.5)")
    p.add_argument("--sweep", default=DEFAULT_SWEEP, help=f"GPU counts of the plot (default {DEFAULT_SWEEP})")
    p.add_argument("--out", default="runs/simulate", help="directory for projection.md/.json and the plot (default runs/simulate)")
    p.add_argument("--no-plot", action="store_true", help="skip the speedup plot")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--calibrate", nargs="+", metavar="DIR", default=None,
        help="'gradzip compare' output directories: report predicted vs measured step time per run",
    )
    p.add_argument("--bandwidth", default=None, help="with --calibrate: the emulated link rate (100mbit) if not recorded")
    p.add_argument(
        "--latency-us", type=float, default=None,
        help=f"with --calibrate: latency per collective step, us (default {DEFAULT_LATENCY_US:g})",
    )
    p.add_argument(
        "--link-efficiency", default=None,
        help=f"with --calibrate: payload fraction of the link rate; 'fit' fits it on each directory's "
        f"'none' step, 'fit-comm' one fraction for all directories on the 'none' runs' collective seconds "
        f"(default {TCP_GOODPUT:.4f}, TCP over Ethernet)",
    )
    p.set_defaults(func=run, projection_defaults={name: p.get_default(name) for name in PROJECTION_ONLY})
