"""The main job end to end on the real Shakespeare text (a tiny model, a few steps), under
gradzip's own launcher and under torchrun, and its command-line errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

from gradzip.lab.cli import main
from gradzip.lab.train.known_gaps import gap_note

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "4", "--vocab-size", "512"]


def _run(args, env=None, cmd=None):
    cmd = cmd or [sys.executable, "-m", "gradzip", "train"]
    return subprocess.run(cmd + args, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.e2e
def test_train_writes_metrics_summary_plot_and_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = _run(TINY + ["--steps", "12", "--eval-every", "6", "--lr", "3e-3", "--compressor", "topk:ratio=0.05", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gradzip train: summary" in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(12))
    for field in ("step", "loss", "payload_bytes", "dense_bytes", "step_s"):
        assert all(field in r for r in records)
    assert all(0 < r["payload_bytes"] < r["dense_bytes"] for r in records)
    assert "val_loss" in records[5] and "val_loss" in records[11]
    summary = json.loads((out / "summary.json").read_text())
    for field in ("initial_val_loss", "final_val_loss", "compression_ratio", "compressor", "world_size", "steps"):
        assert field in summary
    assert summary["world_size"] == 2 and summary["steps"] == 12 and summary["compressor"] == "topk:ratio=0.05"
    # Top-K's measured gap under AdamW is said before the run and in its summary; each bucket's route with why
    note = gap_note("topk:ratio=0.05")
    assert "Top-K at 1% from step 0" in note and summary["known_gap"] == note
    assert f"gradzip train: note: {note}" in proc.stdout and proc.stdout.count(f"note: {note}") == 2
    # the default 20 warm-up steps cover this 12-step run: said once, before training
    assert proc.stdout.count("note: --warmup-steps 20 covers all 12 steps") == 1
    routes = summary["monitor"]["routes"]
    assert routes and all(len(e["taken"]) == 1 for e in routes.values())
    for name, entry in routes.items():
        taken = entry["taken"][0]
        assert taken["why"].startswith(f"fewest bytes sent over 2 ranks ({taken['route']} ")
        assert f"bucket {name}: {taken['route']} from step 0: {taken['why']}" in proc.stdout
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    assert summary["compression_ratio"] == pytest.approx(
        sum(r["dense_bytes"] for r in records) / sum(r["payload_bytes"] for r in records)
    )
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    shared = torch.load(ckpt / "shared.pt", weights_only=False)
    assert shared["step"] == 12 and "model" in shared and "optimizer" in shared
    for rank in (0, 1):
        per_rank = torch.load(ckpt / f"rank-{rank}.pt", weights_only=False)
        assert per_rank["hook"]["reducer"]["feedback"]["residuals"]  # error buffers are saved


@pytest.mark.e2e
def test_train_under_torchrun(tmp_path):
    out = tmp_path / "trun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gradzip", "train"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = _run(TINY + ["--steps", "4", "--eval-every", "2", "--out", str(out), "--quiet"], env=env, cmd=cmd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compressor", "nosuch"], "unknown compressor 'nosuch'; known:"),
        (["--compressor", "topk:ratio=0"], "ratio must be in (0, 1]"),
        (["--compressor", "powersgd:approx_rank=-1"], "approx_rank must be an integer >= 1"),
        (["--world-size", "0"], "--world-size must be an integer in [1, 1024]"),
        (["--data", "/nonexistent/file.txt"], "--data: no such file"),
        (["--steps", "0"], "--steps must be an integer >= 1"),
        (["--compressor", "torch:nosuch"], "unknown PyTorch hook"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, message, capsys, tmp_path):
    assert main(["train", *args, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
