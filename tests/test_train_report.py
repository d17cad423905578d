"""The run summary's count of steps where a count sketch did not peel its whole support."""

import math

from gradzip.lab.train.report import divergence, summarize, unpeeled_note


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
