"""``gradzip simulate``: the projection files, and ``--calibrate`` on a compare directory written here."""

import json

import pytest

from gradzip.lab.cli import main
from gradzip.lab.simulate.calibrate import (
    TCP_GOODPUT,
    calibrate,
    fit_link_efficiency,
    fit_link_efficiency_on_comm,
    parse_rate_bits,
)
from gradzip.lab.simulate.cli import codec_speeds, split_specs
from gradzip.lab.simulate.exchange import Method


def _write_compare_dir(root, *, limit=True, title="4 workers, 100mbit links"):
    """A results directory laid out as 'gradzip compare' writes it: results.json, runs/<label>/, report.md."""
    rows = [
        {"compressor": "none", "status": "ok", "steps": 10, "step_s": 2.0, "payload_bytes_per_step": 16_000_000,
         "compress_s": 0.0, "wire_bytes": 130_000_000, "wire_bytes_exchange": 125_000_000},
        # codec seconds only in metrics.jsonl: medians 0.2 + 0.05
        {"compressor": "topk:ratio=0.01", "status": "ok", "steps": 3, "step_s": 0.9, "payload_bytes_per_step": 1_000_000},
        {"compressor": "torch:fp16", "status": "timeout", "steps": 2, "step_s": 5.0, "payload_bytes_per_step": 8_000_000},
        {"compressor": "torch:powersgd", "status": "ok", "steps": 3, "step_s": 0.7, "payload_bytes_per_step": None},
    ]
    if limit:
        rows.insert(0, {"compressor": "limit", "status": "ok", "steps": 10, "step_s": 0.5, "payload_bytes_per_step": 0})
    root.mkdir(parents=True, exist_ok=True)
    (root / "results.json").write_text(json.dumps(rows))
    (root / "report.md").write_text(f"# gradzip compare: time to loss, {title}\n\n- Network: ...\n")
    metrics = {"topk_ratio_0.01": [(0.1, 0.05), (0.2, 0.05), (0.3, 0.5)]}
    for row in rows:
        run = root / "runs" / row["compressor"].replace(":", "_").replace("=", "_")
        run.mkdir(parents=True)
        summary = {"world_size": 4, "compressor": row["compressor"], "communicate_s_median": 1.25,
                   "hook": "torch" if row["compressor"].startswith("torch:") else "gradzip"}
        (run / "summary.json").write_text(json.dumps(summary))
        lines = [{"compress_s": c, "decompress_s": d} for c, d in metrics.get(run.name, [(0.0, 0.0)])]
        (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    return root


def test_calibrate_hand_computed(tmp_path):
    rows = {r.compressor: r for r in calibrate(_write_compare_dir(tmp_path / "cmp"), latency_us=50)}
    rate = 100e6 / 8 * TCP_GOODPUT
    # none: ring all_reduce of 16 MB over 4 ranks, no codec time
    none = rows["none"]
    assert none.predicted_step_s == pytest.approx(0.5 + 2 * 3 * 50e-6 + 2 * 3 / 4 * 16e6 / rate, rel=1e-12)
    assert none.predicted_sent_bytes == pytest.approx(2 * 3 / 4 * 16e6)
    assert none.measured_sent_bytes == pytest.approx(12_500_000)  # interface bytes of the exchange / steps
    assert none.error == pytest.approx(none.predicted_step_s / 2.0 - 1)
    # topk is not aggregatable: all_gather of 4 payloads of 1 MB, plus median codec seconds 0.2 + 0.05
    topk = rows["topk:ratio=0.01"]
    assert topk.collective == "allgather"
    assert topk.predicted_step_s == pytest.approx(0.5 + 0.25 + 3 * 50e-6 + 3 / 4 * 4e6 / rate, rel=1e-12)
    # PyTorch's hooks all_reduce; a run that did not finish has no error; unknown bytes, no prediction
    assert rows["torch:fp16"].collective == "allreduce" and rows["torch:fp16"].error is None
    assert rows["torch:powersgd"].predicted_step_s is None and rows["torch:powersgd"].error is None
    assert list(rows)[0] == "limit" and rows["limit"].predicted_step_s == 0.5
    # a rate given on the command line wins over the report's
    fast = {r.compressor: r for r in calibrate(tmp_path / "cmp", bandwidth="1gbit", latency_us=0)}
    assert fast["none"].comm_s == pytest.approx(2 * 3 / 4 * 16e6 / (1e9 / 8 * TCP_GOODPUT), rel=1e-12)


def test_fitted_link_matches_the_dense_run(tmp_path):
    cmp = _write_compare_dir(tmp_path / "cmp")
    # none: 2.0 s measured, 0.5 s compute, latency 2*3*50 us; bandwidth term at 1 Gbit/s 2*3/4*16e6/1.25e8
    efficiency = fit_link_efficiency(cmp, bandwidth="1gbit", latency_us=50)
    assert efficiency == pytest.approx((2 * 3 / 4 * 16e6 / 1.25e8) / (2.0 - 0.5 - 3e-4), rel=1e-12)
    rows = {r.compressor: r for r in calibrate(cmp, bandwidth="1gbit", latency_us=50, link_efficiency=efficiency)}
    assert rows["none"].predicted_step_s == pytest.approx(2.0, rel=1e-12)
    assert rows["topk:ratio=0.01"].link_efficiency == efficiency
    # at 100 Mbit/s the dense run is faster than the link allows: the fit clamps at 1
    assert fit_link_efficiency(cmp, latency_us=50) == 1.0


def test_calibrate_cli_and_errors(tmp_path, capsys):
    cmp = _write_compare_dir(tmp_path / "cmp")
    assert main(["simulate", "--calibrate", str(cmp)]) == 0
    out = capsys.readouterr().out
    assert "topk:ratio=0.01" in out and "largest |error|" in out
    assert main(["simulate", "--calibrate", str(cmp), "--bandwidth", "1gbit", "--link-efficiency", "fit"]) == 0
    assert "(fit)" in capsys.readouterr().out
    assert main(["simulate", "--calibrate", str(cmp), "--link-efficiency", "most"]) == 2
    assert "link-efficiency" in capsys.readouterr().err
    assert main(["simulate", "--calibrate", str(_write_compare_dir(tmp_path / "nolimit", limit=False))]) == 2
    assert "limit" in capsys.readouterr().err
    assert main(["simulate", "--calibrate", str(tmp_path / "missing")]) == 2
    loopback = _write_compare_dir(tmp_path / "loop", title="4 workers, loopback")
    assert main(["simulate", "--calibrate", str(loopback)]) == 2
    assert "bandwidth" in capsys.readouterr().err
    assert parse_rate_bits("1gbit") == 1e9 and parse_rate_bits("20mbit") == 20e6 and parse_rate_bits(100) == 100e6
    with pytest.raises(ValueError, match="bandwidth"):
        parse_rate_bits("fast")


def test_projection_writes_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "proj"
    argv = [
        "simulate", "--model", "gpt2", "--gpus", "16", "--cluster", "h100-400ib",
        "--compressors", "none,fp16,topk:ratio=0.01,powersgd:approx_rank=4,start_step=10,onebit-adam",
        "--sweep", "8,32", "--out", str(out), "--price-per-gpu-hour", "2",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| powersgd:approx_rank=4,start_step=10 |" in printed
    data = json.loads((out / "projection.json").read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows)[0] == "limit"
    assert rows["none"]["speedup"] == 1.0
    assert rows["limit"]["speedup"] == pytest.approx(rows["limit"]["limit_speedup"])
    for row in rows.values():
        assert row["usd_per_btok"] == pytest.approx(2 * row["gpu_hours_per_btok"])
        assert row["step_s"] >= rows["limit"]["step_s"] - 1e-12
    assert data["sweep"]["gpus"] == [8, 16, 32]
    assert (out / "speedup_vs_gpus.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "projection.md").exists()
    assert main(["simulate", "--model", "gpt2", "--compressors", "zip", "--no-plot", "--out", str(out)]) == 2
    assert main(["simulate", "--model", "gpt2", "--strategy", "fsdp", "--compressors", "onebit-adam", "--no-plot", "--out", str(out)]) == 2


def test_split_specs_and_codec_speeds():
    assert split_specs("none, powersgd:approx_rank=4,start_step=10,fp16") == [
        "none", "powersgd:approx_rank=4,start_step=10", "fp16",
    ]
    with pytest.raises(ValueError, match="compressors"):
        split_specs("ratio=1,none")
    methods = [Method("fp16"), Method("powersgd:approx_rank=4")]
    speeds = codec_speeds(methods, "fp16=2000,default=300")
    assert speeds["fp16"].encode_bytes_per_s == 2000e9
    assert speeds["powersgd:approx_rank=4"].decode_bytes_per_s == 300e9
    assert codec_speeds(methods, "50")["fp16"].encode_bytes_per_s == 50e9
    with pytest.raises(ValueError, match="codec-gbps"):
        codec_speeds(methods, "fast")


@pytest.mark.parametrize("spec", ["fp16", "topk:ratio=0.01", "powersgd:approx_rank=2", "onebit-adam"])
def test_measured_codec_speed_is_a_finite_rate(spec):
    from gradzip.lab.simulate.codec_speed import measure_codec_speed

    speed = measure_codec_speed(Method(spec), numel=1 << 14, repeats=2)
    assert 0 < speed.encode_bytes_per_s < float("inf") and 0 < speed.decode_bytes_per_s < float("inf")
    assert speed.source.startswith("measured")
    with pytest.raises(ValueError, match="numel"):
        measure_codec_speed(Method(spec), numel=10)


def test_calibrate_two_hosts_and_unrecorded_routes(tmp_path):
    """World size 2 (ring all_reduce sends n, all_gather (p - 1) n), a per-step bucket log without
    its route (the codec's route is used), and the measured comm beside the model's."""
    cmp = _write_compare_dir(tmp_path / "cmp2", title="2 workers, 20mbit links")
    for run in (cmp / "runs").iterdir():
        summary = json.loads((run / "summary.json").read_text())
        summary["world_size"] = 2
        (run / "summary.json").write_text(json.dumps(summary))
    topk_metrics = cmp / "runs" / "topk_ratio_0.01" / "metrics.jsonl"
    bucket = {"0": {"codec": "topk", "payload_bytes": 1_000_000, "compress_s": 0.1, "communicate_s": 1.0}}
    topk_metrics.write_text(json.dumps({"compress_s": 0.2, "decompress_s": 0.05, "buckets": bucket}) + "\n")
    rows = {r.compressor: r for r in calibrate(cmp, latency_us=50)}
    rate = 20e6 / 8 * TCP_GOODPUT
    assert rows["none"].world_size == 2
    assert rows["none"].comm_s == pytest.approx(2 * 50e-6 + 16e6 / rate, rel=1e-12)
    assert rows["none"].predicted_sent_bytes == pytest.approx(16e6)
    topk = rows["topk:ratio=0.01"]
    assert topk.collective == "allgather"
    assert topk.comm_s == pytest.approx(50e-6 + 1e6 / rate, rel=1e-12)
    assert topk.predicted_sent_bytes == pytest.approx(1e6)
    assert rows["none"].measured_comm_s == 1.25 and topk.measured_comm_s == 1.25
    # PyTorch's hooks do not time their collectives; an unfinished run has no measurement
    assert rows["torch:powersgd"].measured_comm_s is None and rows["torch:fp16"].measured_comm_s is None


def _set_summary(run_dir, **fields):
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(fields)
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_link_fitted_on_collective_seconds_of_all_directories(tmp_path, capsys):
    """One fraction for 4 hosts at 100 Mbit/s and 2 hosts at 20 Mbit/s: sum of bandwidth terms over
    sum of measured collective seconds (latency terms removed), whatever compute alone was."""
    four = _write_compare_dir(tmp_path / "four")
    _set_summary(four / "runs" / "none", communicate_s_median=3.0)
    two = _write_compare_dir(tmp_path / "two", title="2 workers, 20mbit links")
    for run in (two / "runs").iterdir():
        _set_summary(run, world_size=2)
    _set_summary(two / "runs" / "none", communicate_s_median=8.0)
    # bandwidth terms at the full rate: 4 ranks 2*3/4*16 MB at 12.5 MB/s, 2 ranks 16 MB at 2.5 MB/s
    b4, b2 = 2 * 3 / 4 * 16e6 / 12.5e6, 16e6 / 2.5e6
    lat4, lat2 = 2 * 3 * 50e-6, 2 * 1 * 50e-6
    expected = (b4 + b2) / (3.0 - lat4 + 8.0 - lat2)
    assert fit_link_efficiency_on_comm([four, two], latency_us=50) == pytest.approx(expected, rel=1e-12)
    assert main(["simulate", "--calibrate", str(four), str(two), "--link-efficiency", "fit-comm"]) == 0
    out = capsys.readouterr().out
    assert f"{expected:.3f} (fitted on the 'none' runs' collective seconds)" in out
    _set_summary(four / "runs" / "none", communicate_s_median=None)
    with pytest.raises(ValueError, match="fit-comm"):
        fit_link_efficiency_on_comm([four], latency_us=50)


def test_a_run_whose_hook_counted_no_bytes_shows_its_model_figures_unknown():
    """PyTorch's PowerSGD hook counts no bytes: the model prices nothing for it, and the table
    says so rather than showing zeros; a priced row shows its figures."""
    from gradzip.lab.simulate.calibrate import CalibrationRow
    from gradzip.lab.simulate.cli import format_calibration

    hook = CalibrationRow("runs/x", "torch:powersgd", 4, 100.0, 1.0, None, 0.8, 0.0, 0.0, 0.0, "unknown", 0.0, 70e6)
    priced = CalibrationRow("runs/x", "fp16", 4, 100.0, 2.0, 1.9, 0.8, 0.05, 1.05, 7.4e6, "allreduce", 11.1e6, 12e6)
    hook_line, priced_line = format_calibration([hook, priced]).splitlines()[2:]
    cells = [c.strip() for c in hook_line.strip("|").split("|")]
    assert cells[9:] == ["-", "- / -", "- / 70.00"], cells
    cells = [c.strip() for c in priced_line.strip("|").split("|")]
    assert cells[6:] == ["1.900", "-5.0%", "0.800", "0.050", "1.050 / -", "11.10 / 12.00"], cells
