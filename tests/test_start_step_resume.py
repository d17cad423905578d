"""``gradzip train --resume`` across ``start_step``: a run resumed from a checkpoint taken during
the dense steps continues bit-identically through the switch to the codec (``--fsdp``, whose
residuals are staged per call; 2 real gloo ranks; DDP resumes are covered by test_resume)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist
from tiny_run import load, same, tiny_config, without_plots, write_corpus

from gradzip.testing import run_ranks
from gradzip.train.loop import train_worker

STEPS = 6
# Checkpoints at steps 2, 4 and 6; the resumed run starts from step 2, dense until step 4.
START_STEP = 4
RUNS = {"fsdp": {"compressor": f"efsignsgd:group=64,start_step={START_STEP}", "fsdp": True}}


def _worker(rank: int, world_size: int, base: str, data: str) -> dict:
    without_plots()
    results = {}
    for name, options in RUNS.items():
        run = Path(base) / name
        uninterrupted, resumed = run / "a", run / "b"
        settings = dict(world_size=world_size, steps=STEPS, **options)
        train_worker(tiny_config(data, str(uninterrupted), checkpoint_every=2, keep_checkpoints=0, **settings))
        if rank == 0:
            shutil.copytree(uninterrupted, resumed)
            for step in (4, 6):
                shutil.rmtree(resumed / "checkpoints" / f"step-{step:06d}")
        dist.barrier()
        start = resumed / "checkpoints" / "step-000002"
        train_worker(tiny_config(data, str(resumed), checkpoint_every=2, keep_checkpoints=0, resume=str(start),
                                 **settings))
        final_a = uninterrupted / "checkpoints" / f"step-{STEPS:06d}"
        final_b = resumed / "checkpoints" / f"step-{STEPS:06d}"
        entry = {"hook_state": same(load(final_a, f"rank-{rank}.pt")["hook"], load(final_b, f"rank-{rank}.pt")["hook"])}
        if rank == 0:
            shared_a, shared_b = load(final_a, "shared.pt"), load(final_b, "shared.pt")
            entry["model"] = same(shared_a["model"], shared_b["model"])
            entry["records"] = [[json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
                                for folder in (uninterrupted, resumed)]
        results[name] = entry
    return results


def test_resume_from_a_dense_step_continues_bit_identically_through_start_step(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    results = run_ranks(_worker, 2, str(tmp_path), data, timeout_s=300)
    for rank, per_run in enumerate(results):
        for name, entry in per_run.items():
            assert entry["hook_state"], f"{name}: rank {rank} compressor state differs after resume"
    for name, entry in results[0].items():
        assert entry["model"], f"{name}: model differs after resume"
        uninterrupted, resumed = entry["records"]
        assert [r["loss"] for r in uninterrupted] == [r["loss"] for r in resumed], name
        assert len(resumed) == STEPS
        for record in resumed:
            dense = record["step"] < START_STEP
            assert (record["payload_bytes"] == record["dense_bytes"]) == dense, (name, record["step"])
