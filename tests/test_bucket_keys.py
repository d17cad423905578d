"""Bucket keys by parameter (gradzip.keys): residuals follow their parameters into a new bucket
layout, never onto another tensor; server-side chunk residuals restart; numbering checks."""

import warnings

import pytest
import torch

import gradzip
from gradzip.ddp import ParameterNumbers
from gradzip.feedback import ErrorFeedback
from gradzip.keys import bucket_key, label, regroup, tensor_key


def test_regroup_lays_out_each_parameter_from_the_old_buckets():
    # Old layout: [p0 (3) | p1 (2)] and [p2 (4)]; new layout: [p2 | p0] and [p1].
    store = {
        bucket_key([0, 1], [3, 2]): torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0]),
        bucket_key([2], [4]): torch.tensor([7.0, 8.0, 9.0, 6.0]),
        "plain": torch.zeros(2),
    }
    first = regroup(store, bucket_key([2, 0], [4, 3]))
    assert torch.equal(first, torch.tensor([7.0, 8.0, 9.0, 6.0, 1.0, 2.0, 3.0]))
    # p1 waits under its own key until a bucket claims it; the old keys are gone.
    assert set(store) == {bucket_key([2, 0], [4, 3]), tensor_key(bucket_key([1], [2]), 0), "plain"}
    second = regroup(store, bucket_key([1], [2]))
    assert torch.equal(second, torch.tensor([10.0, 20.0]))
    assert set(store) == {bucket_key([2, 0], [4, 3]), bucket_key([1], [2]), "plain"}


def test_regroup_zero_fills_parameters_no_entry_held_and_ignores_plain_keys():
    store = {bucket_key([0], [2]): torch.tensor([5.0, 6.0])}
    out = regroup(store, bucket_key([3, 0], [1, 2]))
    assert torch.equal(out, torch.tensor([0.0, 5.0, 6.0]))
    assert regroup(store, bucket_key([9], [4])) is None  # nothing held parameter 9
    assert regroup(store, 7) is None and regroup(store, (7, 0)) is None


def test_regroup_without_follow_drops_overlapping_entries():
    store = {bucket_key([0, 1], [3, 2]): torch.ones(2), bucket_key([5], [1]): torch.ones(1)}  # chunk residuals
    assert regroup(store, bucket_key([1, 0], [2, 3]), follow=False) is None
    assert set(store) == {bucket_key([5], [1])}


def test_tensor_keys_name_a_parameter_in_any_bucket_and_keep_plain_keys():
    assert tensor_key(bucket_key([4, 9], [1, 1]), 1) == tensor_key(bucket_key([9], [1]), 0) == ("param", 9)
    assert tensor_key(3, 1) == (3, 1)


def test_error_feedback_residual_follows_its_parameters_without_a_warning():
    feedback = ErrorFeedback(deferred=True)
    old, new = bucket_key([0, 1], [2, 2]), bucket_key([1, 0], [2, 2])  # same shape, other tensors
    compensated = torch.tensor([1.0, 2.0, 3.0, 4.0])
    feedback.compensate(old, compensated, step=0)
    feedback.update(old, compensated, torch.zeros(4), step=0)
    feedback.commit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = feedback.compensate(new, torch.zeros(4), step=1)
    assert torch.equal(out, torch.tensor([3.0, 4.0, 1.0, 2.0]))
    # Discarding the step keeps the residual in its new layout, as it was before the step.
    feedback.update(new, out, torch.zeros(4), step=1)
    feedback.discard()
    assert list(feedback.residuals) == [new]
    assert torch.equal(feedback.residuals[new], torch.tensor([3.0, 4.0, 1.0, 2.0]))


def test_a_layer_dropped_in_a_step_does_not_stop_another_from_starting_its_residual():
    # A per-layer plan change: layer 1 goes dense (its residual dropped, kept for discard) and,
    # later in the same step, layer 2 is compressed for the first time (no residual to take).
    feedback = ErrorFeedback(deferred=True)
    feedback.update(("param", 1), torch.ones(3), torch.zeros(3), step=0)
    feedback.commit()
    feedback.drop(("param", 1), step=1)
    out = feedback.compensate(("param", 2), torch.full((2,), 5.0), step=1)
    assert torch.equal(out, torch.full((2,), 5.0))
    feedback.update(("param", 2), out, torch.zeros(2), step=1)
    feedback.discard()  # the step is undone: layer 1's residual is back, layer 2 has none
    assert list(feedback.residuals) == [("param", 1)]
    assert torch.equal(feedback.residuals[("param", 1)], torch.ones(3))


def test_a_per_parameter_residual_joins_a_flat_bucket_and_back():
    # A matrix residual under its tensor key (PowerSGD's layout) is taken whole into a bucket.
    feedback = ErrorFeedback()
    feedback.residuals[("param", 2)] = torch.arange(6.0).view(2, 3)
    out = feedback.compensate(bucket_key([2], [6]), torch.zeros(6), step=0)
    assert torch.equal(out, torch.arange(6.0))
    back = feedback.compensate(("param", 2), torch.zeros(2, 3), step=1)
    assert torch.equal(back, torch.arange(6.0).view(2, 3))


def test_parameter_numbers_bound_unbound_and_checked_against_a_checkpoint():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    weight0, bias0, weight1, bias1 = model.parameters()
    met = ParameterNumbers()
    assert met.of([bias1, weight1]) == [0, 1] and met.of([weight0, bias1]) == [2, 0]
    bound = ParameterNumbers()
    bound.bind(model)
    assert bound.of([bias1, weight0]) == [3, 0]
    with pytest.raises(ValueError, match="another module"):
        bound.of([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="before the first backward"):
        met.bind(model)
    fresh = ParameterNumbers()
    fresh.expect([1, 2])  # saved where parameter 0 had 1 element and parameter 1 had 2
    with pytest.raises(ValueError, match="parameter 1 has 6 elements, but 2"):
        fresh.of([bias1, weight0])


def test_state_dict_carries_parameter_sizes_and_a_mismatch_is_refused_on_bind():
    model = torch.nn.Linear(3, 2)
    state = gradzip.CompressionState("topk:ratio=0.5").bind(model)
    saved = state.state_dict()
    assert saved["parameters"] == [6, 2]
    other = gradzip.CompressionState("topk:ratio=0.5")
    other.load_state_dict(saved)
    with pytest.raises(ValueError, match="parameter 0 has 4 elements"):
        other.bind(torch.nn.Linear(2, 2))


def test_labels_are_short_and_plain_keys_keep_their_text():
    assert label(bucket_key([6, 5, 4], [1, 1, 1])) == "params 4-6"
    assert label(bucket_key([3, 1], [1, 1])) == "params 1,3"
    assert label(bucket_key([2], [8])) == "param 2"
    assert label(0) == "0" and label("b") == "b"


def test_a_state_saved_before_the_hook_runs_keeps_the_loaded_sizes():
    state = gradzip.CompressionState("topk:ratio=0.5")
    state.load_state_dict({**state.state_dict(), "parameters": [6, 2]})
    assert state.state_dict()["parameters"] == [6, 2]
    state.numbering.of([torch.zeros(6)])
    assert state.state_dict()["parameters"] == [6, 2]
