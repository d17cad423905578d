"""``gradzip train --outer diloco:...``: the outer exchange's bytes in the summary, replicas of
several ranks, exact resume mid-cycle with an exchange in flight, and bad input refused in one
line before any worker starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.tiny_run import load, same, tiny_config, without_plots, write_corpus

from gradzip.lab.cli import main
from gradzip.lab.train.loop import train_worker
from gradzip.lab.train.model import build_model
from gradzip.testing import run_ranks


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _parameter_bytes(data: str) -> int:
    """fp32 bytes of the tiny model's trainable tensors, counted on a model built here."""
    cfg = tiny_config(data, "unused")
    return sum(p.numel() * 4 for p in build_model(cfg, cfg.vocab_size).parameters() if p.requires_grad)


def _bytes_worker(rank: int, world_size: int, out: str, data: str, options: dict) -> dict | None:
    without_plots()
    summary = train_worker(tiny_config(data, out, world_size=world_size, **options))
    folder = Path(out) / "checkpoints" / f"step-{options['steps']:06d}"
    return {"summary": summary, "model": load(folder, f"rank-{rank}.pt")["model"]}


@pytest.mark.e2e
def test_outer_bytes_per_step_are_the_full_payload_over_h(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    h, steps = 4, 8
    options = {"steps": steps, "outer": f"diloco:sync_every={h}", "outer_compressor": "none"}
    results = run_ranks(_bytes_worker, 2, str(tmp_path / "run"), data, options, timeout_s=300)
    summary = results[0]["summary"]
    full = _parameter_bytes(data)  # the identity codec sends 4 bytes per element
    assert summary["payload_bytes_per_step"] == full / h
    assert summary["dense_bytes_per_step"] == full
    assert summary["compression_ratio"] == h
    assert summary["compressor"] == f"DiLoCo H={h}, outer codec none"
    sent = [r["step"] for r in _records(tmp_path / "run") if r["payload_bytes"]]
    assert sent == [h - 1, 2 * h - 1]
    # after the last outer step (steps a multiple of H) both replicas hold the global parameters
    assert same(results[0]["model"], results[1]["model"])


@pytest.mark.e2e
def test_two_replicas_of_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    h, steps = 3, 6
    options = {"steps": steps, "outer": f"diloco:sync_every={h}", "outer_compressor": "none", "replica_size": 2,
               "compressor": "none"}
    results = run_ranks(_bytes_worker, 4, str(tmp_path / "run"), data, options, timeout_s=300)
    summary = results[0]["summary"]
    full = _parameter_bytes(data)
    # the two ranks of a replica share the exchange out; their bytes add up to one full payload
    assert summary["payload_bytes_per_step"] == full / h
    assert summary["replica_payload_bytes_per_step"] == full  # dense all_reduce inside the replica, every step
    models = [r["model"] for r in results]
    assert all(same(models[0], m) for m in models[1:])


RESUME_OPTIONS = {
    # two fragments, each exchanged once per 4 steps, landing one step late; Top-K keeps residuals
    "outer": "diloco:sync_every=4,fragments=2,delay=1", "outer_compressor": "topk:ratio=0.1", "steps": 10,
}


def _resume_worker(rank: int, world_size: int, base: str, data: str) -> dict:
    without_plots()
    uninterrupted, resumed = Path(base) / "a", Path(base) / "b"
    settings = dict(world_size=world_size, **RESUME_OPTIONS)
    train_worker(tiny_config(data, str(uninterrupted), checkpoint_every=3, keep_checkpoints=0, **settings))
    if rank == 0:
        # resume from step 6: fragment 1's exchange, launched after step 6, is still in flight
        shutil.copytree(uninterrupted, resumed)
        for step in (9, 10):
            shutil.rmtree(resumed / "checkpoints" / f"step-{step:06d}")
    dist.barrier()
    train_worker(tiny_config(data, str(resumed), resume=str(resumed), **settings))
    final = [folder / "checkpoints" / "step-000010" for folder in (uninterrupted, resumed)]
    mine = [load(f, f"rank-{rank}.pt") for f in final]
    saved = load(uninterrupted / "checkpoints" / "step-000006", f"rank-{rank}.pt")
    entry = {
        "in_flight_at_6": len(saved["optimizer"]["pending"]),
        "model": same(mine[0]["model"], mine[1]["model"]),
        "outer": same(mine[0]["optimizer"], mine[1]["optimizer"]),
        "data_generator": same(mine[0]["data_generator"], mine[1]["data_generator"]),
    }
    if rank == 0:
        entry["losses"] = [[r["loss"] for r in _records(folder)] for folder in (uninterrupted, resumed)]
        entry["payload"] = [[r["payload_bytes"] for r in _records(folder)] for folder in (uninterrupted, resumed)]
    return entry


@pytest.mark.e2e
def test_outer_resume_mid_cycle_is_bit_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    results = run_ranks(_resume_worker, 2, str(tmp_path), data, timeout_s=300)
    for rank, entry in enumerate(results):
        assert entry["in_flight_at_6"] == 1, rank
        assert entry["model"], f"rank {rank}: model differs after resume"
        assert entry["outer"], f"rank {rank}: DiLoCo state differs after resume"
        assert entry["data_generator"], rank
    uninterrupted, resumed = results[0]["losses"]
    assert len(uninterrupted) == RESUME_OPTIONS["steps"] and uninterrupted == resumed
    assert results[0]["payload"][0] == results[0]["payload"][1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--outer", "diloco:sync_every=0"], "--outer: sync_every must be an integer >= 1; got 0"),
        (["--outer", "diloco:sync_every=4,fragments=3"], "fragments must divide sync_every=4"),
        (["--outer", "diloco:sync_every=4,delay=4"], "delay must be an integer in [0, 3]"),
        (["--outer", "diloco:sync_every=6,fragments=2,delay=6"], "delay must be an integer in [0, 5]"),
        (["--outer", "diloco:sync_every=4,carry=true"], "carry=True keeps the inner steps taken while a late update"),
        (["--outer", "diloco:sync_every=4,carry=true"], "got delay=0, mix=0.0, eager=False"),
        (["--outer", "diloco:sync_every=4", "--outer-compressor", "auto"], "'auto' cannot run on the outer exchange"),
        (["--outer", "diloco:sync_every=4", "--world-size", "4", "--replica-size", "3"],
         "--replica-size must divide --world-size=4; got 3"),
        (["--outer", "diloco:sync_every=4,compressor=none"], "has no parameter 'compressor'"),
        (["--outer", "topk:ratio=0.1"], "--outer must be diloco:sync_every=H"),
        (["--replica-size", "2"], "--replica-size groups ranks into replicas for --outer"),
        (["--outer", "diloco:sync_every=4", "--optimizer", "onebit-adam"], "--outer wraps the inner adamw"),
    ],
)
def test_bad_outer_input_is_one_line_and_exit_code_2(args, message, capsys, tmp_path):
    assert main(["train", *args, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1
    assert not (tmp_path / "x").exists()  # refused before any worker started


def _skip_worker(rank: int, world_size: int, out: str, data: str) -> dict:
    import os

    from gradzip.lab.train.faults import ENV

    without_plots()
    os.environ[ENV] = "nonfinite:rank=1,step=2"
    train_worker(tiny_config(data, out, world_size=world_size, steps=6, checkpoint_every=1, keep_checkpoints=0,
                             outer="diloco:sync_every=3", outer_compressor="none"))
    state = {step: load(Path(out) / "checkpoints" / f"step-{step:06d}", f"rank-{rank}.pt")["optimizer"]
             for step in (2, 3, 6)}
    return {
        "inner_unchanged": same(state[2]["inner"]["state"], state[3]["inner"]["state"]),  # its moments
        "inner_steps": state[3]["inner_steps"],
        "exchanges": state[6]["exchanges"],
        "global": state[6]["global"],
    }


@pytest.mark.e2e
def test_a_nonfinite_gradient_skips_the_step_on_its_replica_only(tmp_path, monkeypatch):
    # no collective between outer exchanges: the other replica takes its step, and both keep
    # counting inner steps so that the exchanges stay in step
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    results = run_ranks(_skip_worker, 2, str(tmp_path / "run"), data, timeout_s=300)
    assert results[1]["inner_unchanged"]  # rank 1's inner AdamW did not take step 2
    assert not results[0]["inner_unchanged"]  # rank 0's did
    assert [r["inner_steps"] for r in results] == [3, 3]
    assert [r["exchanges"] for r in results] == [2, 2]
    assert same(results[0]["global"], results[1]["global"])
