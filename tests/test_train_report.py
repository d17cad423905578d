"""The run summary (steps a count sketch did not peel, divergence, bytes a hook did not count, the
exposed communication), the progress lines of a run whose stderr is not a terminal, and the
checkpoints a new run clears from its folder."""

import math

from gradzip.lab.train.checkpoint import clear_earlier
from gradzip.lab.train.report import ProgressLines, divergence, summarize, unpeeled_note


def _record(step: int, buckets: dict) -> dict:
    return {"step": step, "payload_bytes": 10, "dense_bytes": 40, "step_s": 1.0, "fwd_bwd_s": 0.5,
            "optimizer_s": 0.1, "compress_s": 0.1, "decompress_s": 0.1, "communicate_s": 0.2,
            "elapsed_s": step + 1.0, "buckets": buckets}


def test_steps_with_unpeeled_coordinates_are_counted_and_noted():
    records = [
        _record(0, {"a": {"unpeeled": 0}, "b": {"unpeeled": 0}}),
        _record(1, {"a": {"unpeeled": 5}, "b": {"unpeeled": 7}}),
        _record(2, {"a": {"unpeeled": 0}, "b": {"unpeeled": 3}}),
    ]
    summary = summarize(records)
    assert (summary["unpeeled_steps"], summary["unpeeled_max"]) == (2, 12)
    note = unpeeled_note(summary)
    assert "2 of 3 steps" in note and "12 coordinates" in note and "width" in note


def test_no_note_where_everything_peeled_or_no_sketch_ran():
    peeled = summarize([_record(0, {"a": {"unpeeled": 0}})])
    assert peeled["unpeeled_steps"] == 0 and unpeeled_note(peeled) is None
    other = summarize([_record(0, {"a": {"codec": "fp16"}})])
    assert "unpeeled_steps" not in other and unpeeled_note(other) is None


def test_divergence_names_the_stop_the_last_finite_loss_or_a_nonfinite_final_loss():
    records = [{"step": 0, "loss": 7.6}, {"step": 1, "loss": 2.5e9}, {"step": 2, "loss": math.nan},
               {"step": 3, "loss": math.inf}]
    stopped = divergence(records, math.nan, diverged_at=2, skipped_in_a_row=10)
    assert stopped.startswith("diverged: from step 2 on every step had a non-finite gradient")
    assert "stopped after 10 in a row; the last finite train loss: 2.5e+09 at step 1; no checkpoint" in stopped
    assert divergence(records, math.nan, diverged_at=None, skipped_in_a_row=2) == (
        "diverged: the final validation loss is nan; the last finite train loss: 2.5e+09 at step 1; the final "
        "checkpoint was not written")
    assert divergence(records[:1], 4.2, diverged_at=None, skipped_in_a_row=0) is None


def test_bytes_a_hook_did_not_count_read_unknown_not_zero():
    step = {"payload_bytes": 0, "dense_bytes": 1000, "sent_bytes": 0, "step_s": 1.0, "fwd_bwd_s": 0.5,
            "optimizer_s": 0.1, "compress_s": 0.0, "decompress_s": 0.0, "communicate_s": 0.0, "elapsed_s": 1.0}
    summary = summarize([step, step])
    assert summary["payload_bytes_per_step"] is None and summary["sent_bytes_per_step"] is None
    assert summary["compression_ratio"] is None and summary["dense_bytes_per_step"] == 1000
    counted = summarize([dict(step, payload_bytes=250, sent_bytes=250)])
    assert counted["payload_bytes_per_step"] == 250 and counted["compression_ratio"] == 4
    # no exchange at all (world size 1): nothing to count, zero is the count
    assert summarize([dict(step, dense_bytes=0)])["payload_bytes_per_step"] == 0


def test_exposed_communication_is_left_out_where_nothing_was_exchanged():
    """fwd_bwd - compute alone - codec is communication only where something travelled; with no
    exchange at all (``--no-exchange``) the same difference is noise and the summary leaves it out."""
    step = {"payload_bytes": 0, "dense_bytes": 0, "sent_bytes": 0, "step_s": 1.0, "fwd_bwd_s": 0.9,
            "optimizer_s": 0.1, "compress_s": 0.0, "decompress_s": 0.0, "communicate_s": 0.0, "elapsed_s": 1.0}
    assert "exposed_communicate_s" not in summarize([step], compute_s=0.8)
    sent = summarize([dict(step, payload_bytes=100, dense_bytes=400, compress_s=0.02, decompress_s=0.03)], compute_s=0.8)
    assert math.isclose(sent["exposed_communicate_s"], 0.9 - 0.8 - 0.05)


def test_progress_lines_print_a_twentieth_of_the_run_and_the_last_step(capsys):
    lines = ProgressLines("train x", total=45, initial=0)
    for step in range(45):
        lines.set_postfix({"loss": f"{10 - step / 10:.3f}"})
        lines.update(1)
    printed = capsys.readouterr().err.splitlines()
    # every 45 // 20 = 2 steps, and step 45
    assert [int(line.split("step ")[1].split("/")[0]) for line in printed] == [*range(2, 45, 2), 45]
    assert printed[-1].startswith("train x: step 45/45 (") and printed[-1].endswith("loss 5.600")


def test_a_new_run_removes_the_checkpoints_an_earlier_run_left(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step-000020", "step-000002", "step-000010"):
        (root / name).mkdir(parents=True)
        (root / name / "rank-0.pt").write_bytes(b"x")
    (root / "latest").write_text("step-000020\n")
    (root / "notes").mkdir()  # not a checkpoint: stays
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert clear_earlier(tmp_path) == ["step-000002", "step-000010", "step-000020"]
    assert sorted(p.name for p in root.iterdir()) == ["notes"]
    assert (tmp_path / "metrics.jsonl").exists()  # the run replaces it itself as it logs
    assert clear_earlier(tmp_path) == [] and clear_earlier(tmp_path / "nowhere") == []
