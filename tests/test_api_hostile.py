"""Hostile inputs to the library API as a user's own training loop drives it: the optimizers of
gradzip.optim, DiLoCo, the DDP hook's state, FSDP and the reducers, each found to break once
(a crash deep inside torch, a refusal of the library's own output, numbers silently wrong)."""

from __future__ import annotations

import io

import pytest
import torch
from helpers.optim_runs import backward, tiny_model

from gradzip.optim import DeMo, LocalAdamW, TSRAdam, ZeroOneAdam


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
