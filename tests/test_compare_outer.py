"""``gradzip compare`` with DiLoCo entries: how an entry becomes a ``gradzip train`` command, its
checks before any run, and compute utilisation from mean step times."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from helpers.fake_train import FAKE_PAYLOAD, HELLO_BYTES

from gradzip.lab.cluster import support_problem
from gradzip.lab.compare import CompareConfig, compare_rows, run_compare, split_compressors
from gradzip.lab.compare.analysis import merge_repeats
from gradzip.lab.compare.core import _check_specs
from gradzip.lab.compare.report import table
from gradzip.lab.compare.runner import RunResult, train_command

FAKE_PREFIX = (sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "fake_train.py"))
ENTRY = "diloco:sync_every=20,fragments=2+uniform:bits=8"


def test_diloco_entry_is_one_spec_and_runs_as_outer():
    assert split_compressors(f"none,{ENTRY},topk:ratio=0.01") == ["none", ENTRY, "topk:ratio=0.01"]
    argv = train_command(ENTRY, out_dir=Path("o"), steps=40, seed=0, collective_timeout_s=60, no_exchange=False,
                         options={}, prefix=("train",))
    assert argv[1:7] == ["--outer", "diloco:sync_every=20,fragments=2", "--outer-compressor", "uniform:bits=8",
                         "--compressor", "none"]
    argv = train_command("diloco:sync_every=5", out_dir=Path("o"), steps=40, seed=0, collective_timeout_s=60,
                         no_exchange=False, options={}, prefix=("train",))
    assert argv[1:7] == ["--outer", "diloco:sync_every=5", "--outer-compressor", "none", "--compressor", "none"]


@pytest.mark.parametrize(("entry", "message"), [
    ("diloco:sync_every=0", "sync_every must be an integer >= 1"),
    ("diloco:sync_every=4+auto", "'auto' cannot run on the outer exchange"),
    ("diloco:sync_every=4,delay=9", "delay must be an integer in [0, 3]"),
])
def test_bad_diloco_entry_fails_before_any_run(tmp_path, entry, message):
    cfg = CompareConfig(compressors=[entry], world_size=2, steps=8, out=str(tmp_path / "c")).validate()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _check_specs(cfg)


def _records(step_times: list[float]) -> list[dict]:
    elapsed, out = 0.0, []
    for step, step_s in enumerate(step_times):
        elapsed += step_s
        out.append({"step": step, "loss": 5.0, "elapsed_s": elapsed, "step_s": step_s, "payload_bytes": 0,
                    "dense_bytes": 100, "val_loss": 5.0 - 0.1 * step})
    return out


def test_compute_utilisation_uses_mean_step_times():
    limit = RunResult("limit", Path("."), records=_records([0.1] * 8))
    none = RunResult("none", Path("."), records=_records([0.4] * 8))
    # an exchange every 4th step: the median step is compute alone, the mean is not
    diloco = RunResult("diloco:sync_every=4", Path("."), records=_records([0.1, 0.1, 0.1, 0.5] * 2))
    for r in (limit, none, diloco):
        r.summary = {"final_val_loss": r.records[-1]["val_loss"], "wall_s": r.records[-1]["elapsed_s"]}
    rows, _ = compare_rows([limit, none, diloco])
    by = {r["compressor"]: r for r in rows}
    assert by["diloco:sync_every=4"]["step_s"] == pytest.approx(0.1)
    assert by["diloco:sync_every=4"]["compute_utilisation"] == pytest.approx(0.1 / 0.2)
    assert by["none"]["compute_utilisation"] == pytest.approx(0.25)
    assert by["limit"]["compute_utilisation"] == pytest.approx(1.0)
    lines = table(rows, wire=False).splitlines()
    column = lines[0].split(" | ").index("compute util")
    assert lines[4].split(" | ")[column] == "50.0%"
    # without the limit row there is no compute-alone step time to compare with
    rows, _ = compare_rows([none, diloco])
    assert all(r["compute_utilisation"] is None for r in rows)


def test_repeats_compare_each_round_within_itself_then_take_medians():
    def round_of(limit_s, diloco_s, reached):
        limit = RunResult("limit", Path("."), records=_records([limit_s] * 8))
        none = RunResult("none", Path("."), records=_records([0.4] * 8))
        diloco = RunResult("diloco:sync_every=4", Path("."), records=_records([diloco_s] * 8))
        if not reached:  # this round's run never gets below the target
            diloco.records = [{**r, "val_loss": 9.0} for r in diloco.records]
        for r in (limit, none, diloco):
            r.summary = {"final_val_loss": 4.3, "wall_s": r.records[-1]["elapsed_s"]}
        return compare_rows([limit, none, diloco], target_loss=4.75)[0]

    # a slow second round: the limit's step too; utilisation per round 0.5, 0.8, 0.8
    rounds = [round_of(0.1, 0.2, True), round_of(0.2, 0.25, True), round_of(0.1, 0.125, False)]
    by = {r["compressor"]: r for r in merge_repeats(rounds)}
    diloco = by["diloco:sync_every=4"]
    # the median of the rounds' ratios, not the ratio of the medians (0.1 / 0.2 = 0.5)
    assert diloco["compute_utilisation"] == pytest.approx(0.8)
    assert diloco["compute_utilisation_range"] == pytest.approx([0.5, 0.8])
    assert diloco["mean_step_s"] == pytest.approx(0.2) and diloco["repeats"] == 3
    # val 4.7 at step 3: 4 steps in; the round that never reached it counts as slowest
    assert diloco["time_to_target_s"] == pytest.approx(4 * 0.25)
    assert diloco["time_to_target_s_range"] == pytest.approx([4 * 0.2, 4 * 0.25])
    lines = table(list(by.values()), wire=False).splitlines()
    column = lines[0].split(" | ").index("compute util")
    assert lines[4].split(" | ")[column] == "80.0% (50.0% to 80.0%)"
    # most rounds never reaching the target: not reached
    rounds = [round_of(0.1, 0.2, False), round_of(0.1, 0.2, False), round_of(0.1, 0.2, True)]
    assert merge_repeats(rounds)[2]["time_to_target_s"] is None
    with pytest.raises(ValueError, match=r"--repeats must be an integer in \[1, 20\]"):
        CompareConfig(compressors=["fp16"], repeats=0).validate()


def test_diloco_entry_takes_one_replica_per_host():
    argv = train_command("diloco:sync_every=5", out_dir=Path("o"), steps=40, seed=0, collective_timeout_s=60,
                         no_exchange=False, options={}, prefix=("train",), replica_size=2)
    assert argv[7:9] == ["--replica-size", "2"]
    argv = train_command("fp16", out_dir=Path("o"), steps=40, seed=0, collective_timeout_s=60,
                         no_exchange=False, options={}, prefix=("train",), replica_size=2)
    assert "--replica-size" not in argv  # DDP entries span every rank
    with pytest.raises(ValueError, match="--ranks-per-host must divide --world-size=4; got 3"):
        CompareConfig(compressors=["fp16"], world_size=4, ranks_per_host=3).validate()


@pytest.mark.e2e
@pytest.mark.skipif(support_problem(pin_cpus=True) is not None, reason=str(support_problem(pin_cpus=True)))
def test_ranks_on_one_host_talk_past_its_link(tmp_path):
    # the stand-in trainer: rank 1 sends a greeting and a payload per step to rank 0
    cfg = CompareConfig(compressors=["fp16"], world_size=2, ranks_per_host=2, steps=4, out=str(tmp_path / "cmp"),
                        train_prefix=FAKE_PREFIX, train_options={"eval_every": 2}, network="emulated",
                        bandwidth="1gbit")
    rows = run_compare(cfg, log=lambda line: None)
    assert all(r["status"] == "ok" for r in rows), rows
    for row in rows:
        # one host; what rank 1 sent rank 0 never crossed its interface
        assert len(row["wire_bytes_per_host"]) == 1
        assert row["wire_bytes_per_host"][0] < HELLO_BYTES + 4 * FAKE_PAYLOAD["fp16"], row
    assert "1 emulated hosts with 2 workers each" in (Path(cfg.out) / "report.md").read_text()


@pytest.mark.e2e
def test_real_diloco_entry_beside_ddp_on_loopback(tmp_path):
    import json

    from gradzip.lab.cli import main

    out = tmp_path / "smoke"
    code = main(["compare", "--compressors", "none,diloco:sync_every=2", "--network", "loopback", "--world-size", "2",
                 "--steps", "4", "--eval-every", "4", "--eval-batches", "1", "--n-layer", "1", "--n-embd", "32",
                 "--n-head", "2", "--seq-len", "32", "--batch-size", "2", "--out", str(out)])  # fmt: skip
    assert code == 0
    rows = {r["compressor"]: r for r in json.loads((out / "results.json").read_text())}
    assert list(rows) == ["limit", "none", "diloco:sync_every=2"] and all(r["status"] == "ok" for r in rows.values())
    # the identity codec every 2 steps: half of DDP's dense payload over the run
    assert rows["none"]["payload_bytes"] == 2 * rows["diloco:sync_every=2"]["payload_bytes"] > 0
    assert rows["diloco:sync_every=2"]["compression_ratio"] == 2
    assert all(0 < rows[k]["compute_utilisation"] for k in rows)
    assert "compute util" in (out / "report.md").read_text()
