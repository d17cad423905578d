"""The status line ``gradzip compare`` shows while an entry trains, read from its metrics file."""

from __future__ import annotations

import io
import json
import time

from gradzip.lab.compare.progress import EntryProgress, status_line
from gradzip.lab.train.tail import MetricsTail


def test_tail_returns_complete_lines_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []  # no file yet
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0}) + "\n" + '{"step": 1, "lo')
    assert tail.read() == [{"step": 0}]
    with open(path, "a") as f:
        f.write('ss": 2.5}\nnot json\n[1]\n')
    assert tail.read() == [{"step": 1, "loss": 2.5}]  # the half line once complete; junk skipped
    assert tail.read() == []


def test_progress_follows_steps_and_the_last_validation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    now = [100.0]
    progress = EntryProgress(path, "[2/5] fp16", 40, stream=io.StringIO(), clock=lambda: now[0])
    progress._start = 100.0
    assert progress.update() == "[2/5] fp16  starting  (0 s)"
    with open(path, "w") as f:
        for step, loss in enumerate([6.0, 5.5, 5.25]):
            record = {"step": step, "loss": loss}
            if step == 1:
                record["val_loss"] = 5.75
            f.write(json.dumps(record) + "\n")
    now[0] = 131.0
    assert progress.update() == "[2/5] fp16  step 3/40  loss 5.2500  val 5.7500  (31 s)"
    assert status_line("x", 10, {"step": 9}, None, 2.4) == "x  step 10/10  (2 s)"


def test_progress_prints_lines_to_a_log_at_most_every_interval(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 4, "loss": 3.0}) + "\n")
    out = io.StringIO()
    with EntryProgress(path, "none", 10, stream=out, poll_s=0.01, every_s=0.0):
        deadline = time.monotonic() + 10
        while "step 5/10" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.005)
    lines = out.getvalue().splitlines()
    assert lines and all(line.startswith("none  step 5/10  loss 3.0000") for line in lines)
    assert "\r" not in out.getvalue()  # not a terminal: whole lines only
