"""Shared pieces of the DiLoCo tests: a tiny model, fixed data per (rank, step), a training
loop, and a single-process reference of the outer loop that never touches gradzip.outer."""

from __future__ import annotations

import torch

import gradzip


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """Three linear layers: six parameter tensors."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
        )


def batch(data_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch of ``data_rank`` at inner step ``step`` (counted from 1)."""
    gen = torch.Generator().manual_seed(1000 * data_rank + step)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)


def loss_of(model, data_rank: int, step: int) -> torch.Tensor:
    x, y = batch(data_rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def inner_optimizer(params, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    assert kind == "sgd_momentum", kind
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def train_diloco(data_rank: int, steps: int, cfg: dict, *, group=None, model=None, inner: str = "adamw"):
    """``steps`` DiLoCo steps on ``data_rank``'s batches; returns (model, diloco)."""
    model = model if model is not None else tiny_model()
    opt = gradzip.DiLoCo(model, inner_optimizer(model.parameters(), inner), group=group, **cfg)
    for step in range(1, steps + 1):
        loss_of(model, data_rank, step).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def send_offsets(sync_every: int, fragments: int) -> list[int]:
    return [sync_every * (p + 1) // fragments for p in range(fragments)]


def reference(replicas: int, steps: int, cfg: dict, *, inner: str = "adamw", ranks_per_replica: int = 1):
    """The outer loop in one process for ``replicas`` replicas with the identity codec: the
    pseudo-gradients averaged as the dense route does (each divided by the replica count, then
    summed in rank order) and stepped with ``torch.optim.SGD`` (Nesterov). A replica of several
    ranks averages their gradients as DDP does (for 2 ranks, (a + b) / 2 bit for bit).
    Updates still in flight after the last step are applied then, as ``synchronize()`` does.
    With ``carry`` each replica's fragment is copied at the send and, when the update lands,
    set to the new global parameters plus what the replica did since that copy.
    Returns each replica's final parameters (flat) and the global parameters (flat)."""
    H, F, D = cfg["sync_every"], cfg.get("fragments", 1), cfg.get("delay", 0)
    mix, carry = cfg.get("mix", 0.0), cfg.get("carry", False)
    lr, momentum = cfg.get("outer_lr", 0.7), cfg.get("outer_momentum", 0.9)
    models = [tiny_model() for _ in range(replicas)]
    opts = [inner_optimizer(m.parameters(), inner) for m in models]
    params = [[p for p in m.parameters()] for m in models]
    global_params = [p.detach().clone() for p in params[0]]
    outer = torch.optim.SGD(global_params, lr=lr, momentum=momentum, nesterov=momentum > 0)
    frags = [list(range(p, len(global_params), F)) for p in range(F)]
    offsets = send_offsets(H, F)
    pending = []
    for step in range(1, steps + 1):
        for r, (model, opt) in enumerate(zip(models, opts)):
            if ranks_per_replica == 1:
                loss_of(model, r, step).backward()
            else:
                grads = []
                for k in range(ranks_per_replica):
                    model.zero_grad()
                    loss_of(model, r * ranks_per_replica + k, step).backward()
                    grads.append([p.grad.clone() for p in model.parameters()])
                for i, p in enumerate(model.parameters()):
                    p.grad = _ddp_mean([g[i] for g in grads])
            opt.step()
            opt.zero_grad()
        due = [e for e in pending if e[0] == step]
        pending = [e for e in pending if e[0] != step]
        sends = []
        for p in range(F):
            if (step - offsets[p]) % H == 0:
                with torch.no_grad():
                    means = {}
                    for i in frags[p]:
                        deltas = [(global_params[i] - params[r][i]).div(replicas) for r in range(replicas)]
                        total = deltas[0].clone()
                        for d in deltas[1:]:
                            total += d
                        means[i] = total
                    snaps = [[params[r][i].detach().clone() for i in frags[p]] for r in range(replicas)] if carry else None
                sends.append((step + D, p, means, snaps))
        for entry in due + [e for e in sends if D == 0]:
            _apply(entry, frags, global_params, outer, params, mix)
        pending += [e for e in sends if D > 0]
    for entry in pending:  # what DiLoCo.synchronize() does at the end
        _apply(entry, frags, global_params, outer, params, mix)
    return [flat(ps) for ps in params], flat(global_params)


def _ddp_mean(grads):
    total = grads[0].div(len(grads))
    for g in grads[1:]:
        total = total + g.div(len(grads))
    return total


def _apply(entry, frags, global_params, outer, params, mix):
    _, p, means, snaps = entry
    for i, g in enumerate(global_params):
        g.grad = means.get(i)
    outer.step()
    with torch.no_grad():
        for r, replica in enumerate(params):
            for k, i in enumerate(frags[p]):
                if snaps is not None:
                    replica[i].copy_(global_params[i] + (replica[i] - snaps[r][k]))
                elif mix == 0:
                    replica[i].copy_(global_params[i])
                else:
                    replica[i].lerp_(global_params[i], 1 - mix)
