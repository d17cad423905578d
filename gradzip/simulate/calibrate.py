"""Check the model against measured runs: ``gradzip simulate --calibrate DIR``.

Reads a ``gradzip compare`` results directory, predicts each run's step time from what the
directory says about the setup (link rate, world_size, compute alone, codec seconds, payload
bytes), and sets the prediction beside the measured step time.

Expected layout (fields beyond these are ignored)::

    DIR/results.json            a list of rows, one per run:
        compressor              spec as given to compare ("none", "powersgd:approx_rank=4",
                                "torch:fp16", ...); the row "limit" is compute alone
        step_s                  measured median step time, seconds (null for a run that hung)
        wire_bytes              optional: interface bytes of the run, summed over hosts
        bandwidth | bandwidth_mbit   optional: the emulated link ("100mbit", or 100)
    DIR/<run>/summary.json      one per run:
        compressor, world_size, steps, payload_bytes_per_step (per rank),
        step_s_median, bandwidth | bandwidth_mbit (optional)
    DIR/<run>/metrics.jsonl     optional, one object per step: compress_s, decompress_s
                                (seconds of codec work on one rank), and optionally
                                buckets: {key: {payload_bytes, collective}}
    DIR/setup.json | config.json   optional: bandwidth | bandwidth_mbit, world_size

The link is the rate every host's ``tbf`` qdisc allows, at TCP's goodput over Ethernet (1448
payload bytes per 1514-byte frame with timestamps: 95.6%), with an assumed ``latency`` per
algorithm step (the emulated cluster adds none; loopback TCP costs tens of microseconds). Gloo
runs ring all_reduce and ring all_gather, so the single-level formulas apply.

Prediction per run: compute alone (the ``limit`` row) + codec seconds (medians from
``metrics.jsonl``) + the collectives' seconds for the run's payload bytes. Communication is not
overlapped with backward here: the compare model fits in one or two DDP buckets and the gloo
threads share the hosts' cores with backward.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from gradzip.compressors import REGISTRY, build
from gradzip.simulate.collectives import Link, single_level
from gradzip.simulate.exchange import ONEBIT_ADAM

#: TCP payload per Ethernet frame at MTU 1500 with timestamps: 1448 of 1514 bytes tbf counts
TCP_GOODPUT = 1448 / 1514
DEFAULT_LATENCY_US = 50.0
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)


def parse_rate_bits(text: str | float | int) -> float:
    """A link rate in bits per second from ``tc`` notation (``100mbit``, ``1gbit``, ``20mbit``).

    A bare number is Mbit/s. ``bps`` is bytes per second, as in ``tc``.

    Raises:
        ValueError: naming ``bandwidth`` for anything else or a rate <= 0.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text) * 1e6
    else:
        match = _RATE.match(str(text))
        if not match:
            raise ValueError(f"bandwidth must look like 100mbit, 1gbit or a number of Mbit/s; got {text!r}")
        number, prefix, unit = match.groups()
        scale = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[prefix.lower()]
        if not unit and not prefix:
            scale = 1e6
        value = float(number) * scale * (8 if (unit or "").lower() == "bps" else 1)
    if not value > 0:
        raise ValueError(f"bandwidth must be > 0; got {text!r}")
    return value


@dataclass
class CalibrationRow:
    """One run: what was measured and what the model predicts (seconds per step, bytes per rank)."""

    directory: str
    compressor: str
    world_size: int
    bandwidth_mbit: float
    measured_step_s: float | None
    predicted_step_s: float
    compute_s: float
    codec_s: float
    comm_s: float
    payload_bytes: float
    collective: str
    predicted_sent_bytes: float
    measured_sent_bytes: float | None

    @property
    def error(self) -> float | None:
        """``predicted / measured - 1``; None when the run has no measured step time."""
        if not self.measured_step_s:
            return None
        return self.predicted_step_s / self.measured_step_s - 1

    def as_dict(self) -> dict:
        """Fields plus ``error``, for JSON."""
        out = asdict(self)
        out["error"] = self.error
        return out


def _load_json(path: Path):
    with open(path) as f:
        return json.load(f)


def _bandwidth(sources: list[dict]) -> float | None:
    for source in sources:
        for key in ("bandwidth_mbit", "bandwidth"):
            if source.get(key) not in (None, ""):
                return parse_rate_bits(source[key])
    return None


def _codec_seconds(metrics_path: Path) -> tuple[float, dict]:
    """Median codec seconds per step and the buckets of the last step that lists them."""
    if not metrics_path.exists():
        return 0.0, {}
    compress, decompress, buckets = [], [], {}
    with open(metrics_path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            compress.append(float(row.get("compress_s") or 0.0))
            decompress.append(float(row.get("decompress_s") or 0.0))
            if row.get("buckets"):
                buckets = row["buckets"]
    if not compress:
        return 0.0, {}
    return statistics.median(compress) + statistics.median(decompress), buckets


def _rounds_for(compressor: str, payload_bytes: float, buckets: dict) -> list[tuple[str, float]]:
    """The collectives one rank issued per step: ``(collective, its bytes per rank)``."""
    if buckets:
        return [(b.get("collective", "allreduce"), float(b["payload_bytes"])) for b in buckets.values()]
    name = compressor.split(":", 1)[0]
    if name.startswith("torch") or name == ONEBIT_ADAM or name not in REGISTRY:
        return [("allreduce", payload_bytes)]
    codec = build(compressor)
    if codec.multi_round or codec.aggregatable:
        return [("allreduce", payload_bytes)]
    return [("allgather", payload_bytes)]


def calibrate(
    directory: str | Path,
    *,
    bandwidth: str | float | None = None,
    latency_us: float = DEFAULT_LATENCY_US,
    link_efficiency: float = TCP_GOODPUT,
) -> list[CalibrationRow]:
    """Predict every run of a compare results directory and pair it with its measurement.

    Args:
        directory: the ``--out`` of ``gradzip compare`` (layout in the module docstring).
        bandwidth: the emulated link rate (``100mbit``); None reads it from the directory.
        latency_us: seconds per algorithm step of the collectives, microseconds (>= 0).
        link_efficiency: fraction of the rate that carries payload, in (0, 1].

    Returns:
        one row per run, the ``limit`` row first.

    Raises:
        FileNotFoundError: if ``directory/results.json`` is missing.
        ValueError: if the directory has no ``limit`` row, or no bandwidth is given or recorded.
    """
    root = Path(directory)
    if not 0 < link_efficiency <= 1:
        raise ValueError(f"link_efficiency must be in (0, 1]; got {link_efficiency}")
    if not latency_us >= 0:
        raise ValueError(f"latency_us must be >= 0; got {latency_us}")
    results_path = root / "results.json"
    if not results_path.exists():
        raise FileNotFoundError(f"{results_path} not found: --calibrate takes a 'gradzip compare' --out directory")
    rows = _load_json(results_path)
    summaries = {}
    for path in sorted(root.glob("*/summary.json")):
        summary = _load_json(path)
        summaries[summary.get("compressor")] = (path.parent, summary)
    setup = {}
    for name in ("setup.json", "config.json"):
        if (root / name).exists():
            setup.update(_load_json(root / name))

    limit = next((r for r in rows if r.get("compressor") == "limit"), None)
    if limit is None or limit.get("step_s") is None:
        raise ValueError(f"{results_path} has no 'limit' row with a step_s: compute alone is needed to calibrate")
    compute_s = float(limit["step_s"])

    out = []
    for row in rows:
        compressor = row.get("compressor")
        run_dir, summary = summaries.get(compressor, (None, {}))
        rate_bits = parse_rate_bits(bandwidth) if bandwidth is not None else _bandwidth([row, summary, setup])
        if rate_bits is None:
            raise ValueError(f"no bandwidth recorded in {root}; pass --bandwidth (such as 100mbit)")
        world_size = int(summary.get("world_size") or row.get("world_size") or setup.get("world_size") or 0)
        if world_size < 1:
            raise ValueError(f"no world_size for run {compressor!r} in {root}")
        measured = row.get("step_s", summary.get("step_s_median"))
        fabric = single_level(Link(latency_us * 1e-6, rate_bits / 8 * link_efficiency))
        if compressor == "limit":
            out.append(CalibrationRow(str(root), "limit", world_size, rate_bits / 1e6, measured, compute_s,
                                      compute_s, 0.0, 0.0, 0.0, "none", 0.0, None))
            continue
        payload = float(summary.get("payload_bytes_per_step") or row.get("payload_bytes_per_step") or 0.0)
        codec_s, buckets = _codec_seconds(run_dir / "metrics.jsonl") if run_dir is not None else (0.0, {})
        rounds = _rounds_for(compressor, payload, buckets)
        comm_s = sent = 0.0
        for collective, nbytes in rounds:
            if collective == "allgather":
                comm_s += fabric.all_gather_s(world_size * nbytes, world_size)
                sent += (world_size - 1) * nbytes
            else:
                comm_s += fabric.all_reduce_s(nbytes, world_size, "ring")
                sent += 2 * (world_size - 1) / world_size * nbytes
        steps = summary.get("steps")
        wire = row.get("wire_bytes")
        measured_sent = wire / (steps * world_size) if wire and steps else None
        out.append(
            CalibrationRow(
                str(root), compressor, world_size, rate_bits / 1e6, measured,
                compute_s + codec_s + comm_s, compute_s, codec_s, comm_s, payload,
                "+".join(sorted({c for c, _ in rounds})), sent, measured_sent,
            )
        )
    out.sort(key=lambda r: r.compressor != "limit")
    return out
