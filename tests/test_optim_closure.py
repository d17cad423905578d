"""``step(closure)`` on every optimizer of gradzip.optim: the closure runs with autograd on (the
step itself runs under no_grad), its loss is returned, and the step is the one taken after
calling the closure by hand and then ``step()``."""

from __future__ import annotations

import pytest
import torch
from helpers.optim_runs import small_optimizers, tiny_model

OPTIMIZERS = small_optimizers()


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 5, generator=gen)
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_step_with_a_closure_returns_its_loss_and_takes_the_same_step(name):
    by_closure, by_hand = tiny_model(), tiny_model()
    opt_closure, opt_hand = OPTIMIZERS[name](by_closure.parameters()), OPTIMIZERS[name](by_hand.parameters())
    for step in range(3):  # across 1-bit and 0/1 Adam's warm-up into their compressed steps

        def closure(step=step):
            opt_closure.zero_grad()
            loss = _loss(by_closure, step)
            loss.backward()  # fails under no_grad: the loss would have no grad_fn
            return loss

        opt_hand.zero_grad()
        expected = _loss(by_hand, step)
        expected.backward()
        opt_hand.step()
        returned = opt_closure.step(closure)
        assert torch.equal(returned.detach(), expected.detach())
        for a, b in zip(by_closure.parameters(), by_hand.parameters()):
            assert torch.equal(a, b)
    assert opt_closure.step() is None  # no closure, no loss

