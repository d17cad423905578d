"""What ``loss.png`` draws (``gradzip.lab.train.report.loss_curves``): the trailing mean of the
train loss over a window that follows the run's length, and the validation points with the loss
before training at step 0."""

import pytest

from gradzip.lab.train.report import loss_curves


def test_trailing_mean_and_validation_points():
    # 40 steps: a window of 2; losses 0, 1, 2, ... so the mean of a full window is i - 0.5
    records = [{"step": i, "loss": float(i)} for i in range(40)]
    records[19]["val_loss"], records[39]["val_loss"] = 5.0, 4.0
    steps, losses, smooth, val = loss_curves(records, initial_val_loss=7.5)
    assert steps == list(range(40)) and losses == [float(i) for i in range(40)]
    assert smooth[0] == 0.0 and smooth[1:] == pytest.approx([i - 0.5 for i in range(1, 40)])
    assert val == [(0, 7.5), (19, 5.0), (39, 4.0)]
    # a short run's curve is its losses (window 1); a validation already at step 0 is not doubled
    short = [{"step": i, "loss": 10.0 - i} for i in range(12)]
    short[0]["val_loss"] = 9.0
    _, _, smooth, val = loss_curves(short, initial_val_loss=9.5)
    assert smooth == [10.0 - i for i in range(12)] and val == [(0, 9.0)]
    assert loss_curves(short)[3] == [(0, 9.0)]
