"""``--resume``: a run continued from a checkpoint is bit-identical to one never interrupted, on
2 and 3 real gloo ranks, and a damaged checkpoint is passed over or named in one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.tiny_run import load, same, tiny_config, without_plots, write_corpus

from gradzip.lab.cli import main
from gradzip.lab.train.checkpoint import NoUsableCheckpoint, find_checkpoint, save_checkpoint
from gradzip.lab.train.config import TrainConfig
from gradzip.lab.train.loop import train_worker
from gradzip.testing import run_ranks

# The default codec; a sparse codec with error feedback; a compressed optimizer (1-bit Adam,
# exchanging its own momenta from step 2 on, with error buffers that differ across ranks); FSDP
# with a codec that starts at step 5, so the run resumes (from step 4) in its dense steps.
START_STEP = 5
RUNS = {
    "powersgd": {"compressor": "powersgd:approx_rank=4"},
    "topk": {"compressor": "topk:ratio=0.1"},
    "fsdp-start_step": {"compressor": f"efsignsgd:group=64,start_step={START_STEP}", "fsdp": True},
    "onebit-adam": {"compressor": "none", "optimizer": "onebit-adam:warmup_steps=2"},
}
STEPS = 6


def _resume_worker(rank: int, world_size: int, base: str, data: str) -> dict:
    without_plots()
    results = {}
    for spec, options in RUNS.items():
        run = Path(base) / spec
        uninterrupted, resumed = run / "a", run / "b"
        settings = dict(world_size=world_size, steps=STEPS, **options)
        train_worker(tiny_config(data, str(uninterrupted), checkpoint_every=2, keep_checkpoints=0, **settings))
        if rank == 0:
            # The resumed run's folder: the same checkpoints, the newest cut short as by a kill
            # during its write, so --resume must fall back to step 4.
            shutil.copytree(uninterrupted, resumed)
            cut = resumed / "checkpoints" / f"step-{STEPS:06d}" / f"rank-{world_size - 1}.pt"
            cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
        dist.barrier()
        found, notes = find_checkpoint(resumed)
        train_worker(tiny_config(data, str(resumed), resume=str(resumed), **settings))

        final_a = uninterrupted / "checkpoints" / f"step-{STEPS:06d}"
        final_b = resumed / "checkpoints" / f"step-{STEPS:06d}"
        mine_a, mine_b = load(final_a, f"rank-{rank}.pt"), load(final_b, f"rank-{rank}.pt")
        entry = {
            "fell_back_to": found.name,
            "notes": notes,
            "hook_state": same(mine_a["hook"], mine_b["hook"]),
            "data_generator": same(mine_a["data_generator"], mine_b["data_generator"]),
            "own_optimizer": same(mine_a["optimizer"], mine_b["optimizer"]),
            "own_model": same(mine_a["model"], mine_b["model"]),
        }
        if rank == 0:
            shared_a, shared_b = load(final_a, "shared.pt"), load(final_b, "shared.pt")
            for part in ("model", "optimizer", "scheduler"):
                entry[part] = same(shared_a[part], shared_b[part])
            records = [[json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
                       for folder in (uninterrupted, resumed)]
            entry["losses"] = [[r["loss"] for r in run_records] for run_records in records]
            entry["dense_steps"] = [r["step"] for r in records[1] if r["payload_bytes"] == r["dense_bytes"]]
        results[spec] = entry
    return results


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_resumed_run_is_bit_identical(tmp_path, monkeypatch, world_size):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    results = run_ranks(_resume_worker, world_size, str(tmp_path), data, timeout_s=300)
    for rank, per_spec in enumerate(results):
        for spec, entry in per_spec.items():
            assert entry["fell_back_to"] == "step-000004", (spec, entry["fell_back_to"])
            assert entry["notes"] and "bytes" in entry["notes"][0], entry["notes"]
            assert entry["hook_state"], f"{spec}: rank {rank} compressor state differs after resume"
            assert entry["data_generator"], f"{spec}: rank {rank} data order differs after resume"
            assert entry["own_optimizer"], f"{spec}: rank {rank} optimizer error buffers differ after resume"
            assert entry["own_model"], f"{spec}: rank {rank} parameters differ after resume"
            if rank == 0:
                for part in ("model", "optimizer", "scheduler"):
                    assert entry[part], f"{spec}: {part} differs after resume"
                uninterrupted, resumed = entry["losses"]
                assert len(uninterrupted) == len(resumed) == STEPS
                assert uninterrupted == resumed, f"{spec}: losses differ after resume"
                if "start_step" in spec:
                    assert entry["dense_steps"] == list(range(START_STEP)), (spec, entry["dense_steps"])


def _fake_checkpoint(out: Path, step: int) -> Path:
    return save_checkpoint(
        out, step, shared={"step": step}, per_rank={"state": torch.arange(1000)}, rank=0, world_size=1, config={}
    )


def test_find_checkpoint_passes_over_cut_and_unfinished_writes(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 4)
    assert find_checkpoint(tmp_path) == (newest, [])
    # A kill during the write of step 6: files there, no manifest, latest still names step 4.
    unfinished = tmp_path / "checkpoints" / "step-000006"
    unfinished.mkdir()
    (unfinished / "rank-0.pt.tmp123").write_bytes(b"\x00" * 10)
    assert find_checkpoint(tmp_path)[0] == newest
    # The newest one cut short afterwards: fall back to step 2, saying why.
    cut = newest / "rank-0.pt"
    size = cut.stat().st_size
    cut.write_bytes(cut.read_bytes()[:100])
    folder, notes = find_checkpoint(tmp_path)
    assert folder.name == "step-000002"
    assert notes == [f"step-000004: rank-0.pt has 100 of its {size} bytes"]
    # Naming a damaged checkpoint folder directly is an error, not a silent fallback.
    with pytest.raises(NoUsableCheckpoint, match="rank-0.pt has 100 of"):
        find_checkpoint(newest)
    # Bytes flipped in place, the size unchanged: the checksum says so.
    older = tmp_path / "checkpoints" / "step-000002" / "shared.pt"
    data = bytearray(older.read_bytes())
    data[len(data) // 2] ^= 0xFF
    older.write_bytes(bytes(data))
    with pytest.raises(NoUsableCheckpoint, match="step-000002: shared.pt does not match its checksum"):
        find_checkpoint(tmp_path)


def test_resume_with_nothing_usable_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    only = _fake_checkpoint(tmp_path / "run", 2)
    (only / "complete.json").unlink()  # killed before the manifest
    args = ["train", "--data", data, "--vocab-size", "300", "--seq-len", "32", "--steps", "4"]
    errors = []
    for resume in (tmp_path / "run", tmp_path / "empty"):
        resume.mkdir(exist_ok=True)
        assert main(args + ["--resume", str(resume)]) == 2
        errors.append(capsys.readouterr().err)
    for err in errors:
        assert err.count("\n") == 1 and err.startswith("gradzip: error: --resume: no usable checkpoint"), err
    assert "(step-000002: no complete.json (its write did not finish))" in errors[0]
    assert "no checkpoints under" in errors[1]


def test_resume_with_other_settings_names_them(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    config = tiny_config(data, str(tmp_path / "run"), compressor="topk:ratio=0.1").to_dict()
    for rank in (1, 0):  # as two ranks would, rank 0 last (it writes the manifest)
        save_checkpoint(tmp_path / "run", 2, shared={}, per_rank={}, rank=rank, world_size=2, config=config)
    args = ["train", "--data", data, "--vocab-size", "300", "--seq-len", "32", "--n-layer", "1", "--n-embd", "32",
            "--n-head", "2", "--batch-size", "2", "--steps", "4", "--resume", str(tmp_path / "run")]
    assert main(args + ["--compressor", "fp16", "--world-size", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--world-size (checkpoint 2, now 3)" in err and "--compressor (checkpoint 'topk:ratio=0.1', now 'fp16')" in err


def test_a_codec_spec_written_otherwise_is_the_same_codec_and_a_file_is_named(tmp_path, capsys, monkeypatch):
    from gradzip.lab.train.checkpoint import check_compatible

    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    config = tiny_config(data, str(tmp_path / "run"), compressor="topk:ratio=0.1", steps=4).to_dict()
    folder = save_checkpoint(tmp_path / "run", 2, shared={}, per_rank={}, rank=0, world_size=1, config=config)
    check_compatible(folder, {**config, "compressor": "topk:ratio=0.10"}, 1)  # the same codec: no error
    with pytest.raises(ValueError, match="--compressor"):
        check_compatible(folder, {**config, "compressor": "topk:ratio=0.2"}, 1)
    # the saved optimizer and schedule hold the learning rate and weight decay: another is refused
    with pytest.raises(ValueError, match=r"--lr \(checkpoint 0.001, now 0.5\), --weight-decay \(checkpoint 0.1, now 0.0\)"):
        check_compatible(folder, {**config, "lr": 0.5, "weight_decay": 0.0}, 1)
    assert main(["train", "--resume", str(folder / "shared.pt")]) == 2
    assert capsys.readouterr().err == (f"gradzip: error: --resume: {folder / 'shared.pt'} is a file; give its run "
                                       "folder or one checkpoint folder\n")


def _resume_args(*argv: str):
    from gradzip.lab.cli import build_parser
    from gradzip.lab.train.cli import config_and_notes

    argv = ["train", *argv]
    args = build_parser().parse_args(argv)
    args.argv = argv
    return config_and_notes(args)[:2]


def test_resume_takes_the_settings_not_given_from_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    config = tiny_config(data, str(tmp_path / "run"), compressor="topk:ratio=0.1", steps=4, world_size=3,
                         checkpoint_every=2).to_dict()
    for rank in (2, 1, 0):  # as three ranks would, rank 0 last (it writes the manifest)
        save_checkpoint(tmp_path / "run", 2, shared={}, per_rank={}, rank=rank, world_size=3, config=config)
    run = str(tmp_path / "run")

    cfg, notes = _resume_args("--resume", run)
    for name in ("compressor", "steps", "world_size", "n_layer", "n_embd", "data", "vocab_size", "seq_len",
                 "checkpoint_every", "threads"):
        assert getattr(cfg, name) == config[name], name
    assert cfg.out == run and cfg.resume == run
    assert cfg.progress is True  # --quiet belongs to this command, not to the run
    assert notes == ["resuming with the checkpoint's settings: " + ", ".join(
        f"--{k.replace('_', '-')} {config[k]}" for k in TrainConfig().to_dict()
        if k not in ("resume", "out", "progress") and config[k] != getattr(TrainConfig(), k))]
    assert "--compressor topk:ratio=0.1" in notes[0] and "--world-size 3" in notes[0]

    # what is given wins (and is then checked against the checkpoint by launch), and a new step
    # count is said
    cfg, notes = _resume_args("--resume", run, "--steps", "8", "--compressor", "fp16", "--quiet")
    assert (cfg.steps, cfg.compressor, cfg.progress, cfg.n_layer) == (8, "fp16", False, config["n_layer"])
    assert "--compressor" not in notes[0] and "--steps" not in notes[0]
    assert notes[1] == ("resuming with --steps 8 where the checkpoint's run had 4 (the learning-rate schedule "
                        "follows the new count from here)")

    # a namespace built by hand (no raw arguments): everything counts as given, as before
    from gradzip.lab.cli import build_parser
    from gradzip.lab.train.cli import config_and_notes

    args = build_parser().parse_args(["train", "--resume", run])
    cfg, notes, _folder = config_and_notes(args)
    assert cfg.compressor == TrainConfig.compressor and cfg.steps == TrainConfig.steps
    assert notes == [f"resuming with --steps {TrainConfig.steps} where the checkpoint's run had 4 (the learning-rate "
                     "schedule follows the new count from here)"]


def test_relative_data_and_model_paths_are_kept_absolute_for_a_resume_from_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_corpus(tmp_path / "a" / "corpus.txt")
    monkeypatch.chdir(tmp_path / "a")
    cfg, _notes = _resume_args("--data", "corpus.txt", "--out", "run")
    assert cfg.data == str(tmp_path / "a" / "corpus.txt")
    assert cfg.out == "run"  # the output folder stays as given
    run = tmp_path / "a" / "run"
    save_checkpoint(run, 2, shared={}, per_rank={}, rank=0, world_size=1, config=cfg.to_dict())

    monkeypatch.chdir(tmp_path / "b")  # no corpus.txt here: a relative path would name nothing
    cfg, notes = _resume_args("--resume", str(run))
    assert cfg.data == str(tmp_path / "a" / "corpus.txt")
    cfg.validate()  # the file is found
    # the same file given again, relative to the new directory, is the checkpoint's: nothing to say
    cfg, notes = _resume_args("--resume", str(run), "--data", "../a/corpus.txt")
    assert cfg.data == str(tmp_path / "a" / "corpus.txt") and notes == []
    # the packaged model's name is a name even beside a folder of that name
    (tmp_path / "b" / "smollm2-135m").mkdir()
    from gradzip.lab.train.cli import with_absolute_paths

    assert with_absolute_paths({"model": "smollm2-135m", "data": None}) == {"model": "smollm2-135m", "data": None}


@pytest.mark.e2e
def test_zeroone_adam_resumes_exactly_between_synchronisations(tmp_path):
    """0/1 Adam's ranks take local steps between synchronisations, so their parameters differ
    there: a checkpoint at such a step (step 3 here) keeps every rank's own model."""
    import subprocess
    import sys

    common = ["--steps", "6", "--checkpoint-every", "3", "--keep-checkpoints", "0", "--n-layer", "1", "--n-embd", "32",
              "--n-head", "2", "--seq-len", "16", "--batch-size", "2", "--eval-every", "3", "--eval-batches", "1",
              "--vocab-size", "260", "--compressor", "none", "--warmup-steps", "1", "--lr", "1e-5", "--quiet",
              "--optimizer", "zeroone-adam:var_freeze_step=1,local_step_scaler=1,local_step_clipper=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADZIP_CACHE": str(tmp_path / "cache")}
    data = write_corpus(tmp_path / "corpus.txt")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"

    def train(*extra):
        proc = subprocess.run([sys.executable, "-m", "gradzip", "train", *common, "--data", data, *extra],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]

    train("--out", str(whole))
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000006")
    (resumed / "checkpoints" / "latest").write_text("step-000003\n")
    train("--out", str(resumed), "--resume", str(resumed))
    for name in ("shared.pt", "rank-0.pt", "rank-1.pt"):
        a, b = (load(folder / "checkpoints" / "step-000006", name) for folder in (whole, resumed))
        assert same(a["model"], b["model"]), f"{name}: parameters differ after resume"


def test_a_hookless_optimizers_checkpoint_with_the_old_unused_compressor_resumes(tmp_path):
    """Checkpoints of tsr-adam and demo runs from before --compressor became none under them
    recorded the unused default; that difference does not refuse a resume (any other does)."""
    from gradzip.lab.train.checkpoint import check_compatible

    saved = TrainConfig(optimizer="demo", steps=10).to_dict() | {"compressor": "powersgd:approx_rank=4"}
    for rank in (1, 0):  # rank 0 last: it writes the manifest
        save_checkpoint(tmp_path / "run", 2, shared={}, per_rank={}, rank=rank, world_size=2, config=saved)
    folder = tmp_path / "run" / "checkpoints" / "step-000002"
    check_compatible(folder, TrainConfig(optimizer="demo", steps=10).validate().to_dict(), 2)
    with pytest.raises(ValueError, match="--batch-size"):
        check_compatible(folder, TrainConfig(optimizer="demo", steps=10, batch_size=4).validate().to_dict(), 2)
    adamw = TrainConfig(steps=10).to_dict() | {"compressor": "topk:ratio=0.1"}
    for rank in (1, 0):  # rank 0 last: it writes the manifest
        save_checkpoint(tmp_path / "adamw", 2, shared={}, per_rank={}, rank=rank, world_size=2, config=adamw)
    with pytest.raises(ValueError, match="--compressor"):
        check_compatible(tmp_path / "adamw" / "checkpoints" / "step-000002", TrainConfig(steps=10).to_dict(), 2)
