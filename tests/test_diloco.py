"""DiLoCo and Streaming DiLoCo on real gloo ranks against a single-process reference of the
outer loop (tests/diloco_runs.py), the sync_every=1 identity with data-parallel SGD, the
schedule by counting, and settings out of range."""

import pytest
import torch
from helpers.diloco_runs import flat, inner_optimizer, loss_of, reference, send_offsets, tiny_model, train_diloco
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.testing import run_ranks

STEPS = 9  # ends mid-cycle for "streaming", with an exchange in flight
CONFIGS = {
    "diloco": {"sync_every": 3},
    "streaming": {"sync_every": 4, "fragments": 2, "delay": 1, "mix": 0.5},
    "streaming_carry": {"sync_every": 6, "fragments": 2, "delay": 2, "carry": True, "outer_momentum": 0.5},
    "streaming_replace": {"sync_every": 6, "fragments": 3, "delay": 1, "outer_momentum": 0.5, "outer_lr": 0.9},
    # delay 4 over 2 steps between fragments: two or three fragments in flight at once
    "streaming_overlap": {"sync_every": 6, "fragments": 3, "delay": 4, "carry": True, "outer_momentum": 0.5},
}


def diloco_against_reference(rank, world_size):
    out = {}
    for name, cfg in CONFIGS.items():
        model, opt = train_diloco(rank, STEPS, {"compressor": "none", **cfg})
        opt.synchronize()  # nothing may be in flight: the reference applies only what is due
        out[name] = {"params": flat(model.parameters()), "global": flat(opt.global_params)}
        if rank == 0:
            out[name]["reference"] = reference(world_size, STEPS, cfg)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_identity_codec_equals_single_process_reference(world_size):
    results = run_ranks(diloco_against_reference, world_size)
    for name in CONFIGS:
        for r in results[1:]:  # every rank holds the same global parameters, bit for bit
            assert torch.equal(r[name]["global"], results[0][name]["global"]), name
        ref_params, ref_global = results[0][name]["reference"]
        for rank, r in enumerate(results):
            if world_size == 2:
                # a / 2 + b / 2 is one rounding whatever the order: bit for bit
                assert torch.equal(r[name]["global"], ref_global), name
                assert torch.equal(r[name]["params"], ref_params[rank]), name
            else:
                # gloo's ring sums 3 or 4 terms in its own order, the reference in rank order:
                # each outer step's mean may differ in the last bits of fp32
                torch.testing.assert_close(r[name]["global"], ref_global, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(r[name]["params"], ref_params[rank], rtol=1e-5, atol=1e-6)


def diloco_h1_against_ddp(rank, world_size, steps):
    """DiLoCo with sync_every=1, outer lr 1, no outer momentum and the identity codec, beside
    DDP, each with inner SGD with momentum and weight decay, on the same batches."""
    cfg = {"compressor": "none", "sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}
    model, _ = train_diloco(rank, steps, cfg, inner="sgd_momentum")
    ddp = DDP(tiny_model())
    opt = inner_optimizer(ddp.parameters(), "sgd_momentum")
    for step in range(1, steps + 1):
        loss_of(ddp, rank, step).backward()
        opt.step()
        opt.zero_grad()
    return flat(model.parameters()), flat(ddp.module.parameters())


@pytest.mark.parametrize("world_size", [2, 3])
def test_sync_every_1_equals_data_parallel_sgd(world_size):
    """Inner SGD (with momentum and weight decay) is linear in the gradients and the parameters,
    and with H = 1 every replica starts each step from the same parameters, so the mean of the
    replicas' parameters after one step, theta - lr * mean(update_r), is DDP's step with the
    averaged gradient (the momentum buffers differ per replica but average to DDP's buffer).
    Outer SGD with lr 1 and no momentum sets theta to exactly that mean. The two differ only by
    rounding: DiLoCo forms theta - (theta - theta_r) where DDP forms lr * g; each step adds
    about one ulp of |theta| per element, so after 6 steps 8 * 6 * eps * max|theta| bounds it."""
    steps = 6
    for diloco, ddp in run_ranks(diloco_h1_against_ddp, world_size, steps):
        bound = 8 * steps * torch.finfo(torch.float32).eps * float(ddp.abs().max())
        assert not torch.equal(diloco, tiny_model_flat()), "training moved the parameters"
        assert float((diloco - ddp).abs().max()) <= bound


def tiny_model_flat():
    return flat(tiny_model().parameters())


def hierarchical(rank, world_size, cfg, steps):
    """2 replicas of 2 ranks: DDP inside each replica, DiLoCo between them; each rank
    exchanging everything, then the replica's ranks sharing the exchange out."""
    replica_group, outer_group = gradzip.replica_groups(world_size, 2)
    out = {}
    for shared in (False, True):
        ddp = DDP(tiny_model(), process_group=replica_group)
        extra = {"replica_group": replica_group} if shared else {}
        model, opt = train_diloco(rank, steps, {"compressor": "none", **cfg, **extra}, group=outer_group, model=ddp)
        opt.synchronize()
        out[shared] = {
            "params": flat(model.module.parameters()), "global": flat(opt.global_params),
            "payload_bytes": opt.metrics.pop()["payload_bytes"],
        }
    if rank == 0:
        out["reference"] = reference(2, steps, cfg, ranks_per_replica=2)
    return out


def test_two_replicas_of_two_ranks_equal_the_reference():
    cfg = CONFIGS["streaming"]
    results = run_ranks(hierarchical, 4, cfg, STEPS)
    ref_params, ref_global = results[0]["reference"]
    for shared in (False, True):
        for rank, r in enumerate(results):
            # DDP inside a replica averages 2 gradients and the outer exchange 2
            # pseudo-gradients: each is one rounding whatever the order, so bit for bit
            assert torch.equal(r[shared]["global"], ref_global), shared
            assert torch.equal(r[shared]["params"], ref_params[rank // 2]), shared
    # sharing the exchange out within a replica halves the bytes sent between replicas, and
    # both ranks of a replica take part
    total = {shared: sum(r[shared]["payload_bytes"] for r in results) for shared in (False, True)}
    assert total[True] * 2 == total[False]
    assert all(r[True]["payload_bytes"] > 0 for r in results)


def count_exchanges(rank, world_size, cfg, cycles):
    """Record which tensors each inner step sends and which global tensors each step changes."""
    model = tiny_model()
    opt = gradzip.DiLoCo(model, inner_optimizer(model.parameters(), "adamw"), "none", bucket_cap_mb=0, **cfg)
    key_to_tensor = {b.key: b.indices[0] for buckets in opt.buckets for b in buckets}
    sent: dict[int, list[int]] = {}

    def counting(reduce):
        def counting_reduce(key, grad, **kwargs):
            sent.setdefault(opt.inner_steps, []).append(key_to_tensor[key])
            return reduce(key, grad, **kwargs)
        return counting_reduce

    for reducer in opt.reducers:
        reducer.reduce = counting(reducer.reduce)
    changed: dict[int, list[int]] = {}
    for step in range(1, cycles * cfg["sync_every"] + 1):
        before = [g.clone() for g in opt.global_params]
        loss_of(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
        changed[step] = [i for i, (a, b) in enumerate(zip(before, opt.global_params)) if not torch.equal(a, b)]
    return sent, changed, opt.fragments


@pytest.mark.parametrize("cfg", [
    {"sync_every": 6, "fragments": 3, "delay": 1},
    {"sync_every": 9, "fragments": 2, "delay": 3},
    {"sync_every": 6, "fragments": 3, "delay": 5},  # three fragments in flight at once
])
def test_fragments_and_delay_exchange_every_tensor_once_per_cycle(cfg):
    H, F, D = cfg["sync_every"], cfg["fragments"], cfg["delay"]
    cycles = 3
    sent, changed, fragments = run_ranks(count_exchanges, 2, cfg, cycles)[0]
    assert sorted(i for f in fragments for i in f) == list(range(6))
    offsets = send_offsets(H, F)
    for c in range(cycles):
        window = range(c * H + 1, (c + 1) * H + 1)
        tensors = [i for s in window for i in sent.get(s, [])]
        assert sorted(tensors) == list(range(6)), (c, sent)  # every tensor exactly once per H steps
        for p, offset in enumerate(offsets):
            assert sorted(sent[c * H + offset]) == fragments[p]
    assert set(sent) == {c * H + o for c in range(cycles) for o in offsets}
    # the outer update of a fragment lands D steps after its exchange starts (those that are
    # due within the run), and nothing else moves the global parameters
    expected = {c * H + o + D: fragments[p] for c in range(cycles) for p, o in enumerate(offsets) if c * H + o + D <= cycles * H}
    assert {s: sorted(v) for s, v in changed.items() if v} == expected


def every_codec(rank, world_size):
    out = {}
    for spec in gradzip.list_compressors():
        model, opt = train_diloco(rank, 8, {"compressor": spec, "sync_every": 4, "fragments": 2, "delay": 1})
        opt.synchronize()
        out[spec] = (flat(opt.global_params), opt.skipped, opt.metrics.pop()["payload_bytes"])
    return out


def test_every_codec_runs_on_the_outer_exchange():
    start = flat(tiny_model().parameters())
    results = run_ranks(every_codec, 2)
    assert set(results[0]) == set(gradzip.list_compressors())
    for spec, (global_params, skipped, payload) in results[0].items():
        assert torch.isfinite(global_params).all(), spec
        assert skipped == 0 and payload > 0, spec
        assert not torch.equal(global_params, start), spec
        assert torch.equal(global_params, results[1][spec][0]), spec  # replicas agree bit for bit
