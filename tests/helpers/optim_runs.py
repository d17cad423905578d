"""The tiny model, data and training loop the tests of the optimizers that own their exchange
(DeMo, LocalAdamW; TSR-Adam the loop) share: every rank draws its own batch from (rank, step)."""

from __future__ import annotations

import copy

import torch


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """Linear(8, 6), Tanh, Linear(6, 5), initialised from ``seed`` without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5))


def backward(model: torch.nn.Module, rank: int, step: int) -> None:
    """The gradient of an MSE loss on rank ``rank``'s batch of step ``step``."""
    gen = torch.Generator().manual_seed(1009 * rank + step)
    x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 5, generator=gen)
    torch.nn.functional.mse_loss(model(x), y).backward()


def train(rank: int, model, opt, steps, *, resume_at: int | None = None, saves: list | None = None,
          bytes_log: list | None = None, grad=None) -> None:
    """Steps ``steps`` of ``opt``; before step ``resume_at`` the model's and the optimizer's state
    are appended to ``saves``; ``bytes_log`` gets ``(opt.payload_nbytes() before the step, the
    step's popped metrics)`` per step. ``grad(model, rank, step)`` computes the gradients
    (:func:`backward` unless given)."""
    grad = backward if grad is None else grad
    for step in steps:
        if saves is not None and step == resume_at:
            saves.append((copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())))
        opt.zero_grad()
        grad(model, rank, step)
        predicted = opt.payload_nbytes()
        opt.step()
        popped = opt.metrics.pop()
        if bytes_log is not None:
            bytes_log.append((predicted, popped))


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of ``model``'s parameters, in order."""
    return [p.detach().clone() for p in model.parameters()]


def all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two lists of tensors are equal, tensor for tensor and bit for bit."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def params_unchanged(before: dict, model: torch.nn.Module) -> bool:
    """Whether ``model``'s state equals ``before`` (a state_dict taken earlier), bit for bit."""
    return all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))


def skip_and_retake(rank: int, model, opt, steps, *, bad_steps, spoil, check, grad=None) -> list:
    """Steps ``steps`` of ``opt``; at each step in ``bad_steps``, ``spoil(model, rank)`` makes this
    rank's gradient non-finite (or leaves it, on the ranks it spares) and the step is taken, which
    every rank must skip; ``check(before, model, opt)`` records what it left (``before``: deep
    copies of the model's and the optimizer's state_dict from just before); then the step is
    retaken on the clean gradient. Returns the records. ``grad`` as for :func:`train`."""
    grad = backward if grad is None else grad
    records = []
    for step in steps:
        opt.zero_grad()
        grad(model, rank, step)
        if step in bad_steps:
            before = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
            spoil(model, rank)
            opt.step()
            records.append(check(before, model, opt))
            opt.zero_grad()
            grad(model, rank, step)
        opt.step()
    return records


def resumed(rank: int, saved: tuple, model, opt, steps, *, grad=None) -> list[torch.Tensor]:
    """``model`` and ``opt`` (fresh) loaded from ``saved`` (a ``(model, optimizer)`` state pair
    :func:`train` saved), trained on over ``steps``; returns the parameters reached."""
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    train(rank, model, opt, steps, grad=grad)
    return [p.detach().clone() for p in model.parameters()]


def nan_in_rank0_bias(model: torch.nn.Module, rank: int) -> None:
    """A ``spoil`` for :func:`skip_and_retake`: rank 0's last bias gradient gets a NaN."""
    if rank == 0:
        model[2].bias.grad[1] = float("nan")


def small_optimizers() -> dict:
    """Each gradzip optimizer, by its lab name, as a function of the parameters: small settings
    that take effect at once on a tiny model (a two-element top-k, rank 2, one warm-up step)."""
    from gradzip.optim import DeMo, LocalAdamW, OneBitAdam, TSRAdam, ZeroOneAdam

    return {
        "demo": lambda params: DeMo(params, lr=1e-2, compression_topk=2, compression_chunk=4),
        "local-adamw": lambda params: LocalAdamW(params, lr=1e-2, compressor="topk:ratio=0.5"),
        "onebit-adam": lambda params: OneBitAdam(params, lr=1e-2, warmup_steps=1),
        "tsr-adam": lambda params: TSRAdam(params, lr=1e-2, approx_rank=2),
        "zeroone-adam": lambda params: ZeroOneAdam(params, lr=1e-2, var_freeze_step=1),
    }
