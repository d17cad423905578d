"""The gaps ``gradzip train`` says for biased codecs are the study's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradzip.lab.train.known_gaps import MEASURED, OPTIMIZER_MEASURED, gap_note

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
STUDY = RESULTS / "remedies_main_job"
OPTIMIZER_STUDY = RESULTS / "optimizers_subspace" / "next_token"


def _final(run: str) -> float:
    return json.loads((STUDY / run / "summary.json").read_text())["final_val_loss"]


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_each_figure_is_its_runs_gap_to_none(name):
    none = _final("none")
    for _setting, run, gap in MEASURED[name]:
        summary = json.loads((STUDY / run / "summary.json").read_text())
        assert summary["world_size"] == 3 and summary["steps"] == 200 and summary["seed"] == 1
        assert round((_final(run) / none - 1) * 100, 1) == gap, run


@pytest.mark.parametrize("name", sorted(OPTIMIZER_MEASURED))
def test_each_optimizer_figure_is_its_runs_gap_to_adamw(name):
    adamw = json.loads((OPTIMIZER_STUDY / "adamw" / "summary.json").read_text())
    assert adamw["optimizer"] == "adamw"
    for _setting, run, gap in OPTIMIZER_MEASURED[name]:
        summary = json.loads((OPTIMIZER_STUDY / run / "summary.json").read_text())
        assert summary["optimizer"].partition(":")[0] == name and summary["compressor"] == "none"
        for key in ("world_size", "steps", "seed", "parameters"):
            assert summary[key] == adamw[key], (run, key)
        assert round((summary["final_val_loss"] / adamw["final_val_loss"] - 1) * 100, 1) == gap, run


def test_the_note_names_the_setting_and_its_figure_and_only_for_measured_codecs():
    note = gap_note("topk:ratio=0.05")
    setting, _run, gap = MEASURED["topk"][0]
    assert f"{setting} +{gap:.1f}%" in note and "remedies_main_job" in note
    assert "PowerSGD at rank 4 (its default) +3.0%" in gap_note("powersgd:approx_rank=8")
    for spec in ("none", "auto", "kimad", "torch:fp16", "fp16", "int8"):
        assert gap_note(spec) is None, spec


def test_an_optimizer_that_sends_its_own_subspace_gets_its_figures_above_adamw():
    note = gap_note("none", "demo:compression_topk=44")
    assert note.startswith("measured final validation loss above AdamW: DeMo at the paper's settings")
    assert "+4.5%" in note and "optimizers_subspace" in note
    assert "TSR-Adam at its defaults (14.4x fewer bytes) +11.0%" in gap_note("none", "tsr-adam")
    # AdamW and the optimizers not measured on this objective leave the codec's note alone
    assert gap_note("topk", "local-adamw") == gap_note("topk")
    for optimizer in ("adamw", "onebit-adam", "zeroone-adam:var_freeze_step=50"):
        assert gap_note("none", optimizer) is None, optimizer
