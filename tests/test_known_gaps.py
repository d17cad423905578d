"""The gaps ``gradzip train`` says for biased codecs are the study's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradzip.lab.train.known_gaps import MEASURED, gap_note

STUDY = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "remedies_main_job"


def _final(run: str) -> float:
    return json.loads((STUDY / run / "summary.json").read_text())["final_val_loss"]


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_each_figure_is_its_runs_gap_to_none(name):
    none = _final("none")
    for _setting, run, gap in MEASURED[name]:
        summary = json.loads((STUDY / run / "summary.json").read_text())
        assert summary["world_size"] == 3 and summary["steps"] == 200 and summary["seed"] == 1
        assert round((_final(run) / none - 1) * 100, 1) == gap, run


def test_the_note_names_the_setting_and_its_figure_and_only_for_measured_codecs():
    note = gap_note("topk:ratio=0.05")
    setting, _run, gap = MEASURED["topk"][0]
    assert f"{setting} +{gap:.1f}%" in note and "remedies_main_job" in note
    for spec in ("none", "powersgd", "auto", "kimad", "torch:fp16", "fp16"):
        assert gap_note(spec) is None, spec
