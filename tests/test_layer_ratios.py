"""The compression ratio per layer over the steps (``layer_ratios.png`` of ``gradzip train`` and
``gradzip compare``), from per-layer records whose ratios are computed here by hand.

The real records of a ``kimad`` run are checked in ``tests/test_link_follow.py`` (the layers'
ratios add up to each step's ``compression_ratio``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gradzip.compressors import build
from gradzip.lab.compare import compare_rows
from gradzip.lab.compare.report import write_plots
from gradzip.lab.compare.runner import RunResult
from gradzip.lab.train import layer_ratios


def _layer(spec: str, numel: int) -> dict:
    return {"codec": spec, "numel": numel, "payload_bytes": build(spec).payload_nbytes(numel)}


def _records() -> list[dict]:
    """Two steps of a per-layer schedule: bucket 1 (two layers) moves its second layer from fp16 to
    none; bucket 0 (one layer, Top-K) is not exchanged at step 11; bucket 2 has no per-layer plan."""
    topk, small, big = _layer("topk:ratio=0.01", 1000), _layer("none", 6), _layer("fp16", 10)
    plain = {"codec": "fp16", "payload_bytes": 8, "dense_bytes": 16}
    return [
        {"step": 10, "buckets": {"1": {"dense_bytes": 64, "layers": [small, big]}, "2": plain,
                                 "0": {"dense_bytes": 4000, "layers": [topk]}}},
        {"step": 11, "buckets": {"1": {"dense_bytes": 64, "layers": [small, _layer("none", 10)]}, "2": plain}},
    ]  # fmt: skip


def test_ratios_by_hand():
    ratios = layer_ratios.layer_ratios(_records())
    assert ratios.steps == [10, 11]
    assert ratios.labels == ["0.0 (1k)", "1.0 (6)", "1.1 (10)"]
    assert ratios.numels == [1000, 6, 10]
    # Top-K at ratio 0.01 of 1000 fp32 elements: 10 values (4 bytes) and 10 indices (2 bytes: under
    # 2**16 elements) = 60 bytes against 4000; none: 4 bytes an element, 1x; fp16: 2 bytes, 2x
    [topk], [small], [big] = ratios.ratios[0][:1], ratios.ratios[1][:1], ratios.ratios[2][:1]
    assert build("topk:ratio=0.01").payload_nbytes(1000) == 60
    assert (topk, small, big) == (pytest.approx(4000 / 60), pytest.approx(1.0), pytest.approx(2.0))
    assert math.isnan(ratios.ratios[0][1])  # bucket 0 not exchanged at step 11
    assert ratios.ratios[1][1] == pytest.approx(1.0) and ratios.ratios[2][1] == pytest.approx(1.0)


def test_no_per_layer_records_no_plot(tmp_path):
    records = [{"step": 0, "buckets": {"0": {"codec": "fp16", "payload_bytes": 8, "dense_bytes": 16}}}, {"step": 1}]
    assert layer_ratios.layer_ratios(records) is None
    assert layer_ratios.plot(records, tmp_path / "layer_ratios.png", "t") is False
    assert not (tmp_path / "layer_ratios.png").exists()


@pytest.mark.slow  # matplotlib: seconds
def test_train_and_compare_write_the_plot_for_per_layer_runs_only(tmp_path):
    assert layer_ratios.plot(_records(), tmp_path / "layer_ratios.png", "kimad")
    assert (tmp_path / "layer_ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = []
    for label, records in (("none", [{"step": 10}, {"step": 11}]), ("kimad", _records())):
        for r in records:
            r.update(loss=1.0, elapsed_s=r["step"] * 0.1, step_s=0.1, payload_bytes=1, dense_bytes=1, val_loss=1.0)
        results.append(RunResult(label, Path("."), records=records, summary={"final_val_loss": 1.0}))
    rows, _ = compare_rows(results)
    setup = {"network": "loopback", "world_size": 2, "link": "loopback"}
    out = tmp_path / "cmp"
    out.mkdir()
    paths = write_plots(out, results, rows, setup, None)
    assert [p.name for p in paths] == ["loss_vs_time.png", "loss_vs_bytes.png", "layer_ratios.png"]
    assert (out / "layer_ratios.png").stat().st_size > 0
    paths = write_plots(out, results[:1], rows[:1], setup, None)
    assert [p.name for p in paths] == ["loss_vs_time.png", "loss_vs_bytes.png"]


def test_every_layer_is_named_up_to_the_cap_and_the_largest_beyond():
    assert layer_ratios.named_rows([10, 1] * 26) == list(range(52))  # the demo GPT's 52 layers
    # 200 rows alternating large and small: 90 stretches of 2 or 3 rows, each names a large one
    numels = [1000 if i % 2 == 0 else 10 for i in range(200)]
    shown = layer_ratios.named_rows(numels)
    assert len(shown) == layer_ratios.MAX_NAMES and all(numels[i] == 1000 for i in shown)
    assert shown == sorted(set(shown))
