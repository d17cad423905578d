"""DiLoCo when things go wrong or could stall: a replica that stops, a non-finite
pseudo-gradient, the first overlapped exchange, and settings out of range."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers.diloco_runs import flat, inner_optimizer, loss_of, tiny_model

import gradzip
from gradzip.testing import run_ranks


def _build(cfg, inner="adamw"):
    model = tiny_model()
    return model, gradzip.DiLoCo(model, inner_optimizer(model.parameters(), inner), **cfg)


def replica_stops(rank, world_size, delay):
    """Rank 1 leaves before the first outer exchange; rank 0 reports what its step raised."""
    model, opt = _build({"sync_every": 2, "delay": delay})
    if rank == 1:
        return None
    for step in range(1, 6):
        loss_of(model, rank, step).backward()
        try:
            opt.step()
        except RuntimeError as exc:
            return step, str(exc)
        opt.zero_grad()
    return None


@pytest.mark.parametrize("delay", [0, 1])
def test_a_replica_that_stops_makes_the_outer_step_raise_within_the_timeout(delay):
    # the process group's timeout (4 s) bounds the wait; run_ranks would raise TimeoutError
    # if rank 0 hung instead of raising
    step, message = run_ranks(replica_stops, 2, delay, timeout_s=4)[0]
    assert step == 2 + delay  # the step where the exchange launched after step 2 is waited for
    assert "outer exchange of fragment 0" in message and "replica may have stopped" in message


def nonfinite_replica(rank, world_size):
    """Rank 1's inner step turns its parameters to NaN just before an outer exchange."""
    model, opt = _build({"compressor": "topk:ratio=0.5", "error_feedback": True, "sync_every": 2}, inner="sgd")
    record = {}
    for step in range(1, 9):
        if step == 4:
            record["global_before"] = flat(opt.global_params)
            record["residuals_before"] = {k: v.clone() for k, v in opt.reducers[0].feedback.residuals.items()}
        if step == 4 and rank == 1:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        loss_of(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
        if step == 4:
            opt.reducers[0].settle()
            record["global_after"] = flat(opt.global_params)
            record["params_after"] = flat(model.parameters())
            record["residuals_after"] = dict(opt.reducers[0].feedback.residuals)
    record["skipped"] = opt.skipped
    record["final"] = flat(opt.global_params)
    return record


def test_nonfinite_pseudo_gradient_is_skipped_on_every_rank():
    results = run_ranks(nonfinite_replica, 2)
    for r in results:
        assert r["skipped"] == 1
        assert torch.equal(r["global_after"], r["global_before"])  # no outer step
        assert torch.equal(r["params_after"], r["global_before"])  # back to the global parameters
        assert r["residuals_after"].keys() == r["residuals_before"].keys()
        for key, residual in r["residuals_before"].items():
            assert torch.equal(r["residuals_after"][key], residual)  # residuals put back
        assert torch.isfinite(r["final"]).all()
        assert not torch.equal(r["final"], r["global_before"])  # training went on
    assert torch.equal(results[0]["final"], results[1]["final"])


def carried_nonfinite(rank, world_size, nan_step):
    """carry=True, an exchange launched after step 4 lands after step 5; rank 1 takes an inner
    step on a NaN gradient at ``nan_step`` (plain SGD: its parameters turn NaN)."""
    model, opt = _build({"sync_every": 4, "delay": 1, "carry": True}, inner="sgd")
    for step in range(1, 17):
        loss_of(model, rank, step).backward()
        if step == nan_step and rank == 1:
            model[0].weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return opt.skipped, flat(opt.global_params), flat(model.parameters())


@pytest.mark.parametrize("nan_step, skipped", [(2, 1), (5, 0)])
def test_a_nonfinite_carry_is_dropped_not_kept_for_good(nan_step, skipped):
    """Before the launch (step 2) the pseudo-gradient is NaN: skipped on every rank. After it
    (step 5) the exchange is finite but what rank 1 would carry over is not. Either way rank 1
    goes back to the global parameters and trains on; the ranks agree."""
    results = run_ranks(carried_nonfinite, 2, nan_step)
    for r_skipped, global_params, params in results:
        assert r_skipped == skipped
        assert torch.isfinite(global_params).all() and torch.isfinite(params).all()
    assert torch.equal(results[0][1], results[1][1])


def first_exchange_in_flight(rank, world_size):
    """Rank 1 starts its side of the first exchange only after rank 0 has returned from the
    step that launched it and seen it still in flight; were that step to wait for the
    exchange, the two ranks would deadlock until the timeout."""
    side = dist.new_group([0, 1])
    model, opt = _build({"sync_every": 2, "delay": 1})
    in_flight = None
    for step in range(1, 5):
        loss_of(model, rank, step).backward()
        if rank == 1 and step == 2:
            dist.barrier(group=side)
        opt.step()
        opt.zero_grad()
        if rank == 0 and step == 2:
            in_flight = not all(f.done() for e in opt.pending for f in e.futures) and len(opt.pending) == 1
            dist.barrier(group=side)
    return in_flight, opt.exchanges


def test_first_overlapped_exchange_does_not_stall_the_inner_loop():
    (in_flight, exchanges), (_, other) = run_ranks(first_exchange_in_flight, 2, timeout_s=20)
    assert in_flight is True
    assert exchanges == other == 2


def sparseloco_against_reference(rank, world_size, steps, beta, lr):
    cfg = {"compressor": "topk:ratio=0.25", "collective": "allgather", "method": "sparseloco",
           "sync_every": 2, "outer_momentum": beta, "outer_lr": lr}
    model, opt = _build(cfg)
    for step in range(1, steps + 1):
        loss_of(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    return flat(opt.global_params), (_sparseloco_reference(world_size, steps, beta, lr) if rank == 0 else None)


def _sparseloco_reference(replicas, steps, beta, lr):
    """SparseLoCo's outer loop with Top-K written out: e = beta * e + delta, c = TopK(e),
    e = e - c, theta = theta - lr * mean(c) (the mean as the all_gather route forms it: decoded
    payloads summed in rank order, then divided)."""
    codec = gradzip.build("topk:ratio=0.25")
    models = [tiny_model() for _ in range(replicas)]
    opts = [inner_optimizer(m.parameters(), "adamw") for m in models]
    theta = flat(models[0].parameters())
    errors = [None] * replicas
    outer_steps = 0
    for step in range(1, steps + 1):
        for r in range(replicas):
            loss_of(models[r], r, step).backward()
            opts[r].step()
            opts[r].zero_grad()
        if step % 2:
            continue
        sent = []
        for r in range(replicas):
            delta = theta - flat(models[r].parameters())
            e = delta.clone() if errors[r] is None else torch.add(delta, errors[r], alpha=beta)
            c = codec.decompress(codec.compress(e, step=outer_steps, key=("outer", 0, 0)), like=e)
            errors[r] = e - c
            sent.append(c)
        total = sent[0].clone()
        for c in sent[1:]:
            total += c
        theta = theta.add(total.div_(replicas), alpha=-lr)
        outer_steps += 1
        with torch.no_grad():
            for m in models:
                offset = 0
                for p in m.parameters():
                    p.copy_(theta[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
    return theta


def test_sparseloco_equals_its_written_out_update():
    for global_params, ref in run_ranks(sparseloco_against_reference, 2, 6, 0.9, 1.0)[:1]:
        assert torch.equal(global_params, ref)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 0}, r"sync_every must be an integer >= 1"),
        ({"sync_every": 4, "fragments": 0}, r"fragments must be an integer in \[1, 4\]"),
        ({"sync_every": 10, "fragments": 7}, r"fragments must be an integer in \[1, 6\]"),
        ({"sync_every": 2, "fragments": 3}, r"fragments must be an integer in \[1, 2\]"),
        ({"sync_every": 4, "delay": -1}, r"delay must be an integer in \[0, 3\]"),
        ({"sync_every": 4, "delay": 4}, r"delay must be an integer in \[0, 3\]"),
        ({"sync_every": 9, "fragments": 4, "delay": 9}, r"delay must be an integer in \[0, 8\] \(fewer than sync_every = 9"),
        ({"sync_every": 4, "outer_lr": 0}, r"outer_lr must be a number in \(0, inf\)"),
        ({"sync_every": 4, "outer_lr": float("nan")}, r"outer_lr must be a number"),
        ({"sync_every": 4, "outer_momentum": 1.0}, r"outer_momentum must be a number in \[0, 1\)"),
        ({"sync_every": 4, "mix": 1.5}, r"mix must be a number in \[0, 1\]"),
        ({"sync_every": 4, "carry": True}, r"carry=True .* needs delay >= 1, mix=0 and eager=False; got delay=0"),
        ({"sync_every": 4, "delay": 1, "mix": 0.5, "carry": True}, r"needs delay >= 1, mix=0 .*got delay=1, mix=0.5"),
        ({"sync_every": 4, "delay": 1, "carry": "yes"}, r"carry must be True or False"),
        ({"sync_every": 4, "bucket_cap_mb": -1}, r"bucket_cap_mb must be a number"),
        ({"sync_every": 4, "method": "adam"}, r"method must be one of diloco, sparseloco"),
        ({"sync_every": 4, "compressor": "auto"}, r"'auto' cannot run on the outer exchange"),
        ({"sync_every": 4, "compressor": "powersgd", "method": "sparseloco"}, r"single-round codec"),
        ({"sync_every": 4, "compressor": "topk", "method": "sparseloco", "error_feedback": False}, r"error_feedback must be on"),
        ({"sync_every": 4, "compressor": "nope"}, r"unknown compressor"),
        ({"sync_every": 4, "compressor": "topk", "method": "sparseloco", "outer_momentum": 0.0},
         r"^outer_momentum must be in \(0, 1\) with method='sparseloco'"),
        ({"sync_every": 4, "outer_lr": 1e300}, r"^outer_lr must be a number in \(0, 3.40282e\+38\] for torch.float32"),
    ],
)
def test_settings_out_of_range_raise_naming_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _build(kwargs)


def stalled_outer_peer(rank, world_size):
    """Rank 1 stops answering for 10 s; rank 0 all_reduces on its outer group (2 s timeout)."""
    _replica, outer = gradzip.replica_groups(world_size, 1, timeout=timedelta(seconds=2))
    if rank == 1:
        time.sleep(10)
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=outer)
    except RuntimeError:
        return "raised", time.monotonic() - start
    return "completed", time.monotonic() - start


def test_the_outer_groups_take_the_timeout_given_not_pytorchs_30_minutes():
    outcome, waited = run_ranks(stalled_outer_peer, 2, timeout_s=60)[0]
    # before rank 1 came back (10 s): the group's own 2 s, not the 60 s of the default group
    # nor PyTorch's 30 minutes for a new group
    assert outcome == "raised" and waited < 8, (outcome, waited)


def test_replica_groups_refuse_a_size_that_does_not_divide():
    with pytest.raises(ValueError, match="replica_size must divide world_size=4"):
        gradzip.replica_groups(4, 3)
    with pytest.raises(ValueError, match=r"replica_size must be an integer in \[1, 4\]"):
        gradzip.replica_groups(4, 0)
