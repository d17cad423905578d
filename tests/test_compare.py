"""``gradzip compare``: the figures from known runs, the orchestration (hung and crashed runs,
emulated hosts) with a stand-in trainer, and a smoke run of the real main job on loopback.

The stand-in trainer is ``helpers/fake_train.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from helpers.fake_train import FAKE_PAYLOAD, HELLO_BYTES, fake_records

from gradzip.lab.cluster import Host, support_problem
from gradzip.lab.cluster.netns import list_namespaces
from gradzip.lab.cluster.schedule import RateChange, parse_link_schedule
from gradzip.lab.compare import (
    CompareConfig,
    compare_rows,
    rewrite_report,
    run_compare,
    split_compressors,
    time_to_target,
)
from gradzip.lab.compare.core import run_folder
from gradzip.lab.compare.runner import RUN_FILE, Emulated, RunResult, _death

FAKE_PREFIX = (sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "fake_train.py"))


def test_split_compressors():
    assert split_compressors("none,fp16,powersgd:approx_rank=4,topk:ratio=0.01") == [
        "none", "fp16", "powersgd:approx_rank=4", "topk:ratio=0.01"]  # fmt: skip
    assert split_compressors("qsgd:bits=4,bucket=512, torch:powersgd:approx_rank=2,") == [
        "qsgd:bits=4,bucket=512", "torch:powersgd:approx_rank=2"]  # fmt: skip
    with pytest.raises(ValueError, match="limit"):
        CompareConfig(compressors=["limit"]).validate()
    with pytest.raises(ValueError, match="--world-size"):
        CompareConfig(compressors=["fp16"], world_size=0).validate()
    with pytest.raises(ValueError, match="bandwidth"):
        CompareConfig(compressors=["fp16"], bandwidth="fast").validate()
    assert CompareConfig(compressors=["fp16", "none"]).entries() == ["limit", "none", "fp16"]


def test_link_schedule_from_the_command_line():
    from gradzip.lab.cli import build_parser
    from gradzip.lab.compare.cli import config

    args = build_parser().parse_args(["compare", "--network", "emulated", "--link-schedule", "40:20mbit,80:1gbit",
                                      "--steps", "120", "--compressors", "kimad"])  # fmt: skip
    cfg = config(args).validate()
    assert cfg.link_schedule == "40:20mbit,80:1gbit"
    assert cfg.link_changes() == [RateChange(40, 20_000_000), RateChange(80, 1_000_000_000)]
    assert config(build_parser().parse_args(["compare"])).link_changes() == []


@pytest.mark.parametrize("argv, words", [
    (["--link-schedule", "5:20mbit"], "needs --network emulated; got --network auto"),
    (["--link-schedule", "5:20mbit", "--network", "loopback"], "needs --network emulated; got --network loopback"),
    (["--link-schedule", "5-20mbit", "--network", "emulated"], "--link-schedule must be STEP:RATE pairs"),
    (["--link-schedule", "5:20mbit,3:1gbit", "--network", "emulated"], "--link-schedule: steps must increase"),
    (["--link-schedule", "5:fast", "--network", "emulated"], "--link-schedule: bandwidth"),
    (["--link-schedule", "8:20mbit", "--network", "emulated"], "--link-schedule: step 8 is past the last step"),
    (["--no-baseline"], "--no-baseline leaves out the 'none' row, whose final loss sets the default target"),
])  # fmt: skip
def test_refusals_before_any_worker(argv, words, tmp_path, capsys):
    from gradzip.lab.cli import main

    out = tmp_path / "cmp"
    assert main(["compare", "--steps", "8", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gradzip: error: ") and words in err, err
    assert not out.exists()  # refused before the output folder, let alone a worker


def test_each_scheduled_run_starts_at_the_cluster_rate(tmp_path):
    calls: list[int] = []

    class Recorder:  # a cluster as the schedule and Emulated see it
        bandwidth_bits = 1_000_000_000
        hosts = [Host(0, "gz-test-h0", "10.0.0.1")]

        def set_bandwidth(self, bits):
            calls.append(bits)
            self.bandwidth_bits = bits

    network = Emulated(Recorder())
    for run in range(2):
        metrics = tmp_path / f"metrics{run}.jsonl"
        metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)))
        with network.link_schedule(parse_link_schedule("2:20mbit"), metrics) as schedule:
            deadline = time.monotonic() + 10
            while not schedule.applied and time.monotonic() < deadline:
                time.sleep(0.01)
        assert [(a.change.step, a.recorded_before) for a in schedule.applied] == [(2, 3)]
    # each run: back to the cluster's own rate first, then the schedule's change
    assert calls == [1_000_000_000, 20_000_000, 1_000_000_000, 20_000_000]


def test_rows_from_known_runs():
    results = [RunResult(label, Path("."), records=fake_records(label, 8)) for label in ("limit", "none", "fp16")]
    for r in results:
        r.summary = {"final_val_loss": r.records[-1]["val_loss"], "wall_s": r.records[-1]["elapsed_s"]}
        r.tx_bytes = [HELLO_BYTES + 3 * FAKE_PAYLOAD[r.label], HELLO_BYTES + 5 * FAKE_PAYLOAD[r.label]]
    timeout = RunResult("topk:ratio=0.01", Path("."), status="timeout", error="stopped", records=[])
    rows, target = compare_rows([*results, timeout])
    by = {r["compressor"]: r for r in rows}
    # target: final val of none (6 - 0.5 * 8 = 2.0) + 1 %; reached at step 7 (val 2.0)
    assert target["target_loss"] == pytest.approx(2.02)
    assert by["none"]["time_to_target_s"] == pytest.approx(8 * 0.4)
    assert by["fp16"]["time_to_target_s"] == pytest.approx(8 * 0.25)
    assert by["limit"]["time_to_target_s"] is None
    assert by["fp16"]["time_to_target_speedup"] == pytest.approx(0.4 / 0.25)
    # speedups: none / run; the limit 0.4 / 0.1 = 4x; fp16 1.6x = 40 % of it
    assert by["limit"]["speedup"] == pytest.approx(4.0)
    assert by["fp16"]["speedup"] == pytest.approx(1.6)
    assert by["fp16"]["fraction_of_limit"] == pytest.approx(0.4)
    assert by["none"]["fraction_of_limit"] == pytest.approx(0.25)
    assert by["fp16"]["payload_bytes"] == 8 * 100_000
    assert by["fp16"]["compression_ratio"] == pytest.approx(2.0)
    assert by["fp16"]["sent_bytes"] == 8 * 100_000 and by["limit"]["sent_bytes"] == 0
    # wire: mean over hosts; exchange = minus the limit row's (hello bytes only)
    assert by["fp16"]["wire_bytes"] == pytest.approx(HELLO_BYTES + 4 * 100_000)
    assert by["fp16"]["wire_bytes_exchange"] == pytest.approx(4 * 100_000)
    assert by["topk:ratio=0.01"]["status"] == "timeout" and by["topk:ratio=0.01"]["speedup"] is None
    # explicit target; one never reached
    rows, target = compare_rows(results, target_loss=1.0)
    assert target["target_source"] == "--target-loss"
    assert all(r["time_to_target_s"] is None for r in rows)
    assert time_to_target(fake_records("none", 4), 5.0) == pytest.approx(0.8)


def test_target_margin_moves_the_default_target():
    results = [RunResult(label, Path("."), records=fake_records(label, 8)) for label in ("none", "fp16")]
    for r in results:
        r.summary = {"final_val_loss": r.records[-1]["val_loss"], "wall_s": r.records[-1]["elapsed_s"]}
    rows, target = compare_rows(results, target_margin=0.5)
    # none ends at 2.0, so a 50 % margin puts the target at 3.0, first reached at val 3.0 (step 5)
    assert target["target_loss"] == pytest.approx(3.0)
    assert "plus 50%" in target["target_source"]
    by = {r["compressor"]: r for r in rows}
    assert by["none"]["time_to_target_s"] == pytest.approx(6 * 0.4)
    with pytest.raises(ValueError, match="--target-margin"):
        CompareConfig(compressors=["fp16"], target_margin=1.5).validate()


def _fake_config(tmp_path: Path, compressors: list[str], **kw) -> CompareConfig:
    return CompareConfig(
        compressors=compressors, world_size=2, steps=4, out=str(tmp_path / "cmp"), train_prefix=FAKE_PREFIX,
        train_options={"eval_every": 2}, **kw,
    )  # fmt: skip


@pytest.mark.e2e
def test_orchestration_hung_and_crashed_runs(tmp_path):
    lines = []
    cfg = _fake_config(tmp_path, ["fp16", "hang", "crash"], network="loopback", timeout_s=3.0)
    rows = run_compare(cfg, log=lines.append)
    by = {r["compressor"]: r for r in rows}
    assert [r["compressor"] for r in rows] == ["limit", "none", "fp16", "hang", "crash"]
    assert by["hang"]["status"] == "timeout" and "3 s" in by["hang"]["error"]
    assert by["crash"]["status"] == "failed" and by["crash"]["error"] == "rank 1: RuntimeError: boom on rank 1"
    assert by["fp16"]["status"] == "ok" and by["fp16"]["speedup"] == pytest.approx(1.6)
    assert by["fp16"]["time_to_target_s"] == pytest.approx(1.0) and by["fp16"]["wire_bytes"] is None
    # a line per run, then the summary (the target, a header, a row per entry) and where the report is
    assert len(lines) == 5 + 2 + 5 + 1 and lines[3].startswith("[4/5] hang") and "timeout" in lines[3]
    assert lines[5].startswith("target validation loss") and lines[-1].startswith(f"wrote {cfg.out}/report.md")
    assert lines[10].startswith("hang (timeout)") and lines[11].startswith("crash (failed)")

    out = Path(cfg.out)
    saved = json.loads((out / "results.json").read_text())
    required = {"compressor", "wall_s", "step_s", "time_to_target_s", "final_val_loss", "wire_bytes",
                "payload_bytes", "speedup", "fraction_of_limit"}  # fmt: skip
    assert [r["compressor"] for r in saved] == [r["compressor"] for r in rows]
    assert all(required <= set(r) for r in saved)
    report = (out / "report.md").read_text()
    assert "**loopback**" in report and "asked for with --network loopback" in report
    assert "`hang`: **timeout** after 0 steps" in report and "`crash`: **failed**" in report
    assert (out / "loss_vs_time.png").stat().st_size > 0 and (out / "loss_vs_bytes.png").stat().st_size > 0

    # --report-only: the same rows from the saved runs; a new target changes only what depends on it
    again = rewrite_report(out, target_loss=5.0, log=lambda line: None)
    assert [r["status"] for r in again] == [r["status"] for r in rows]
    assert {r["compressor"]: r["time_to_target_s"] for r in again if r["status"] == "ok"} == {
        "limit": None, "none": pytest.approx(2 * 0.4), "fp16": pytest.approx(2 * 0.25)}  # fmt: skip
    assert [r["step_s"] for r in again] == [r["step_s"] for r in rows]
    assert "This report: `gradzip compare --report-only" not in report  # the first report ran the runs
    rewritten = (out / "report.md").read_text()
    assert f"- This report: `gradzip compare --report-only --target-loss 5 --out {out}`" in rewritten


@pytest.mark.e2e
def test_repeats_run_every_row_once_per_round(tmp_path):
    lines = []
    cfg = _fake_config(tmp_path, ["fp16"], network="loopback", repeats=2)
    rows = run_compare(cfg, log=lines.append)
    # two rounds of the three rows, in order
    assert [line.split()[:2] for line in lines[:6]] == [
        ["[1/6]", "limit"], ["[2/6]", "none"], ["[3/6]", "fp16"], ["[4/6]", "limit"], ["[5/6]", "none"], ["[6/6]", "fp16"]]
    out = Path(cfg.out)
    for label in ("limit", "none", "fp16"):
        assert (out / "runs" / label / "metrics.jsonl").exists()
        assert (out / "runs" / "repeat2" / label / "metrics.jsonl").exists()
    by = {r["compressor"]: r for r in rows}
    assert all(r["repeats"] == 2 and r["status"] == "ok" for r in rows)
    assert by["fp16"]["speedup"] == pytest.approx(1.6)  # the stand-in's step times are the same in both rounds
    assert "Every row ran 2 times, in rounds" in (out / "report.md").read_text()
    again = rewrite_report(out, log=lambda line: None)
    assert [(r["compressor"], r["repeats"], r["step_s"]) for r in again] == [
        (r["compressor"], r["repeats"], r["step_s"]) for r in rows]


@pytest.mark.e2e
def test_no_baseline_runs_no_none_row_and_times_the_given_target(tmp_path):
    lines = []
    cfg = _fake_config(tmp_path, ["fp16"], network="loopback", baseline=False, target_loss=1e5)
    rows = run_compare(cfg, log=lines.append)
    assert [line.split()[:2] for line in lines[:2]] == [["[1/2]", "limit"], ["[2/2]", "fp16"]]
    assert not (Path(cfg.out) / "runs" / "none").exists()
    by = {r["compressor"]: r for r in rows}
    assert set(by) == {"limit", "fp16"}
    assert by["fp16"]["speedup"] is None  # no 'none' row to take a ratio against
    # every validation is below a target of 1e5: reached at the first one, as the run recorded it
    records = [json.loads(line) for line in (Path(cfg.out) / "runs" / "fp16" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "val_loss" in r)
    assert by["fp16"]["time_to_target_s"] == pytest.approx(first["elapsed_s"])
    assert "- Target validation loss: 100000.0000 (--target-loss)." in (Path(cfg.out) / "report.md").read_text()
    # --report-only keeps the comparison's own --target-loss
    again = {r["compressor"]: r for r in rewrite_report(cfg.out, log=lambda line: None)}
    assert again["fp16"]["time_to_target_s"] == pytest.approx(first["elapsed_s"])
    # and checks a new one as a comparison does
    for bad in (-5, 0, 1e308, float("nan")):
        with pytest.raises(ValueError, match="--target-loss"):
            rewrite_report(cfg.out, target_loss=bad, log=lambda line: None)
    # a damaged setup.json is named in one error, whatever it holds
    setup = Path(cfg.out) / "setup.json"
    for text in ("[]", '{"entries": 5}', '{"entries": ["fp16"], "repeats": 0}', "{bad"):
        setup.write_text(text)
        with pytest.raises(ValueError, match="setup.json is not"):
            rewrite_report(cfg.out, log=lambda line: None)


@pytest.mark.e2e
@pytest.mark.skipif(support_problem(pin_cpus=True) is not None, reason=str(support_problem(pin_cpus=True)))
def test_orchestration_on_emulated_hosts(tmp_path):
    # (the schedule's rate is above what the stand-in sends, so the byte counts below hold)
    cfg = _fake_config(tmp_path, ["fp16"], network="emulated", bandwidth="1gbit", link_schedule="2:500mbit")
    rows = run_compare(cfg, log=lambda line: None)
    by = {r["compressor"]: r for r in rows}
    assert all(r["status"] == "ok" for r in rows), rows
    for row in rows:  # each run's own change, once its step 1 was recorded
        [change] = row["link_changes"]
        assert (change["step"], change["rate"]) == (2, "500mbit"), row
        assert 1 <= change["recorded_before"] <= change["recorded_after"] <= 3, row
    for label, row in by.items():
        # rank 1 sent HELLO_BYTES + steps * payload to rank 0; TCP/IP/Ethernet headers <= 5 %
        # plus connection set-up and teardown (a few packets)
        sent = HELLO_BYTES + 4 * FAKE_PAYLOAD[label]
        assert sent <= row["wire_bytes_per_host"][1] <= 1.05 * sent + 16 * 1024, (label, row)
        assert row["wire_bytes"] == pytest.approx(sum(row["wire_bytes_per_host"]) / 2)
    assert by["fp16"]["wire_bytes_exchange"] == pytest.approx(by["fp16"]["wire_bytes"] - by["limit"]["wire_bytes"])
    report = (Path(cfg.out) / "report.md").read_text()
    assert "emulated hosts" in report and "1gbit in each direction" in report and "wire MB/rank" in report
    # the bucket of 1 Gbit/s links: 1 ms at the rate, 125,000 bytes
    assert "a `tbf` qdisc (a bucket of 125,000 bytes)" in report
    assert "Link schedule: `2:500mbit`" in report and "- `fp16`: 500mbit for step 2 (recorded " in report
    saved = json.loads((Path(cfg.out) / "results.json").read_text())
    assert [r["link_changes"] for r in saved] == [r["link_changes"] for r in rows]
    assert not [n for n in list_namespaces() if n.startswith(f"gz-{os.getpid():06x}")]
    # each host's worker ran on its own share of the CPUs: 2 hosts take every other CPU, or
    # with a single CPU both share it
    cpus = sorted(os.sched_getaffinity(0))
    shares = [cpus[0::2], cpus[1::2]] if len(cpus) >= 2 else [cpus, cpus]
    setup = json.loads((Path(cfg.out) / "setup.json").read_text())
    assert setup["host_cpus"] == shares
    for run in (Path(cfg.out) / "runs").iterdir():
        ran_on = [json.loads((run / f"cpus_rank{r}.json").read_text()) for r in range(2)]
        assert ran_on == shares, (run, ran_on)
    assert f"host 0 on {', '.join(map(str, shares[0]))}; host 1 on {', '.join(map(str, shares[1]))}" in report

    # --no-pin-cpus: the kernel places them, each free to run on any CPU
    free = _fake_config(tmp_path / "free", ["fp16"], network="emulated", bandwidth="1gbit", pin_cpus=False, limit=False)
    run_compare(free, log=lambda line: None)
    assert json.loads((Path(free.out) / "setup.json").read_text())["host_cpus"] is None
    for run in (Path(free.out) / "runs").iterdir():
        assert [json.loads((run / f"cpus_rank{r}.json").read_text()) for r in range(2)] == [cpus, cpus]
    report = (Path(free.out) / "report.md").read_text()
    assert "placed by the kernel" in report
    # --no-limit: the report does not describe a limit row it does not have
    assert "no `limit` row (`--no-limit`)" in report and "the `limit` row's workers" not in report.lower()
    assert "`wire for exchange` needs the `limit` row" in report and "subtracts the `limit`" not in report


@pytest.mark.e2e
def test_smoke_real_main_job_on_loopback(tmp_path):
    from gradzip.lab.cli import main

    out = tmp_path / "smoke"
    code = main(["compare", "--compressors", "none,fp16", "--network", "loopback", "--world-size", "2",
                 "--steps", "3", "--eval-every", "3", "--eval-batches", "1", "--n-layer", "1", "--n-embd", "32",
                 "--n-head", "2", "--seq-len", "32", "--batch-size", "2", "--no-limit", "--out", str(out)])  # fmt: skip
    assert code == 0
    rows = {r["compressor"]: r for r in json.loads((out / "results.json").read_text())}
    # (the limit row's orchestration is covered above with the stand-in; two real runs keep this short)
    assert list(rows) == ["none", "fp16"] and all(r["status"] == "ok" for r in rows.values())
    # bits are bits: fp16 hands 2 bytes per element to the all_reduce, none 4
    assert rows["none"]["payload_bytes"] == 2 * rows["fp16"]["payload_bytes"] > 0
    assert rows["none"]["final_val_loss"] == pytest.approx(rows["fp16"]["final_val_loss"], abs=1e-2)
    assert rows["none"]["speedup"] == 1.0 and rows["fp16"]["speedup"] > 0
    assert (out / "report.md").exists() and (out / "loss_vs_bytes.png").exists()
    assert not (out / "runs" / "fp16" / "checkpoints").exists()


def test_a_rank_a_signal_ended_is_reported_by_the_signal():
    """Its log's last line says nothing of the cause; SIGKILL names the usual sender."""
    import signal

    assert _death(0) is None and _death(1) is None
    assert _death(-signal.SIGKILL).startswith("killed by SIGKILL (the kernel's out-of-memory killer")
    assert _death(-signal.SIGSEGV) == "killed by SIGSEGV"


def test_the_terminal_summary_aligns_the_first_figures_of_every_entry():
    from gradzip.lab.compare.report import summary_lines

    def row(name, step_s, speedup, ttt, loss, sent, status="ok"):
        return {"compressor": name, "status": status, "step_s": step_s, "speedup": speedup, "time_to_target_s": ttt,
                "final_val_loss": loss, "sent_bytes": sent}

    lines = summary_lines([row("limit", 0.5, 4.0, None, 5.8, 0), row("none", 2.0, 1.0, 100.0, 5.6, 1e9),
                           row("powersgd:approx_rank=4", 0.9, 2.22, None, 5.7, 2.5e7, status="failed")], 5.656)
    assert lines[0] == "target validation loss 5.6560"
    assert lines[1].split() == ["compressor", "step", "s", "speedup", "time", "to", "target", "s", "final", "val", "loss",
                                "sent", "MB/rank"]
    assert lines[2].split() == ["limit", "0.500", "4.00x", "n/a", "5.8000", "0.0"]
    assert lines[3].split()[:5] == ["none", "2.000", "1.00x", "100", "5.6000"]
    assert lines[4].startswith("powersgd:approx_rank=4 (failed)") and "not reached" in lines[4]
    assert len({len(line) for line in lines[1:]}) == 1  # aligned columns


def test_the_report_shows_a_hooks_uncounted_codec_and_comm_seconds_as_unknown():
    from gradzip.lab.compare.report import table

    def row(name, payload):
        return {"compressor": name, "status": "ok", "wall_s": 40.0, "step_s": 0.9, "speedup": 3.0,
                "fraction_of_limit": 1.0, "time_to_target_s": 41.5, "compute_utilisation": 0.9,
                "time_to_target_speedup": 2.5, "final_val_loss": 5.7, "compute_s": 1.187, "compress_s": 0.0,
                "communicate_s": 0.0, "payload_bytes": payload, "sent_bytes": payload}

    lines = table([row("torch:powersgd", None), row("powersgd", 14.4e6)], wire=False).splitlines()
    hook, ours = ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    assert hook[10:] == ["1.187 / - / -", "unknown", "unknown"], hook
    assert ours[10:] == ["1.187 / 0.000 / 0.000", "14.4", "14.4"], ours


@pytest.mark.e2e
def test_a_stopped_comparison_is_reported_from_the_runs_it_finished(tmp_path):
    """A comparison clears an earlier one's outputs and writes its setup first, so that one stopped
    part way (here: its last run's record removed, as if it never ended) is reported from the
    entries that finished, and a later round that did not finish is left out."""
    cfg = _fake_config(tmp_path, ["fp16"], network="loopback")
    out = Path(cfg.out)
    stale = out / "runs" / "old-entry"
    stale.mkdir(parents=True)
    (out / "report.md").write_text("an earlier comparison's report\n")
    run_compare(cfg, log=lambda line: None)
    assert not stale.exists() and "an earlier comparison" not in (out / "report.md").read_text()

    (run_folder(out, "fp16", 0) / RUN_FILE).unlink()  # the comparison stopped during its last run
    lines = []
    rows = rewrite_report(out, log=lines.append)
    assert [r["compressor"] for r in rows] == ["limit", "none"]
    assert lines[0] == ("gradzip compare: the comparison was stopped; the report covers the 2 of 3 entries that "
                        "finished (limit, none)")
    for name in ("limit", "none"):
        (run_folder(out, name, 0) / RUN_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="no run of the comparison finished"):
        rewrite_report(out, log=lines.append)

    cfg = _fake_config(tmp_path, ["fp16"], network="loopback", repeats=2)
    run_compare(cfg, log=lambda line: None)
    (run_folder(out, "none", 1) / RUN_FILE).unlink()  # stopped in its second round
    lines = []
    rows = rewrite_report(out, log=lines.append)
    assert [r["compressor"] for r in rows] == ["limit", "none", "fp16"]
    assert lines[0] == "gradzip compare: 1 of 2 rounds finished; the report covers those"
