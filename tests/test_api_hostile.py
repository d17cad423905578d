"""Hostile inputs to the library API as a user's own training loop drives it: the optimizers of
gradzip.optim, DiLoCo, the DDP hook's state, FSDP and the reducers, each found to break once
(a crash deep inside torch, a refusal of the library's own output, numbers silently wrong)."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import diloco_runs
from helpers.optim_runs import backward, small_optimizers, tiny_model
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import LambdaLR

import gradzip
import gradzip.fsdp
from gradzip.feedback import DGCMemory
from gradzip.optim import DeMo, LocalAdamW, OneBitAdam, TSRAdam, ZeroOneAdam
from gradzip.testing import run_ranks


def _reloaded(state_dict: dict) -> dict:
    """``state_dict`` through ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _nan_first_step(model, opt):
    backward(model, 0, 0)
    model[2].bias.grad[0] = float("nan")
    opt.step()  # skipped: it leaves no moments, only the empty state entry torch's lookup made
    assert opt.last_step_skipped


def _payload_before_the_first_step(model, opt):
    backward(model, 0, 0)
    opt.payload_nbytes()
    opt.zero_grad()


def _synchronize_before_the_first_step(model, opt):
    opt.synchronize()  # before a checkpoint, as the docs advise


UNSTEPPED = {
    "local-adamw": (lambda p: LocalAdamW(p, compressor="topk:ratio=0.5"), _nan_first_step),
    "demo": (lambda p: DeMo(p, compression_topk=2, compression_chunk=4), _nan_first_step),
    "tsr-adam": (lambda p: TSRAdam(p, approx_rank=2), _payload_before_the_first_step),
    "zeroone-adam": (lambda p: ZeroOneAdam(p, var_freeze_step=1), _synchronize_before_the_first_step),
}


@pytest.mark.parametrize("name", sorted(UNSTEPPED))
def test_a_state_dict_with_parameters_not_stepped_yet_loads_and_resumes_exactly(name):
    # Such a state_dict holds an empty state for those parameters; its own optimizer refused it
    # ("a parameter's state lacks ...", "moments ... do not fit"): the checkpoint could not resume.
    make, prepare = UNSTEPPED[name]
    model, fresh = tiny_model(), tiny_model()
    opt, other = make(model.parameters()), make(fresh.parameters())
    prepare(model, opt)
    saved = _reloaded(opt.state_dict())
    assert any(s == {} for s in saved["state"].values())
    other.load_state_dict(saved)
    for step in range(1, 4):
        for m, o in ((model, opt), (fresh, other)):
            o.zero_grad()
            backward(m, 0, step)
            o.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


ALL = small_optimizers()


@pytest.mark.parametrize("name", sorted(ALL))
def test_a_state_dict_saved_where_a_schedule_put_lr_at_0_loads_and_resumes(name):
    # Warm-up from 0 (transformers' linear and cosine schedules) sets every group's lr to 0 at
    # step 0 and decays it to 0 at the end; the optimizers refused such a state_dict of their own
    # ("lr must be a number > 0").
    def warmup(s):
        return s / 2

    model, fresh = tiny_model(), tiny_model()
    opt, other = ALL[name](model.parameters()), ALL[name](fresh.parameters())
    schedule, other_schedule = LambdaLR(opt, warmup), LambdaLR(other, warmup)
    assert opt.param_groups[0]["lr"] == 0
    other.load_state_dict(_reloaded(opt.state_dict()))
    other_schedule.load_state_dict(schedule.state_dict())
    for step in range(3):
        for m, o, s in ((model, opt, schedule), (fresh, other, other_schedule)):
            o.zero_grad()
            backward(m, 0, step)
            o.step()
            s.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def _group(params, **settings):
    return [{"params": list(params), **settings}]


NOT_A_FLAG = {
    "average_grads": lambda p: OneBitAdam(p, average_grads="no"),
    "average_grads ": lambda p: ZeroOneAdam(p, average_grads="no"),
    "moment_transfer": lambda p: TSRAdam(p, approx_rank=2, moment_transfer="False"),
    "compress": lambda p: OneBitAdam(_group(p, compress="no")),
    "compress ": lambda p: TSRAdam(_group(p, compress="False"), approx_rank=2),
    "masking": lambda p: DGCMemory(masking="no"),
}


@pytest.mark.parametrize("name", sorted(NOT_A_FLAG))
def test_a_true_false_setting_given_a_string_is_refused(name):
    # bool("no") is True: "no" turned the setting on without a word
    with pytest.raises(ValueError, match=rf"^{name.strip()} must be True or False; got '"):
        NOT_A_FLAG[name](tiny_model().parameters())


def _fsdp_flag_ranks(rank, world_size):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fully_shard(model)
    try:
        gradzip.fsdp.compress_reduce_scatter(model, "topk:ratio=0.5", reduce_scatter_unused_params="no")
    except ValueError as exc:
        return str(exc)
    return None


def test_fsdp_reduce_scatter_unused_params_given_a_string_is_refused():
    assert run_ranks(_fsdp_flag_ranks, 1)[0].startswith("reduce_scatter_unused_params must be True, False or None")


def _diloco_beside_own_collectives(rank, world_size):
    out = []
    for log in (False, True):
        model = diloco_runs.tiny_model()
        opt = gradzip.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=0.01), "countsketch", sync_every=4, delay=2)
        for step in range(1, 25):
            opt.zero_grad()
            loss = diloco_runs.loss_of(model, rank, step)
            loss.backward()
            opt.step()
            if log:  # the user's own collective on the default group, an exchange in flight
                torch.distributed.all_reduce(loss.detach().clone())
        opt.synchronize()
        out.append(diloco_runs.flat(model.parameters()))
    return out


def test_diloco_on_the_default_group_beside_the_callers_own_collectives():
    # A later round of the count sketch's exchange was launched from a callback: on one rank
    # before the caller's all_reduce, on the other after it; gloo aborted the ranks ("Received
    # data size doesn't match expected size") or they hung.
    results = run_ranks(_diloco_beside_own_collectives, 2, timeout_s=60)
    for quiet, logged in results:
        assert torch.equal(quiet, logged)


def _other_model() -> torch.nn.Module:
    """As many parameters as tiny_model's, of other shapes."""
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 7))


@pytest.mark.parametrize("name", [*sorted(ALL), "adamw"])
def test_another_models_state_dict_is_refused_before_anything_loads(name):
    # It loaded (1-bit, 0/1 and TSR-Adam, DeMo; LocalAdamW had a check of its own, now the shared
    # one) and the next step failed inside torch ("The size of tensor a (5) must match the size of
    # tensor b (8)"), the optimizer's own state already replaced.
    other = _other_model()
    writer = torch.optim.AdamW(other.parameters()) if name == "adamw" else ALL[name](other.parameters())
    other(torch.randn(2, 5)).square().sum().backward()
    writer.step()
    model = tiny_model()
    opt = ALL["onebit-adam" if name == "adamw" else name](model.parameters())
    backward(model, 0, 0)
    opt.step()
    before = _reloaded(opt.state_dict())
    with pytest.raises(ValueError, match=r"of parameter 0 is \(\d, \d\) where this optimizer's parameter needs .* do not fit"):
        opt.load_state_dict(writer.state_dict())
    after = opt.state_dict()
    for index, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(after["state"][index][key]), torch.as_tensor(value))
    opt.zero_grad()
    backward(model, 0, 1)
    opt.step()


@pytest.mark.parametrize("make", [lambda p: OneBitAdam(p, warmup_steps=1), lambda p: ZeroOneAdam(p, var_freeze_step=1)],
                         ids=["onebit-adam", "zeroone-adam"])
def test_a_parameter_without_variance_is_refused_before_the_step_changes_anything(make):
    # The error came from the update of that parameter, after every momentum had been updated and
    # the parameters before it stepped: the step was half taken, and retaking it stepped twice.
    used, late = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    twin = torch.nn.Parameter(torch.zeros(2))
    opt, reference = make([used, late]), make([twin])
    for p, o in ((used, opt), (twin, reference)):
        p.grad = torch.ones(2)
        o.step()
    before = _reloaded(opt.state_dict())
    used.grad, late.grad = torch.full((2,), 0.5), torch.ones(2)  # late: its first gradient, after warm-up
    with pytest.raises(ValueError, match=r"shape \(2,\) had no gradient during the full-precision steps"):
        opt.step()
    assert 1 not in opt.state_dict()["state"] or opt.state_dict()["state"][1] == {}
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
    late.grad = None  # the user leaves it out and takes the step again
    twin.grad = torch.full((2,), 0.5)
    opt.step()
    reference.step()
    assert torch.equal(used, twin)


def test_diloco_without_a_process_group_is_refused_at_its_first_step_before_it_changes_anything():
    # built without a group it is (the trainer checks its settings so); stepped, there is no
    # outer exchange to run, so the first step says so instead of failing sync_every steps later
    import torch.distributed as dist

    assert not dist.is_initialized()
    model = torch.nn.Linear(2, 2)
    outer = gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 2)).sum().backward()
    for call in (outer.step, outer.skip_step):
        with pytest.raises(RuntimeError, match="dist.init_process_group"):
            call()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert outer.inner_steps == 0
