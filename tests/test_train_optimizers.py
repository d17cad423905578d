"""``gradzip train --optimizer``: 1-bit Adam in the main job (the DDP hook steps aside after
warm-up, the optimizer's 1-bit bytes are counted, per-rank state is checkpointed) and its errors."""

import json
import math
import subprocess
import sys

import pytest
import torch

from gradzip.lab.cli import main

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "4", "--vocab-size", "512"]


@pytest.mark.e2e
def test_onebit_adam_in_the_main_job(tmp_path):
    out = tmp_path / "onebit"
    args = TINY + ["--steps", "8", "--eval-every", "4", "--optimizer", "onebit-adam:warmup_steps=3",
                   "--compressor", "none", "--out", str(out), "--quiet"]
    proc = subprocess.run([sys.executable, "-m", "gradzip", "train", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    dense = records[0]["dense_bytes"]
    # warm-up: the hook's uncompressed all_reduce; after: only the optimizer's 1-bit exchange
    assert all(r["payload_bytes"] == dense for r in records[:3])
    assert all(0 < r["payload_bytes"] * 16 <= dense for r in records[3:])
    assert all(r["dense_bytes"] == dense for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["optimizer"] == "onebit-adam:warmup_steps=3"
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    for rank in (0, 1):
        state = torch.load(ckpt / f"rank-{rank}.pt", weights_only=False)["optimizer"]["gradzip"]
        assert state["steps_taken"] == 8 and state["exchange"]["feedback"]["residuals"]


def _run(tmp_path, name: str, spec: str, steps: int, compressor: str = "none") -> tuple[list[dict], dict, object]:
    out = tmp_path / name
    args = TINY + ["--steps", str(steps), "--eval-every", str(steps // 2), "--optimizer", spec, "--compressor", compressor,
                   "--out", str(out), "--quiet"]
    proc = subprocess.run([sys.executable, "-m", "gradzip", "train", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return records, summary, out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()


@pytest.mark.e2e
def test_tsr_adam_in_the_main_job_sends_cores_and_sketches_only(tmp_path):
    records, summary, ckpt = _run(tmp_path, "tsr", "tsr-adam:update_gap=3,update_gap_emb=2,approx_rank_emb=4", 6)
    dense = records[0]["dense_bytes"]
    # n_embd 32: cores 8 x 8 of the four block matrices, 4 x 4 of both embeddings, the 480
    # elements of norms and biases dense; sketches on top where a refresh falls
    core = 4 * (4 * 8 * 8 + 2 * 4 * 4 + 480)
    refreshes = [True, False, True, True, True, False]  # block matrices at 0 and 3, embeddings every 2
    for record, refresh in zip(records, refreshes):
        assert record["dense_bytes"] == dense
        assert (record["payload_bytes"] > core) if refresh else (record["payload_bytes"] == core)
        assert record["payload_bytes"] < dense
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    state = torch.load(ckpt / "rank-1.pt", weights_only=False)["optimizer"]
    bases = [s for s in state["state"].values() if "left" in s]
    assert len(bases) == 6 and state["gradzip"]["steps_taken"] == 6


@pytest.mark.e2e
def test_tsr_adam_with_dense_int8_embeddings_sends_bf16_cores_and_int8_codes(tmp_path):
    spec = "tsr-adam:update_gap=3,dense_emb=true,dense_int8=true,wire_bits=16"
    records, summary, ckpt = _run(tmp_path, "tsr8", spec, 6)
    numel = records[0]["dense_bytes"] // 4
    dense = numel - 32 * 32 * 12  # all but the block matrices (32 x 96, 32 x 32, 32 x 128, 128 x 32)
    # bf16 cores 8 x 8 of the four block matrices; the embeddings, norms and biases in one int8
    # bucket: a code each and an fp32 scale per 256; sketches on top at steps 0 and 3
    plain = 2 * 4 * 8 * 8 + dense + 4 * math.ceil(dense / 256)
    for step, record in enumerate(records):
        assert (record["payload_bytes"] > plain) if step % 3 == 0 else (record["payload_bytes"] == plain)
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    states = [torch.load(ckpt / f"rank-{rank}.pt", weights_only=False)["optimizer"] for rank in (0, 1)]
    assert all(len([s for s in st["state"].values() if "left" in s]) == 4 for st in states)  # no embedding bases
    residuals = [st["gradzip"]["exchange"]["feedback"]["residuals"] for st in states]
    assert all(residuals) and not torch.equal(*(next(iter(r.values())) for r in residuals))  # each rank its own


@pytest.mark.e2e
def test_demo_in_the_main_job_sends_its_top_dct_components(tmp_path):
    records, summary, ckpt = _run(tmp_path, "demo", "demo", 4)
    assert len({r["payload_bytes"] for r in records}) == 1
    assert all(0 < r["payload_bytes"] * 20 < r["dense_bytes"] for r in records)
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    momenta = [torch.load(ckpt / f"rank-{rank}.pt", weights_only=False)["optimizer"]["state"][0]["delta"] for rank in (0, 1)]
    assert not torch.equal(*momenta)  # each rank keeps its own momentum


@pytest.mark.e2e
def test_local_adamw_in_the_main_job_sends_its_update_through_the_codec(tmp_path):
    records, summary, ckpt = _run(tmp_path, "local", "local-adamw", 4, compressor="topk:ratio=0.02")
    states = [torch.load(ckpt / f"rank-{rank}.pt", weights_only=False)["optimizer"] for rank in (0, 1)]
    moments = [s["exp_avg"] for s in states[0]["state"].values()]  # one per parameter tensor, all trained
    numel = sum(m.numel() for m in moments)
    flags = 4 * len(moments)  # a fp32 flag per tensor, sent uncompressed: did any rank have a gradient
    assert all(r["dense_bytes"] == 4 * numel + flags for r in records)
    kept = round(0.02 * numel)  # one bucket of every update: fp32 values, int16 indices below 65,536 elements
    assert 256 < numel <= 65536
    assert all(r["payload_bytes"] == kept * (4 + 2) + flags for r in records)
    assert all(r["sent_bytes"] == r["payload_bytes"] for r in records)  # all_gather at 2 ranks: (W - 1) P
    assert summary["compressor"] == "topk:ratio=0.02" and summary["optimizer"] == "local-adamw"
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    assert not torch.equal(states[0]["state"][0]["exp_avg"], states[1]["state"][0]["exp_avg"])  # moments per rank
    assert all(s["gradzip"]["exchange"]["feedback"]["residuals"] for s in states)


@pytest.mark.parametrize(
    "compressor, extra, message",
    [
        ("auto", [], "--compressor auto is not a plain codec spec"),
        ("kimad", [], "--compressor kimad is not a plain codec spec"),
        ("topk:ratio=0.01,warmup_steps=5", [], "is not a plain codec spec"),
        ("powersgd", ["--collective", "allgather"], "--collective must be auto for powersgd"),
        ("topk:ratio=0.01", ["--fsdp"], "with --fsdp use adamw"),
        ("topk:ratio=0.01", ["--outer", "diloco:sync_every=4"], "--outer wraps the inner adamw"),
    ],
)
def test_local_adamw_takes_a_plain_codec_under_ddp(compressor, extra, message, capsys, tmp_path):
    argv = ["train", "--optimizer", "local-adamw", "--compressor", compressor, *extra, "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nosuch", "--optimizer must be one of adamw, onebit-adam, zeroone-adam, tsr-adam, demo, local-adamw"),
        ("tsr-adam:approx_rank=300", "approx_rank must be at most 256 (--n-embd)"),
        ("tsr-adam:scale=0", "scale must be a number > 0"),
        ("tsr-adam:approx_rank_emb=0", "approx_rank_emb must be an integer >= 1; got 0"),
        ("tsr-adam:update_gap_emb=0", "update_gap_emb must be an integer >= 1; got 0"),
        ("tsr-adam:approx_rank_emb=600", "approx_rank_emb must be at most 256 (--n-embd)"),
        ("tsr-adam:dense_emb=maybe", "dense_emb must be True or False; got 'maybe'"),
        ("tsr-adam:wire_bits=8", "wire_bits must be one of 16, 32; got 8"),
        ("tsr-adam:scale_emb=0", "scale_emb must be a number > 0"),
        ("demo:compression_chunk=0", "compression_chunk must be an integer in [1, 4096]"),
        ("onebit-adam:warmup_steps=0", "warmup_steps must be an integer >= 1"),
        ("onebit-adam:freeze=3", "--optimizer onebit-adam has no parameter 'freeze'; it takes warmup_steps, bucket_cap_mb"),
        ("zeroone-adam:local_step_clipper=0", "local_step_clipper must be an integer >= 1"),
        ("fp16:warmup_steps=10", "warmup_steps and clip_norm need a codec with a ratio"),
        ("topk:ratio=0.01,clip_norm=-1", "clip_norm must be a number > 0"),
    ],
)
def test_bad_optimizer_or_dgc_option_is_one_line_and_exit_code_2(spec, message, capsys, tmp_path):
    flag = "--compressor" if spec.startswith(("fp16", "topk")) else "--optimizer"
    assert main(["train", flag, spec, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_compare_runs_an_optimizer_entry_behind_the_uncompressed_hook(tmp_path):
    from gradzip.lab.compare import CompareConfig, run_compare
    from gradzip.lab.compare.runner import train_command

    def argv(entry):
        return train_command(entry, out_dir=tmp_path, steps=5, seed=0, collective_timeout_s=60, no_exchange=False,
                             options={}, prefix=("train",))  # fmt: skip

    assert argv("onebit-adam:warmup_steps=2")[1:5] == ["--optimizer", "onebit-adam:warmup_steps=2", "--compressor", "none"]
    assert argv("topk:ratio=0.01")[1:3] == ["--compressor", "topk:ratio=0.01"]
    # local-adamw sends its update through the codec after the +
    assert argv("local-adamw+topk:ratio=0.01")[1:5] == ["--optimizer", "local-adamw", "--compressor", "topk:ratio=0.01"]
    assert argv("local-adamw:bucket_cap_mb=1")[1:5] == ["--optimizer", "local-adamw:bucket_cap_mb=1", "--compressor", "none"]
    with pytest.raises(ValueError, match="--compressors entry 'local-adamw\\+auto': local-adamw sends its update through a codec"):
        run_compare(CompareConfig(compressors=["local-adamw+auto"], out=str(tmp_path / "c")))
    # a codec after the + that is no gradzip spec is named as the codec, not read as the entry's spec
    with pytest.raises(ValueError, match="'local-adamw\\+torch:fp16': .*--compressor torch:fp16 is not a plain codec"):
        run_compare(CompareConfig(compressors=["local-adamw+torch:fp16"], out=str(tmp_path / "c")))
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 1"):
        run_compare(CompareConfig(compressors=["onebit-adam:warmup_steps=0"], out=str(tmp_path / "c")))
    # the entry is named, not an --optimizer option this command does not have
    with pytest.raises(ValueError, match=r"^--compressors entry 'tsr-adam:bogus=2': tsr-adam has no parameter 'bogus'"):
        run_compare(CompareConfig(compressors=["none", "tsr-adam:bogus=2"], out=str(tmp_path / "c")))


def test_an_optimizer_that_sends_everything_itself_runs_no_hook_codec(capsys, tmp_path):
    """tsr-adam and demo never ask DDP's hook for a mean: the default --compressor becomes none (so
    the run says what it sends), another codec is refused; the hook's users keep it."""
    from gradzip.lab.train.config import DEFAULT_COMPRESSOR, TrainConfig
    from gradzip.lab.train.optimizers import label

    for spec in ("demo", "tsr-adam:approx_rank=8", "DEMO"):
        assert TrainConfig(optimizer=spec).validate().compressor == "none"
    for spec in ("adamw", "onebit-adam", "zeroone-adam"):
        assert TrainConfig(optimizer=spec).validate().compressor == DEFAULT_COMPRESSOR
    assert main(["train", "--optimizer", "demo", "--compressor", "topk:ratio=0.01", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--compressor topk:ratio=0.01 would never run: --optimizer demo sends its own payload" in err
    assert err.count("\n") == 1
    assert main(["train", "--optimizer", "demo", "--no-exchange", "--out", str(tmp_path / "x")]) == 2
    assert "--no-exchange measures compute alone with adamw" in capsys.readouterr().err
    assert label("adamw", "fp16") == "fp16"
    assert label("demo", "none") == "demo"
    assert label("onebit-adam", "fp16") == "onebit-adam + fp16"


def test_compressed_optimizer_refuses_fsdp(capsys, tmp_path):
    assert main(["train", "--fsdp", "--compressor", "none", "--optimizer", "onebit-adam", "--out", str(tmp_path / "x")]) == 2
    assert "with --fsdp use adamw" in capsys.readouterr().err


def test_a_run_shorter_than_the_dense_steps_of_1bit_adam_is_told():
    from gradzip.lab.train.config import TrainConfig
    from gradzip.lab.train.optimizers import dense_steps_note

    note = dense_steps_note(TrainConfig(optimizer="onebit-adam:warmup_steps=60", steps=4))
    assert note == ("--optimizer onebit-adam: its 60 full-precision steps (warmup_steps) cover all 4 steps, so it "
                    "never sends a 1-bit momentum; give warmup_steps=N below --steps")
    # the default, max(--warmup-steps 20, 20% of 4): 20
    assert "its 20 full-precision steps (var_freeze_step; the default" in dense_steps_note(
        TrainConfig(optimizer="zeroone-adam", steps=4))
    assert dense_steps_note(TrainConfig(optimizer="onebit-adam:warmup_steps=3", steps=4)) is None
    assert dense_steps_note(TrainConfig(optimizer="onebit-adam", steps=300)) is None  # 60 of 300
    assert dense_steps_note(TrainConfig(optimizer="demo", steps=4)) is None


@pytest.mark.e2e
def test_a_local_adamw_run_resumes_only_on_its_codec_and_route(tmp_path, capsys):
    first = tmp_path / "first"
    base = ["train", *TINY, "--optimizer", "local-adamw", "--compressor", "topk:ratio=0.01", "--quiet"]
    assert main([*base, "--steps", "3", "--checkpoint-every", "2", "--out", str(first)]) == 0
    capsys.readouterr()
    for extra, flag in ((["--collective", "twophase"], "--collective"), (["--compressor", "efsignsgd"], "--compressor")):
        assert main([*base, *extra, "--steps", "6", "--resume", str(first), "--out", str(tmp_path / "again")]) == 2
        err = capsys.readouterr().err
        assert f"was saved with other settings: {flag}" in err and err.count("\n") == 1
