"""Faults in the main job: injected inf and NaN skipped by every rank together, leaving the state
as it was; a worker killed mid-run stops the others in bounded time, with one line each."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.tiny_run import load, same, tiny_config, without_plots, write_corpus

from gradzip.lab.train.checkpoint import find_checkpoint
from gradzip.lab.train.faults import ENV, parse_faults
from gradzip.lab.train.loop import train_worker
from gradzip.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
BAD_STEPS = {2: "inf", 4: "nan"}  # step -> value injected (rank 1 at step 2, rank 0 at step 4)


def _nonfinite_worker(rank: int, world_size: int, base: str, data: str, runs: dict[str, dict]) -> dict:
    without_plots()
    os.environ[ENV] = "nonfinite:rank=1,step=2,value=inf+nonfinite:rank=0,step=4,value=nan"
    results = {}
    for spec, options in runs.items():
        out = Path(base) / spec.replace(":", "_")
        train_worker(tiny_config(data, str(out), world_size=world_size, steps=6, checkpoint_every=1,
                                 keep_checkpoints=0, **options))
        folders = {step: out / "checkpoints" / f"step-{step:06d}" for step in range(1, 7)}
        entry = {}
        for bad in BAD_STEPS:
            # step-S holds the state right before step S ran, step-(S+1) the state right after.
            before, after = folders[bad], folders[bad + 1]
            mine_before, mine_after = load(before, f"rank-{rank}.pt"), load(after, f"rank-{rank}.pt")
            entry[f"hook_unchanged_{bad}"] = same(mine_before["hook"]["reducer"], mine_after["hook"]["reducer"])
            entry[f"own_optimizer_unchanged_{bad}"] = same(mine_before["optimizer"], mine_after["optimizer"])
            entry[f"data_advanced_{bad}"] = not same(mine_before["data_generator"], mine_after["data_generator"])
            if rank == 0:
                shared_before, shared_after = load(before, "shared.pt"), load(after, "shared.pt")
                for part in ("model", "optimizer", "scheduler"):
                    entry[f"{part}_unchanged_{bad}"] = same(shared_before[part], shared_after[part])
        if rank == 0:
            shared_1, shared_2 = load(folders[1], "shared.pt"), load(folders[2], "shared.pt")
            entry["good_step_changed_model"] = not same(shared_1["model"], shared_2["model"])
            entry["skipped"] = [json.loads(line)["skipped"] for line in (out / "metrics.jsonl").read_text().splitlines()]
            entry["summary_skipped"] = json.loads((out / "summary.json").read_text())["skipped_steps"]
        results[spec] = entry
    return results


@pytest.mark.dist
def test_nonfinite_steps_are_skipped_by_all_ranks_and_leave_no_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    runs = {
        "topk": {"compressor": "topk:ratio=0.1"},
        "powersgd": {"compressor": "powersgd:approx_rank=4"},
        # each rank its own gradient after step 1: the ranks must still skip together
        "onebit-adam": {"compressor": "none", "optimizer": "onebit-adam:warmup_steps=1"},
    }
    results = run_ranks(_nonfinite_worker, 2, str(tmp_path), data, runs, timeout_s=300)
    for rank, per_spec in enumerate(results):
        for spec, entry in per_spec.items():
            for bad in BAD_STEPS:
                assert entry[f"hook_unchanged_{bad}"], f"{spec}: rank {rank} error feedback changed by skipped step {bad}"
                assert entry[f"data_advanced_{bad}"], f"{spec}: the skipped step {bad} did not consume its batch"
                assert entry[f"own_optimizer_unchanged_{bad}"], f"{spec}: rank {rank} optimizer buffers changed by skipped step {bad}"
                if rank == 0:
                    for part in ("model", "optimizer", "scheduler"):
                        assert entry[f"{part}_unchanged_{bad}"], f"{spec}: {part} changed by skipped step {bad}"
            if rank == 0:
                assert entry["good_step_changed_model"], f"{spec}: a finite step did not train"
                assert entry["skipped"] == [step in BAD_STEPS for step in range(6)], entry["skipped"]
                assert entry["summary_skipped"] == len(BAD_STEPS)


def test_fault_specs_are_checked():
    assert parse_faults(None) == []
    (fault,) = parse_faults("exit:rank=1,step=4,code=3")
    assert (fault.kind, fault.rank, fault.step, fault.code) == ("exit", 1, 4, 3)
    for bad in ("explode:rank=1,step=2", "exit:rank=1", "nonfinite:rank=0,step=1,value=2.5", "exit:rank=-1,step=2"):
        with pytest.raises(ValueError, match=ENV):
            parse_faults(bad)


@pytest.mark.e2e
def test_killed_worker_stops_the_others_in_bounded_time(tmp_path):
    data = write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "run"
    timeout_s = 30
    env = dict(os.environ, GRADZIP_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT), **{ENV: "exit:rank=1,step=4,code=3"})
    cmd = [sys.executable, "-m", "gradzip", "train", "--data", data, "--vocab-size", "300", "--seq-len", "32",
           "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "2", "--threads", "1",
           "--compressor", "topk:ratio=0.1", "--world-size", "3", "--steps", "100000", "--checkpoint-every", "2",
           "--timeout-s", str(timeout_s), "--eval-every", "100000", "--out", str(out), "--quiet"]
    # A session of its own: every process the launcher spawns stays in its process group.
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    ended = time.time()
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if line.startswith("gradzip:")]
    assert lines[-1].startswith("gradzip: worker rank 1 died (exit code 3); resume with --resume"), err
    assert "(last complete checkpoint: step-000004)" in lines[-1]
    for rank in (0, 2):
        assert any(line.startswith(f"gradzip: rank {rank} stopped: rank 1 stopped responding") for line in lines), err
    # Rank 1 left right after the step-4 checkpoint; the others stopped well within the timeout.
    manifest = out / "checkpoints" / "step-000004" / "complete.json"
    assert ended - manifest.stat().st_mtime < timeout_s, ended - manifest.stat().st_mtime
    assert _group_empty(proc.pid, wait_s=10), "a process of the run is still running"
    folder, notes = find_checkpoint(out)
    assert folder.name == "step-000004" and notes == []
    assert load(folder, "rank-1.pt")["rank"] == 1


@pytest.mark.e2e
def test_sigterm_to_the_launcher_stops_every_worker(tmp_path):
    """A scheduler or ``timeout`` stops the launcher with SIGTERM: the workers stop with it, the
    command exits 143 with one line, and no process of the run is left."""
    proc = _training(tmp_path, stderr=subprocess.PIPE, text=True)
    _terminated_in_one_line(proc)
    assert _group_empty(proc.pid, wait_s=10), "a worker of the run is still running"


def _terminated_in_one_line(proc: subprocess.Popen) -> None:
    """Send SIGTERM to ``proc`` alone (not its group) and check it exits 143 with its one line;
    its group is killed if it does not exit."""
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "gradzip: terminated (SIGTERM); the workers were stopped", err


@pytest.mark.e2e
def test_sigkill_to_the_launcher_stops_every_worker(tmp_path):
    """The launcher killed outright (SIGKILL, the OOM killer) cannot stop its workers: they stop
    by themselves, and no process of the run is left training into its folder. Started as a
    script's background job is (SIGINT ignored, which the workers inherit), where the SIGINT that
    torch's spawn asks the kernel for at the parent's death would do nothing."""
    proc = _training(tmp_path, stderr=subprocess.DEVNULL,
                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        proc.kill()  # the launcher alone, not its group
        proc.wait(timeout=30)
        assert _group_empty(proc.pid, wait_s=15), "a worker of the run is still running"
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass


def _training(tmp_path: Path, **popen: Any) -> subprocess.Popen:
    """A 2-worker ``gradzip train`` launcher in a session of its own, returned once its workers
    are training (two steps in ``metrics.jsonl``)."""
    data = write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "run"
    env = dict(os.environ, GRADZIP_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "gradzip", "train", "--data", data, "--vocab-size", "300", "--seq-len", "32",
           "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "2", "--threads", "1",
           "--world-size", "2", "--steps", "100000", "--eval-every", "100000", "--out", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, **popen)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            code = proc.poll()
            if code is None:
                os.killpg(proc.pid, 9)
            raise AssertionError(f"no steps (launcher exit code {code})")
        time.sleep(0.5)
    return proc


def _group_empty(pgid: int, wait_s: float) -> bool:
    """Whether no process is left in the group within ``wait_s`` (Python's multiprocessing
    resource tracker leaves a moment after the launcher, on its own)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _diverging_worker(rank: int, world_size: int, out: str, data: str) -> dict | None:
    from gradzip.lab.train.loop import DIVERGED_AFTER

    without_plots()
    # rank 1's gradient is not finite from step 3 on, as in a run whose loss has become NaN
    os.environ[ENV] = "+".join(f"nonfinite:rank=1,step={s},value=nan" for s in range(3, 3 + DIVERGED_AFTER + 5))
    summary = train_worker(tiny_config(data, out, world_size=world_size, steps=30, checkpoint_every=2,
                                       keep_checkpoints=0))
    if rank != 0:
        return None
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    folders = sorted(p.name for p in (Path(out) / "checkpoints").iterdir())
    return {"summary": summary, "steps": [r["step"] for r in records], "folders": folders, "after": DIVERGED_AFTER}


@pytest.mark.dist
def test_a_run_whose_steps_are_all_skipped_stops_as_diverged_without_a_checkpoint_of_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "run"
    first, second = run_ranks(_diverging_worker, 2, str(out), data, timeout_s=300)
    assert second is None
    after = first["after"]
    last = 3 + after - 1  # the step on which the tenth skip in a row came
    assert first["steps"] == list(range(last + 1))  # both ranks stopped there, not at step 29
    summary = first["summary"]
    assert summary["skipped_steps"] == after
    assert summary["diverged"].startswith("diverged: from step 3 on every step had a non-finite gradient or update")
    assert f"stopped after {after} in a row" in summary["diverged"]
    # the periodic checkpoints up to the first skip are kept (step 4 follows one skip, which leaves
    # no trace); none from the second skip in a row on (every second step would have written one),
    # and no final one of the diverged run
    assert [f for f in first["folders"] if f.startswith("step-")] == ["step-000002", "step-000004"]


def test_the_command_line_says_why_a_diverged_run_failed_and_exits_1(monkeypatch, capsys):
    from gradzip.lab.cli import build_parser
    from gradzip.lab.train import cli, launch

    reason = "diverged: the final validation loss is nan"
    args = build_parser().parse_args(["train", "--steps", "5"])
    monkeypatch.setattr(launch, "launch", lambda cfg, notes, checkpoint: {"diverged": reason})
    assert cli.run(args) == 1
    assert capsys.readouterr().err.strip() == f"gradzip train: {reason}"
    monkeypatch.setattr(launch, "launch", lambda cfg, notes, checkpoint: {"diverged": None})
    assert cli.run(args) == 0


def _own_skips_worker(rank: int, world_size: int, base: str, data: str) -> dict:
    without_plots()
    os.environ[ENV] = "nonfinite:rank=1,step=1,value=inf+nonfinite:rank=1,step=2,value=nan+nonfinite:rank=2,step=1,value=inf"
    results = {}
    for name, options in {"outer": {"outer": "diloco:sync_every=2"}, "no-exchange": {"no_exchange": True}}.items():
        out = Path(base) / name
        train_worker(tiny_config(data, str(out), world_size=world_size, steps=4, **options))
        if rank == 0:
            results[name] = json.loads((out / "summary.json").read_text())
    return results


@pytest.mark.dist
def test_steps_each_replica_skipped_alone_are_all_counted_in_the_summary(tmp_path, monkeypatch):
    """Under --outer and --no-exchange each rank skips its own non-finite steps: the summary,
    written by rank 0, counts those of every replica (rank 1 skipped two, rank 2 one, rank 0 none)."""
    from gradzip.lab.train.report import summary_table

    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    summaries = run_ranks(_own_skips_worker, 3, str(tmp_path), data, timeout_s=300)[0]
    for name, summary in summaries.items():
        assert (summary["skipped_steps"], summary["skipped_steps_by_replica"]) == (3, [0, 2, 1]), name
        assert re.search(r"\nskipped steps +3 \(each replica its own: 0, 2, 1\)", summary_table(summary)), name


@pytest.mark.e2e
def test_sigterm_to_a_comparison_stops_its_runs(tmp_path):
    """``gradzip compare`` stopped by SIGTERM stops the run in progress as Ctrl-C does: exit 143,
    one line, no worker left."""
    data = write_corpus(tmp_path / "corpus.txt")
    env = dict(os.environ, GRADZIP_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "gradzip", "compare", "--network", "loopback", "--world-size", "2", "--steps", "100000",
           "--compressors", "none", "--no-limit", "--out", str(out), "--data", data, "--vocab-size", "300",
           "--seq-len", "32", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "2",
           "--eval-every", "100000"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    metrics, deadline = None, time.monotonic() + 240
    while metrics is None or metrics.read_text().count("\n") < 2:
        found = list(out.glob("runs/*/metrics.jsonl"))
        metrics = found[0] if found else None
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            raise AssertionError("the comparison's run never trained")
        time.sleep(0.5)
    _terminated_in_one_line(proc)
    # the runs' workers start in sessions of their own: look for any process naming the folder
    deadline = time.monotonic() + 15
    while _naming(str(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _naming(str(out)), "a worker of the comparison is still running"


def _naming(text: str) -> list[int]:
    """The processes whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
