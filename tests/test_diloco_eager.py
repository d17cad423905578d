"""DiLoCo with eager updates (Kale, Douillard & Donchev, arXiv 2502.12996) on real gloo ranks:
against a single-process reference written out from the update rule, the exchange in flight
across a whole cycle, a non-finite pseudo-gradient, resume, and the settings eager refuses."""

import io

import pytest
import torch
import torch.distributed as dist
from helpers.diloco_runs import flat, inner_optimizer, loss_of, tiny_model, train_diloco

import gradzip
from gradzip.testing import run_ranks

H = 3
STEPS = 10  # three outer steps and one inner step of the fourth cycle
CFG = {"compressor": "none", "sync_every": H, "eager": True, "outer_lr": 0.8, "outer_momentum": 0.5}


def eager_reference(replicas: int, steps: int, lr: float, momentum: float):
    """Each replica keeps its own global parameters and outer SGD (torch.optim.SGD, Nesterov):
    at every outer step ``g = own / M + (mean_prev - own_prev / M)``, the mean formed as the
    dense route forms it (each pseudo-gradient divided by M, summed in rank order); after the
    last step the exchange in flight lands as one more step on ``mean_last - own_last / M``.
    Returns every replica's global parameters (flat)."""
    models = [tiny_model() for _ in range(replicas)]
    inner = [inner_optimizer(m.parameters(), "adamw") for m in models]
    theta = [[p.detach().clone() for p in models[0].parameters()] for _ in range(replicas)]
    outer = [torch.optim.SGD(t, lr=lr, momentum=momentum, nesterov=momentum > 0) for t in theta]
    own_prev = mean_prev = None

    def outer_step(r, grads):
        for t, g in zip(theta[r], grads):
            t.grad = g
        outer[r].step()

    def reset(r):
        with torch.no_grad():
            for p, t in zip(models[r].parameters(), theta[r]):
                p.copy_(t)

    for step in range(1, steps + 1):
        for r in range(replicas):
            loss_of(models[r], r, step).backward()
            inner[r].step()
            inner[r].zero_grad()
        if step % H:
            continue
        own = [[t - p.detach() for t, p in zip(theta[r], models[r].parameters())] for r in range(replicas)]
        mean = [sum((own[r][i] / replicas for r in range(1, replicas)), own[0][i] / replicas) for i in range(len(own[0]))]
        for r in range(replicas):
            grads = []
            for i, d in enumerate(own[r]):
                g = d / replicas
                if mean_prev is not None:
                    g += mean_prev[i] - own_prev[r][i] / replicas
                grads.append(g)
            outer_step(r, grads)
            reset(r)
        own_prev, mean_prev = own, mean
    for r in range(replicas):  # synchronize(): the last exchange lands
        outer_step(r, [mean_prev[i] - own_prev[r][i] / replicas for i in range(len(mean_prev))])
        reset(r)
    return [flat(t) for t in theta]


def eager_run(rank, world_size):
    model, opt = train_diloco(rank, STEPS, CFG)
    in_flight = len(opt.pending)
    opt.synchronize()
    ref = eager_reference(world_size, STEPS, CFG["outer_lr"], CFG["outer_momentum"]) if rank == 0 else None
    return flat(opt.global_params), flat(model.parameters()), in_flight, opt.exchanges, ref


@pytest.mark.parametrize("world_size", [2, 3])
def test_eager_equals_the_written_out_update(world_size):
    results = run_ranks(eager_run, world_size)
    ref = results[0][4]
    for rank, (global_params, params, in_flight, exchanges, _) in enumerate(results):
        assert in_flight == 1 and exchanges == STEPS // H  # the last exchange was still pending
        assert torch.equal(params, global_params)  # synchronize() reset the replica to its global parameters
        if world_size == 2:
            assert torch.equal(global_params, ref[rank])
        else:  # gloo's ring sums three terms in its own order
            torch.testing.assert_close(global_params, ref[rank], rtol=1e-5, atol=1e-6)
    # the replicas differ by how momentum weighted their own terms a round apart, not by more
    assert not torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0.05)


def eager_does_not_wait(rank, world_size):
    """Rank 1 joins the first exchange only after rank 0 has taken the next two inner steps
    and seen the exchange still in flight; an eager step that waited would deadlock."""
    side = dist.new_group([0, 1])
    model, opt = train_diloco(rank, 0, CFG)
    in_flight = None
    for step in range(1, 2 * H + 1):
        if rank == 1 and step == H:
            dist.barrier(group=side)
        loss_of(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and step == H + 2:
            in_flight = len(opt.pending) == 1 and not all(f.done() for f in opt.pending[0].futures)
            dist.barrier(group=side)
    return in_flight, opt.exchanges


def test_the_eager_exchange_overlaps_the_next_cycle():
    (in_flight, exchanges), (_, other) = run_ranks(eager_does_not_wait, 2, timeout_s=20)
    assert in_flight is True
    assert exchanges == other == 2


def eager_nonfinite(rank, world_size, cfg, nan_step):
    """Rank 1's parameters turn NaN just before the outer step after ``nan_step`` (None: never;
    inner SGD: no state for the NaN to stay in)."""
    model, opt = train_diloco(rank, 0, cfg, inner="sgd")
    for step in range(1, STEPS + 1):
        if step == nan_step and rank == 1:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        loss_of(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return opt.skipped, flat(opt.global_params)


def test_a_nonfinite_pseudo_gradient_is_skipped_and_never_reaches_the_parameters():
    for skipped, global_params in run_ranks(eager_nonfinite, 2, CFG, 2 * H):
        assert skipped == 1  # the mean of that exchange, landing a cycle later, on every rank
        assert torch.isfinite(global_params).all()


@pytest.mark.parametrize("nan_step", [None, 2 * H])
def test_a_skipped_eager_round_takes_back_the_own_share_so_replicas_agree(nan_step):
    """Without outer momentum the own share a replica applies a round early cancels when the mean
    lands, so the replicas agree after synchronize(), also when a round was skipped."""
    results = run_ranks(eager_nonfinite, 3, dict(CFG, outer_momentum=0.0), nan_step)
    for skipped, global_params in results:
        assert skipped == (0 if nan_step is None else 1)
        assert torch.isfinite(global_params).all()
        # the same up to the rounding of own / M added and taken back a round apart
        assert torch.allclose(global_params, results[0][1], rtol=0, atol=1e-6)


def eager_resume(rank, world_size, cfg):
    def build():
        model = tiny_model()
        return model, gradzip.DiLoCo(model, inner_optimizer(model.parameters(), "adamw"), **cfg)

    def steps(model, opt, start, stop):
        for step in range(start, stop + 1):
            loss_of(model, rank, step).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    steps(model, opt, 1, STEPS)
    opt.synchronize()
    whole = flat(opt.global_params)
    resumed = {}
    for save_at in range(1, STEPS):
        model, opt = build()
        steps(model, opt, 1, save_at)
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "diloco": opt.state_dict()}, buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=False)
        model, opt = build()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["diloco"])
        steps(model, opt, save_at + 1, STEPS)
        opt.synchronize()
        resumed[save_at] = flat(opt.global_params)
    return whole, resumed


def test_eager_resumes_bit_exact_at_every_step_of_the_cycle():
    cfg = {**CFG, "compressor": "topk:ratio=0.3", "error_feedback": True}
    for whole, resumed in run_ranks(eager_resume, 2, cfg):
        for save_at, global_params in resumed.items():
            assert torch.equal(global_params, whole), save_at


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eager": "yes"}, r"eager must be True or False"),
        ({"eager": True, "sync_every": 4, "fragments": 2}, r"fragments must be 1 with eager=True"),
        ({"eager": True, "sync_every": 4, "delay": 1}, r"delay must be 0 with eager=True"),
        ({"eager": True, "mix": 0.5}, r"mix must be 0.0 with eager=True"),
        ({"eager": True, "compressor": "topk", "method": "sparseloco"}, r"method must be 'diloco' with eager=True"),
    ],
)
def test_eager_refuses_the_settings_it_replaces(kwargs, match):
    model = tiny_model()
    with pytest.raises(ValueError, match=match):
        gradzip.DiLoCo(model, inner_optimizer(model.parameters(), "adamw"), **{"sync_every": 2, **kwargs})


def test_loading_a_non_eager_checkpoint_into_eager_raises():
    model = tiny_model()
    plain = gradzip.DiLoCo(model, inner_optimizer(model.parameters(), "adamw"), sync_every=2)
    eager = gradzip.DiLoCo(model, inner_optimizer(model.parameters(), "adamw"), sync_every=2, eager=True)
    with pytest.raises(ValueError, match=r"settings .*'eager': True"):
        eager.load_state_dict(plain.state_dict())
