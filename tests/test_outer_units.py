"""Single-process pieces of the outer loop: the schedule, the outer Nesterov step against
``torch.optim.SGD``, error feedback with decay, and bucketing."""

import pytest
import torch

from gradzip.comm import make_reducer
from gradzip.feedback import ErrorFeedback
from gradzip.outer.exchange import make_buckets
from gradzip.outer.nesterov import OuterNesterov
from gradzip.outer.schedule import Schedule, strided_fragments


def test_schedule_spreads_fragments_through_the_cycle():
    s = Schedule(sync_every=10, fragments=4, delay=1, n_tensors=9)
    assert [s.send_offset(p) for p in range(4)] == [2, 5, 7, 10]
    sends = {t: s.sends_after(t) for t in range(1, 31)}
    assert {t: f for t, f in sends.items() if f} == {
        c * 10 + o: [p] for c in range(3) for p, o in enumerate([2, 5, 7, 10])
    }
    assert strided_fragments(9, 4) == [[0, 4, 8], [1, 5], [2, 6], [3, 7]]
    one = Schedule(sync_every=3, fragments=1, delay=0, n_tensors=1)
    assert [t for t in range(1, 10) if one.sends_after(t)] == [3, 6, 9]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_outer_nesterov_equals_torch_sgd_bit_for_bit(momentum):
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)]
    theirs = [t.clone() for t in ours]
    outer = OuterNesterov(ours, lr=0.7, momentum=momentum)
    sgd = torch.optim.SGD(theirs, lr=0.7, momentum=momentum, nesterov=momentum > 0)
    for step in range(4):
        grads = [torch.randn_like(t, generator=gen) for t in ours]
        active = [0, 1] if step % 2 == 0 else [1]  # fragments step separately
        outer.step(active, [grads[i] for i in active])
        for i, t in enumerate(theirs):
            t.grad = grads[i] if i in active else None
        sgd.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    restored = OuterNesterov([t.clone() for t in ours], lr=0.7, momentum=momentum)
    restored.load_state_dict(outer.state_dict())
    g = torch.ones(4)
    restored.step([1], [g])
    outer.step([1], [g])
    assert torch.equal(restored.params[1], outer.params[1])


def test_error_feedback_decay_scales_the_residual_it_adds_back():
    fb = ErrorFeedback(decay=0.5)
    g = torch.tensor([1.0, -2.0, 3.0])
    first = fb.compensate("k", g, step=0)
    fb.update("k", first, torch.tensor([1.0, 0.0, 0.0]), step=0)  # residual [0, -2, 3]
    second = fb.compensate("k", g, step=1)
    assert torch.equal(second, torch.tensor([1.0, -3.0, 4.5]))
    assert torch.equal(second - torch.tensor([0.0, 0.0, 4.5]), torch.tensor([1.0, -3.0, 0.0]))
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match=r"feedback_decay must be a number in \(0, 1\]"):
            ErrorFeedback(decay=bad)


def test_feedback_decay_needs_error_feedback_and_a_single_round_codec():
    with pytest.raises(ValueError, match="feedback_decay needs error feedback on"):
        make_reducer("fp16", error_feedback=False, feedback_decay=0.9)
    with pytest.raises(ValueError, match="feedback_decay applies to single-round codecs"):
        make_reducer("powersgd", feedback_decay=0.9)
    assert make_reducer("topk:ratio=0.1", error_feedback=True, feedback_decay=0.9).feedback.decay == 0.9


def test_buckets_hold_one_dtype_and_respect_the_cap():
    params = [torch.zeros(10), torch.zeros(10, dtype=torch.float16), torch.zeros(30), torch.zeros(5), torch.zeros(2)]
    buckets = make_buckets(1, [0, 1, 2, 3, 4], params, cap_bytes=100)
    assert [b.indices for b in buckets] == [(0,), (2,), (3, 4), (1,)]
    assert [b.key for b in buckets] == [("outer", 1, 0), ("outer", 1, 1), ("outer", 1, 2), ("outer", 1, 3)]
    assert [b.indices for b in make_buckets(0, [0, 2], params, cap_bytes=0)] == [(0,), (2,)]
