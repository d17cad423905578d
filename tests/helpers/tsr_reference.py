"""TSR-Adam written out for one process standing in for every rank: per-rank gradients, averaged
sketches, randomized SVD with one power iteration, averaged cores, AdamW's arithmetic in core
space; the biases by ``torch.optim.AdamW`` on their averaged gradient. How a mean is taken (the
wire) is the caller's, so the tests of the fp32, bfloat16 and int8 wires share one algorithm."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gradzip.compressors.base import seeded_generator

Mean = Callable[[list[torch.Tensor]], torch.Tensor]


def rank_order_mean(parts: list[torch.Tensor]) -> torch.Tensor:
    """The mean as gloo ranks compute it at 2 ranks: each divides by the world size, the sum in
    rank order."""
    out = parts[0] / len(parts)
    for part in parts[1:]:
        out = out + part / len(parts)
    return out


@torch.no_grad()
def reference_run(
    make_model: Callable[[], torch.nn.Module],
    backward: Callable[[torch.nn.Module, int, int], None],
    hyper: dict,
    *,
    world_size: int,
    steps: int,
    mean: Mean = rank_order_mean,
    bias_mean: Callable[[list[list[torch.Tensor]]], list[torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """The parameters after ``steps`` steps of TSR-Adam on a ``Linear, act, Linear`` model.

    Args:
        make_model: builds one rank's model (the same initial weights on every call).
        backward: ``backward(model, rank, step)`` computes that rank's gradients.
        hyper: TSRAdam's ``lr``, ``weight_decay``, ``approx_rank``, ``update_gap``, ``scale``,
            ``oversampling`` and ``seed`` (one power iteration).
        mean: the mean over ranks of the sketches and cores.
        bias_mean: the means of the two biases from every rank's ``[bias0, bias1]`` gradients
            (default: ``mean`` of each).
    """
    models = [make_model() for _ in range(world_size)]
    weights = [0, 2]  # the Linear layers' weights: parameter indices 0 and 2
    params = list(models[0].parameters())
    biases = [params[1], params[3]]
    adamw = torch.optim.AdamW(biases, lr=hyper["lr"], weight_decay=hyper["weight_decay"])
    beta1, beta2 = 0.9, 0.999
    rank = hyper["approx_rank"]
    state = {i: {"m": torch.zeros(rank, rank), "v": torch.zeros(rank, rank)} for i in weights}
    if bias_mean is None:
        def bias_mean(per_rank):
            return [mean([g[j] for g in per_rank]) for j in range(2)]
    for step in range(steps):
        grads = []
        for r, model in enumerate(models):
            model.zero_grad()
            with torch.enable_grad():
                backward(model, r, step)
            grads.append([p.grad.clone() for p in model.parameters()])
        if step % hyper["update_gap"] == 0:
            for i in weights:
                g = [grads[r][i] for r in range(world_size)]
                m, n = g[0].shape
                columns = min(rank + hyper["oversampling"], m, n)
                omega = torch.randn(n, columns, generator=seeded_generator(hyper["seed"], step, ("tsr-omega", i)))
                q = torch.linalg.qr(mean([gi @ omega for gi in g])).Q
                qz = torch.linalg.qr(mean([gi.T @ q for gi in g])).Q
                q = torch.linalg.qr(mean([gi @ qz for gi in g])).Q
                u_small, _s, vh = torch.linalg.svd(mean([q.T @ gi for gi in g]), full_matrices=False)
                state[i]["U"], state[i]["V"] = q @ u_small[:, :rank], vh[:rank].T
        for i in weights:
            s, p = state[i], params[i]
            core = mean([s["U"].T @ grads[r][i] @ s["V"] for r in range(world_size)])
            s["m"].lerp_(core, 1 - beta1)
            s["v"].mul_(beta2).addcmul_(core, core, value=1 - beta2)
            denom = (s["v"].sqrt() / math.sqrt(1 - beta2 ** (step + 1))).add_(1e-8)
            p.mul_(1 - hyper["lr"] * hyper["weight_decay"])
            p.add_(s["U"] @ (s["m"] / denom) @ s["V"].T, alpha=-(hyper["scale"] * hyper["lr"] / (1 - beta1 ** (step + 1))))
        for b, g in zip(biases, bias_mean([[grads[r][1], grads[r][3]] for r in range(world_size)])):
            b.grad = g
        adamw.step()
        for model in models[1:]:
            model.load_state_dict(models[0].state_dict())
    return [p.detach().clone() for p in models[0].parameters()]
