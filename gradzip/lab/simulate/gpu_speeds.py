"""Codec speeds measured on a GPU by ``benchmarks/gpu/run.sh``, for the projection.

The benchmark writes one JSON per run (``benchmarks/results/gpu/*.json``; format
:data:`FORMAT`): for each codec and gradient dtype the seconds to encode and to decode a tensor
of ``numel`` elements, and a device copy of the same tensor (the memory-bandwidth limit). The
codecs are memory-bound, so a codec's figure carries to another GPU as a fraction of that copy:
the projection takes ``numel * itemsize / seconds`` scaled by the preset GPU's HBM bandwidth
over the measured one (a copy moves its input twice: read and written). Codecs are matched by
their full spec, else by name (measured with their default parameters); the gradient dtype of
the projection, else fp32.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from gradzip.lab.simulate.exchange import Method
from gradzip.lab.simulate.presets import GPU
from gradzip.lab.simulate.step import CodecSpeed

#: the ``format`` field of the benchmark's JSON
FORMAT = "gradzip-gpu-bench/1"
#: where the benchmark keeps its results, relative to a checkout
RESULTS = Path("benchmarks") / "results" / "gpu"
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def default_folders() -> list[Path]:
    """``benchmarks/results/gpu`` under the working directory and under the checkout this
    package runs from (an editable install), those that exist."""
    checkout = Path(__file__).resolve().parents[3]
    found: dict[Path, None] = {}
    for folder in (Path.cwd() / RESULTS, checkout / RESULTS):
        if folder.is_dir():
            found[folder.resolve()] = None
    return list(found)


def load_results(paths: Sequence[Path]) -> list[tuple[Path, dict]]:
    """The benchmark results in ``paths`` (JSON files, or folders of them), newest file first.

    Raises:
        ValueError: naming the file, for a JSON that is not the benchmark's.
    """
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(path.glob("*.json")) if path.is_dir() else [path])
    results = []
    for file in sorted(files, key=lambda f: f.stat().st_mtime, reverse=True):
        data = json.loads(file.read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"--gpu-speeds: {file} is not a result of benchmarks/gpu/run.sh (format {FORMAT})")
        results.append((file, data))
    return results


def measured_speeds(
    methods: Sequence[Method], gpu: GPU, grad_dtype: torch.dtype, results: Sequence[tuple[Path, dict]]
) -> dict[str, CodecSpeed]:
    """Each method's speed from the first result that measured its codec, scaled to ``gpu``.

    Args:
        methods: the projection's methods (identity ones and 1-bit Adam are skipped).
        gpu: the cluster preset's GPU.
        grad_dtype: the projection's gradient dtype.
        results: from :func:`load_results`.

    Returns:
        per ``method.spec``; methods no result measured are left out.
    """
    out: dict[str, CodecSpeed] = {}
    for method in methods:
        if method.is_identity or method.codec is None or method.codec.name == "none":
            continue
        for file, data in results:
            row = _row(data, method, DTYPE_NAMES.get(grad_dtype, "fp32"))
            copy = _copy_seconds(data, row["dtype"]) if row else None
            if row is None or copy is None:
                continue
            nbytes = data["numel"] * torch.empty((), dtype=_DTYPES[row["dtype"]]).element_size()
            # A copy reads and writes every byte: the HBM bandwidth it reached is twice its input rate.
            scale = gpu.hbm_bytes_per_s / (2 * nbytes / copy)
            out[method.spec] = CodecSpeed(
                nbytes / row["encode_s"] * scale,
                nbytes / row["decode_s"] * scale,
                f"measured on {data['device']['name']} ({file.name}, {row['spec']} {row['dtype']}), "
                f"scaled by HBM bandwidth to the {gpu.name}",
            )
            break
    return out


_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def _row(data: dict, method: Method, dtype: str) -> dict | None:
    """The measured row of ``method``'s codec (DiLoCo's inner codec for DiLoCo)."""
    rows = [r for r in data.get("codecs", []) if r.get("encode_s") and r.get("decode_s")]
    spec, name = method.codec.spec, method.codec.name
    for wanted in (dtype, "fp32"):
        for match in (lambda r: r["spec"] == spec, lambda r: r["codec"] == name):
            found = [r for r in rows if r["dtype"] == wanted and match(r)]
            if found:
                return found[0]
    return None


def _copy_seconds(data: dict, dtype: str) -> float | None:
    for row in data.get("baselines", []):
        if row.get("dtype") == dtype and row.get("copy_s"):
            return row["copy_s"]
    return None
