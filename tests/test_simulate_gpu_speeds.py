"""``gradzip simulate`` with codec speeds measured on a GPU (``benchmarks/gpu/run.sh``'s JSON):
the figures scaled by HBM bandwidth, matched by spec then name and by dtype, and the CLI's
precedence (``--codec-gbps`` over measured figures over the preset's assumption)."""

from __future__ import annotations

import json

import pytest
import torch

from gradzip.lab.cli import main
from gradzip.lab.simulate.exchange import Method
from gradzip.lab.simulate.gpu_speeds import FORMAT, load_results, measured_speeds
from gradzip.lab.simulate.presets import H100_SXM

NUMEL = 1_000_000


def _result(tmp_path, name="measured.json", **extra):
    """A benchmark result: a copy reaching 4e12 B/s of HBM on fp32 (2e12 B/s of input)."""
    data = {
        "format": FORMAT,
        "device": {"name": "Test GPU"},
        "numel": NUMEL,
        "baselines": [
            {"dtype": "fp32", "abs_s": 4e-6, "copy_s": 2e-6},
            {"dtype": "bf16", "abs_s": 2e-6, "copy_s": 1e-6},
        ],
        "codecs": [
            {"codec": "topk", "spec": "topk", "dtype": "fp32", "encode_s": 1e-5, "decode_s": 5e-6},
            {"codec": "topk", "spec": "topk", "dtype": "bf16", "encode_s": 8e-6, "decode_s": 4e-6},
            {"codec": "qsgd", "spec": "qsgd:bits=2", "dtype": "fp32", "encode_s": 4e-6, "decode_s": 2e-6},
            {"codec": "qsgd", "spec": "qsgd", "dtype": "fp32", "encode_s": 2e-6, "decode_s": 2e-6},
        ],
        **extra,
    }
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_measured_seconds_become_rates_scaled_to_the_presets_gpu(tmp_path):
    results = load_results([_result(tmp_path)])
    methods = [Method(s) for s in ("none", "topk:ratio=0.001", "qsgd:bits=2", "fp16", "onebit-adam")]
    speeds = measured_speeds(methods, H100_SXM, torch.float32, results)
    assert sorted(speeds) == ["qsgd:bits=2", "topk:ratio=0.001"]  # fp16 was not measured
    scale = 3.35e12 / 4e12
    topk = speeds["topk:ratio=0.001"]  # matched by name: measured with the default ratio
    assert topk.encode_bytes_per_s == pytest.approx(4e6 / 1e-5 * scale)
    assert topk.decode_bytes_per_s == pytest.approx(4e6 / 5e-6 * scale)
    assert topk.source.startswith("measured on Test GPU (measured.json, topk fp32)")
    assert speeds["qsgd:bits=2"].encode_bytes_per_s == pytest.approx(4e6 / 4e-6 * scale)  # the spec's own row


def test_the_projections_dtype_is_preferred_and_fp32_stands_in(tmp_path):
    results = load_results([_result(tmp_path)])
    methods = [Method("topk"), Method("qsgd")]
    speeds = measured_speeds(methods, H100_SXM, torch.bfloat16, results)
    # bf16: 2e6 bytes, copy 1e-6 s -> 4e12 B/s of HBM
    assert speeds["topk"].encode_bytes_per_s == pytest.approx(2e6 / 8e-6 * 3.35e12 / 4e12)
    assert speeds["qsgd"].encode_bytes_per_s == pytest.approx(4e6 / 2e-6 * 3.35e12 / 4e12)  # fp32 row


def test_a_file_that_is_not_the_benchmarks_is_refused(tmp_path):
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="--gpu-speeds"):
        load_results([tmp_path])


def test_simulate_takes_measured_speeds_unless_told_otherwise(tmp_path, capsys):
    (tmp_path / "gpu").mkdir()
    path = _result(tmp_path / "gpu")
    base = ["simulate", "--model", "gpt2", "--gpus", "16", "--compressors", "none,topk:ratio=0.01", "--no-plot", "--json"]

    def codec_speed(extra: list[str]) -> str:
        assert main([*base, "--out", str(tmp_path / "out"), *extra]) == 0
        rows = json.loads(capsys.readouterr().out)["rows"]
        return next(r["codec_speed"] for r in rows if r["method"] == "topk:ratio=0.01")

    assert "measured on Test GPU" in codec_speed(["--gpu-speeds", str(path.parent)])
    assert "assumed" in codec_speed(["--gpu-speeds", "none"])
    assert "given 5 GB/s" in codec_speed(["--gpu-speeds", str(path), "--codec-gbps", "5"])
    assert main([*base, "--out", str(tmp_path / "out"), "--gpu-speeds", str(tmp_path / "missing")]) == 2
    assert "--gpu-speeds" in capsys.readouterr().err
