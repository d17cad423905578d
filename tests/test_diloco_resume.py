"""DiLoCo resumes exactly from a checkpoint taken after any inner step of the cycle: with an
exchange in flight, between fragments, with error-feedback residuals (Top-K on the outer
exchange) and in SparseLoCo mode."""

import io
import re

import pytest
import torch
from helpers.diloco_runs import flat, inner_optimizer, loss_of, tiny_model

import gradzip
from gradzip.testing import run_ranks

STEPS = 10
CONFIGS = {
    "streaming_topk": {"compressor": "topk:ratio=0.3", "error_feedback": True, "sync_every": 4, "fragments": 2, "delay": 1, "mix": 0.5},
    "streaming_carry": {"compressor": "uniform:bits=4", "sync_every": 4, "fragments": 2, "delay": 1, "carry": True},
    # delay 3 over 2 steps between fragments: both fragments' exchanges in flight at once
    "streaming_overlap": {"compressor": "uniform:bits=4", "sync_every": 4, "fragments": 2, "delay": 3, "carry": True},
    "sparseloco": {"compressor": "topk:ratio=0.3", "method": "sparseloco", "sync_every": 3, "delay": 2, "outer_lr": 1.0},
}


def _build(cfg):
    model = tiny_model()
    return model, gradzip.DiLoCo(model, inner_optimizer(model.parameters(), "adamw"), **cfg)


def _steps(model, opt, rank, start, stop):
    for step in range(start, stop + 1):
        loss_of(model, rank, step).backward()
        opt.step()
        opt.zero_grad()


def resume_everywhere(rank, world_size, cfg):
    model, opt = _build(cfg)
    _steps(model, opt, rank, 1, STEPS)
    opt.synchronize()
    uninterrupted = (flat(model.parameters()), flat(opt.global_params))
    resumed = {}
    for save_at in range(1, STEPS):
        model, opt = _build(cfg)
        _steps(model, opt, rank, 1, save_at)
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "diloco": opt.state_dict()}, buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=False)
        model, opt = _build(cfg)  # fresh objects
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["diloco"])
        _steps(model, opt, rank, save_at + 1, STEPS)
        opt.synchronize()
        resumed[save_at] = (flat(model.parameters()), flat(opt.global_params))
    return uninterrupted, resumed


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_resume_at_every_step_of_the_cycle_is_bit_exact(name):
    for uninterrupted, resumed in run_ranks(resume_everywhere, 2, CONFIGS[name]):
        assert not torch.equal(uninterrupted[1], flat(tiny_model().parameters()))
        for save_at, (params, global_params) in resumed.items():
            assert torch.equal(params, uninterrupted[0]), save_at
            assert torch.equal(global_params, uninterrupted[1]), save_at


def test_loading_a_checkpoint_of_other_settings_raises():
    model, opt = _build({"sync_every": 4})
    other = _build({"sync_every": 5})[1]
    with pytest.raises(ValueError, match="settings"):
        other.load_state_dict(opt.state_dict())


def test_loading_a_foreign_or_reshaped_checkpoint_raises_and_changes_nothing():
    model, opt = _build({"sync_every": 4})
    with pytest.raises(ValueError, match="not a DiLoCo state_dict"):
        opt.load_state_dict({})
    state = opt.state_dict()
    state["global"] = [g.new_zeros(g.numel() + 1) for g in state["global"]]
    before = [g.clone() for g in opt.global_params]
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(before, opt.global_params))


@pytest.mark.parametrize(
    "other, differ",
    [({"bucket_cap_mb": 0}, "buckets [1], now [6]"), ({"error_feedback": False}, "error_feedback True, now False")],
)
def test_a_state_of_other_buckets_or_error_feedback_is_refused_by_name(other, differ):
    base = {"compressor": "topk:ratio=0.5", "sync_every": 4, "error_feedback": True}
    state = _build(base)[1].state_dict()
    with pytest.raises(ValueError, match=re.escape(f"({differ})") + "$"):
        _build({**base, **other})[1].load_state_dict(state)


def test_a_damaged_state_is_refused_and_a_part_loaded_is_taken_back():
    good = _build({"compressor": "topk:ratio=0.5", "sync_every": 2, "error_feedback": True})[1].state_dict()
    # a state further on than the one it is loaded into: a part loaded would show
    good = {**good, "inner_steps": 5, "global": [g + 1 for g in good["global"]]}
    fresh = _build({"compressor": "topk:ratio=0.5", "sync_every": 2, "error_feedback": True})[1]
    before = fresh.state_dict()
    short = {**good, "global": good["global"][:-1]}
    with pytest.raises(ValueError, match="checkpoint holds 5 global parameters; the model trains 6"):
        fresh.load_state_dict(short)
    for damaged in ({**good, "outer": {}}, {**good, "reducers": [{}]}):
        with pytest.raises(ValueError, match="not a loadable DiLoCo state_dict .*nothing was changed"):
            fresh.load_state_dict(damaged)
        after = fresh.state_dict()
        assert after["inner_steps"] == before["inner_steps"] == 0
        assert all(torch.equal(a, b) for a, b in zip(after["global"], before["global"]))
        assert after["outer"].keys() == before["outer"].keys()


def test_a_model_without_trainable_parameters_or_a_non_bool_error_feedback_is_refused():
    frozen = tiny_model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        gradzip.DiLoCo(frozen, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), "none", sync_every=2)
    model = tiny_model()
    for bad in ("yes", "no", 1):
        with pytest.raises(ValueError, match="error_feedback must be True, False or None"):
            gradzip.DiLoCo(model, inner_optimizer(model.parameters(), "adamw"), "topk:ratio=0.5", sync_every=2,
                           error_feedback=bad)


def resume_shared_replicas(rank, world_size, save_points):
    """2 replicas of 2 ranks sharing the exchange out, saved while an exchange is in flight."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    replica_group, outer_group = gradzip.replica_groups(world_size, 2)
    cfg = {**CONFIGS["streaming_topk"], "group": outer_group, "replica_group": replica_group}

    def build():
        ddp = DDP(tiny_model(), process_group=replica_group)
        return ddp, gradzip.DiLoCo(ddp, inner_optimizer(ddp.parameters(), "adamw"), **cfg)

    model, opt = build()
    _steps(model, opt, rank, 1, STEPS)
    opt.synchronize()
    uninterrupted = flat(model.parameters())
    resumed = {}
    for save_at in save_points:
        model, opt = build()
        _steps(model, opt, rank, 1, save_at)
        in_flight = len(opt.pending)
        state = {"model": model.state_dict(), "diloco": opt.state_dict()}
        model, opt = build()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["diloco"])
        _steps(model, opt, rank, save_at + 1, STEPS)
        opt.synchronize()
        resumed[save_at] = (in_flight, flat(model.parameters()))
    return uninterrupted, resumed


def test_resume_with_replicas_sharing_the_exchange_is_bit_exact():
    for uninterrupted, resumed in run_ranks(resume_shared_replicas, 4, [2, 6]):
        for save_at, (in_flight, params) in resumed.items():
            assert in_flight == 1, save_at
            assert torch.equal(params, uninterrupted), save_at
