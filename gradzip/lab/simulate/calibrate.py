"""Check the model against measured runs: ``gradzip simulate --calibrate DIR``.

Reads a ``gradzip compare`` results directory, predicts each run's step time from what the
directory says about the setup (link rate, world_size, compute alone, codec seconds, payload
bytes), and sets the prediction beside the measured step time.

Expected layout (what ``gradzip compare`` writes; other fields are ignored)::

    DIR/results.json            a list of rows, one per run:
        compressor              the row's label: a spec ("none", "powersgd:approx_rank=4"),
                                a PyTorch hook ("torch:fp16"), or "limit" (compute alone)
        status                  "ok" for a finished run
        step_s                  measured median step time, seconds
        steps                   steps recorded
        compress_s              median codec seconds per step (compress + decompress), optional
        payload_bytes_per_step  bytes rank 0 handed to collectives per step, optional
        wire_bytes_exchange | wire_bytes   interface bytes per host over the run, optional
    DIR/runs/<label>/summary.json   per run (label with characters other than letters, digits,
                                ".", "_", "-" replaced by "_"): world_size, payload_bytes_per_step,
                                compress_s_median, step_s_median, communicate_s_median (optional:
                                the wall seconds per step with a collective of rank 0 in flight)
    DIR/runs/<label>/metrics.jsonl  per step: compress_s, decompress_s (used when the row and
                                the summary have no codec seconds)
    DIR/report.md               its title names the link: "... 4 workers, 100mbit links"
    DIR/setup.json              optional: bandwidth ("100mbit") or bandwidth_mbit, world_size

``--bandwidth`` overrides the link rate found in the directory. A results directory of a
loopback run has no link rate; it cannot be calibrated against.

The link is the rate every host's ``tbf`` qdisc allows, at TCP's goodput over Ethernet (1448
payload bytes per 1514-byte frame with timestamps: 95.6%), with an assumed ``latency`` per
algorithm step (the emulated cluster adds none; loopback TCP costs tens of microseconds). Gloo
runs ring all_reduce and ring all_gather, so the single-level formulas apply.

Prediction per run: compute alone (the ``limit`` row's step time) + codec seconds + the
collectives' seconds for the run's payload bytes (all_reduce for aggregatable codecs, PowerSGD
and PyTorch's hooks; all_gather for the others). Communication is not overlapped with backward
here: the compare model fits in one or two DDP buckets and the gloo threads share the hosts'
cores with backward.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from gradzip.compressors import REGISTRY, build
from gradzip.lab.simulate.collectives import Link, single_level
from gradzip.lab.simulate.exchange import ONEBIT_ADAM

#: TCP payload per Ethernet frame at MTU 1500 with timestamps: 1448 of 1514 bytes tbf counts
TCP_GOODPUT = 1448 / 1514
DEFAULT_LATENCY_US = 50.0
_REPORT_LINK = re.compile(r"\d+ workers, (\S+) links")
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
    """One run: what was measured and what the model predicts (seconds per step, bytes per rank).

    ``predicted_step_s`` is None for a run whose payload bytes were not recorded;
    ``link_efficiency`` is the payload fraction of the link rate the prediction used;
    ``measured_sent_bytes`` counts Ethernet frames (headers and acknowledgements included);
    ``measured_comm_s`` is rank 0's median seconds per step with a collective in flight (None when
    not recorded), set beside ``comm_s`` to tell the collectives' error from the compute's.
    """

    directory: str
    compressor: str
    world_size: int
    bandwidth_mbit: float
    measured_step_s: float | None
    predicted_step_s: float | None
    compute_s: float
    codec_s: float
    comm_s: float
    payload_bytes: float
    collective: str
    predicted_sent_bytes: float
    measured_sent_bytes: float | None
    link_efficiency: float = TCP_GOODPUT
    measured_comm_s: float | None = None

    @property
    def error(self) -> float | None:
        """``predicted / measured - 1``; None when either is missing."""
        if not self.measured_step_s or self.predicted_step_s is None:
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


def run_slug(label: str) -> str:
    """The folder name compare gives a run: characters other than letters, digits, ``._-`` become ``_``."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label)


def _bandwidth_in_report(root: Path) -> float | None:
    report = root / "report.md"
    if not report.exists():
        return None
    title = report.read_text().splitlines()[:1]
    match = _REPORT_LINK.search(title[0]) if title else None
    return parse_rate_bits(match.group(1)) if match else None


def _codec_seconds(row: dict, summary: dict, metrics_path: Path | None) -> tuple[float, dict]:
    """Median codec seconds per step (the row's, the summary's, or from metrics.jsonl) and buckets."""
    buckets: dict = {}
    compress, decompress = [], []
    if metrics_path is not None and metrics_path.exists():
        with open(metrics_path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut off by a killed run
                compress.append(float(record.get("compress_s") or 0.0))
                decompress.append(float(record.get("decompress_s") or 0.0))
                if record.get("buckets"):
                    buckets = record["buckets"]
    for value in (row.get("compress_s"), summary.get("compress_s_median")):
        if value is not None:
            return float(value), buckets
    if not compress:
        return 0.0, buckets
    return statistics.median(compress) + statistics.median(decompress), buckets


def _rounds_for(compressor: str, payload_bytes: float, buckets: dict) -> list[tuple[str, float]]:
    """The collectives one rank issued per step: ``(collective, its bytes per rank)``.

    A bucket's recorded route wins; a bucket without one (the per-step log keeps only its codec,
    bytes and seconds) takes the route the reducer gives the run's codec.
    """
    route = _codec_route(compressor)
    if buckets:
        return [(b.get("collective") or route, float(b["payload_bytes"])) for b in buckets.values()]
    return [(route, payload_bytes)]


def _codec_route(compressor: str) -> str:
    """``allreduce`` for aggregatable and multi-round codecs and PyTorch's hooks, else ``allgather``."""
    name = compressor.split(":", 1)[0]
    if name.startswith("torch") or name == ONEBIT_ADAM or name not in REGISTRY:
        return "allreduce"
    codec = build(compressor)
    return "allreduce" if codec.multi_round or codec.aggregatable else "allgather"


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
    setup = _load_json(root / "setup.json") if (root / "setup.json").exists() else {}
    report_bits = _bandwidth_in_report(root)

    limit = next((r for r in rows if r.get("compressor") == "limit"), None)
    if limit is None or limit.get("step_s") is None:
        raise ValueError(f"{results_path} has no 'limit' row with a step_s: compute alone is needed to calibrate")
    compute_s = float(limit["step_s"])

    out = []
    for row in rows:
        compressor = row.get("compressor")
        run_dir = next((d for d in (root / "runs" / run_slug(compressor), root / run_slug(compressor)) if d.is_dir()), None)
        summary_path = run_dir / "summary.json" if run_dir is not None else None
        summary = _load_json(summary_path) if summary_path is not None and summary_path.exists() else {}
        rate_bits = parse_rate_bits(bandwidth) if bandwidth is not None else _bandwidth([row, summary, setup])
        rate_bits = rate_bits or report_bits
        if rate_bits is None:
            raise ValueError(f"no link rate recorded in {root} (a loopback run?); pass --bandwidth such as 100mbit")
        world_size = int(summary.get("world_size") or row.get("world_size") or setup.get("world_size") or 0)
        if world_size < 1:
            raise ValueError(f"no world_size for run {compressor!r} in {root}")
        measured = row.get("step_s", summary.get("step_s_median"))
        if row.get("status", "ok") != "ok":
            measured = None
        fabric = single_level(Link(latency_us * 1e-6, rate_bits / 8 * link_efficiency))
        if compressor == "limit":
            out.append(CalibrationRow(str(root), "limit", world_size, rate_bits / 1e6, measured, compute_s,
                                      compute_s, 0.0, 0.0, 0.0, "none", 0.0, None, link_efficiency))
            continue
        payload = row.get("payload_bytes_per_step", summary.get("payload_bytes_per_step"))
        steps = row.get("steps") or summary.get("steps")
        wire = row.get("wire_bytes_exchange") or row.get("wire_bytes")
        measured_sent = wire / steps if wire and steps else None
        # PyTorch's hooks do not time their collectives (their summary says hook "torch").
        measured_comm = summary.get("communicate_s_median") if summary.get("hook", "gradzip") == "gradzip" else None
        measured_comm = float(measured_comm) if measured_comm is not None and measured is not None else None
        if payload is None:
            # The hook did not count its bytes (PyTorch's PowerSGD): nothing to predict from.
            out.append(CalibrationRow(str(root), compressor, world_size, rate_bits / 1e6, measured, None,
                                      compute_s, 0.0, 0.0, 0.0, "unknown", 0.0, measured_sent, link_efficiency,
                                      measured_comm))
            continue
        payload = float(payload)
        codec_s, buckets = _codec_seconds(row, summary, run_dir / "metrics.jsonl" if run_dir is not None else None)
        rounds = _rounds_for(compressor, payload, buckets)
        comm_s = sent = 0.0
        for collective, nbytes in rounds:
            if collective == "allgather":
                comm_s += fabric.all_gather_s(world_size * nbytes, world_size)
                sent += (world_size - 1) * nbytes
            else:
                comm_s += fabric.all_reduce_s(nbytes, world_size, "ring")
                sent += 2 * (world_size - 1) / world_size * nbytes
        out.append(
            CalibrationRow(
                str(root), compressor, world_size, rate_bits / 1e6, measured,
                compute_s + codec_s + comm_s, compute_s, codec_s, comm_s, payload,
                "+".join(sorted({c for c, _ in rounds})), sent, measured_sent, link_efficiency, measured_comm,
            )
        )
    out.sort(key=lambda r: r.compressor != "limit")
    return out


def fit_link_efficiency(
    directory: str | Path, *, bandwidth: str | float | None = None, latency_us: float = DEFAULT_LATENCY_US
) -> float:
    """The payload fraction of the link rate that makes the model match the ``none`` run exactly.

    With the ``none`` run's ring all_reduce, ``comm = L + B / efficiency`` (``L`` the latency
    terms, ``B`` the bandwidth term at the full rate), and the measured comm is its step time minus
    compute alone minus its codec seconds. Every other run is then predicted with that efficiency.

    Raises:
        ValueError: if the directory has no finished ``none`` run with bytes, or its step is not
            longer than compute alone plus latency.
    """
    rows = {r.compressor: r for r in calibrate(directory, bandwidth=bandwidth, latency_us=latency_us, link_efficiency=1.0)}
    none = rows.get("none")
    if none is None or none.measured_step_s is None or none.predicted_step_s is None or none.collective != "allreduce":
        raise ValueError(f"link efficiency is fitted on a finished 'none' run; {directory} has none")
    p = none.world_size
    latency_s = 2 * (p - 1) * latency_us * 1e-6
    bandwidth_s = none.comm_s - latency_s
    measured_s = none.measured_step_s - none.compute_s - none.codec_s - latency_s
    if not (bandwidth_s > 0 and measured_s > 0):
        raise ValueError(f"the 'none' run in {directory} is not slower than compute alone: nothing to fit")
    return min(1.0, bandwidth_s / measured_s)


def fit_link_efficiency_on_comm(
    directories: list[str | Path], *, bandwidth: str | float | None = None, latency_us: float = DEFAULT_LATENCY_US
) -> float:
    """One payload fraction of the link rate for all ``directories``, fitted on the collectives alone.

    For every finished ``none`` run with a recorded ``communicate_s_median`` (rank 0's seconds per
    step with a collective in flight), the model's bandwidth term at the full rate ``B`` and the
    measured collective seconds less the latency terms ``M``; the fit is ``sum(B) / sum(M)``, so
    the slowest links weigh most. Compute alone does not enter: a step slowed by other load on the
    hosts does not move the fit.

    Raises:
        ValueError: if no directory has such a ``none`` run.
    """
    bandwidth_s = measured_s = 0.0
    for directory in directories:
        rows = {r.compressor: r for r in calibrate(directory, bandwidth=bandwidth, latency_us=latency_us, link_efficiency=1.0)}
        none = rows.get("none")
        if none is None or none.measured_comm_s is None or none.collective != "allreduce":
            continue
        latency_s = 2 * (none.world_size - 1) * latency_us * 1e-6
        bandwidth_s += none.comm_s - latency_s
        measured_s += none.measured_comm_s - latency_s
    if not (bandwidth_s > 0 and measured_s > 0):
        raise ValueError("link efficiency 'fit-comm' needs a finished 'none' run with its collective seconds recorded")
    return min(1.0, bandwidth_s / measured_s)
