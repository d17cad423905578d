"""The step timeline, on a toy model where every second can be computed by hand."""

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.lab.simulate.collectives import Link, single_level
from gradzip.lab.simulate.exchange import Method
from gradzip.lab.simulate.presets import ModelShapes
from gradzip.lab.simulate.step import (
    MIB,
    CodecSpeed,
    Workload,
    ddp_buckets,
    fsdp_units,
    limit_step,
    overlapped_step,
    simulate_step,
)

# 40 + 16 + 16 + 40 = 112 fp32 elements; the embedding is a lookup (no compute share)
TOY = ModelShapes(
    name="toy",
    description="hand-computable",
    params=(
        ("model.embed.weight", (10, 4)),
        ("model.layers.0.w", (4, 4)),
        ("model.layers.1.w", (4, 4)),
        ("model.head.weight", (4, 10)),
    ),
    lookup_params=frozenset({"model.embed.weight"}),
    n_layer=2,
    d_model=4,
    seq_len=8,
)
# a = 10 ms per step, 1000 bytes per second: every term is visible
FABRIC = single_level(Link(0.01, 1000.0))
SPEED = CodecSpeed(1000.0, 1000.0)


def toy_workload(**kw):
    base = dict(
        model=TOY, tokens_per_gpu=8, peak_flops=1.0, compute_s=0.9, optimizer_s=0.1,
        first_bucket_mb=100 / MIB, bucket_cap_mb=100 / MIB,
    )
    base.update(kw)
    return Workload(**base)


def test_ddp_buckets_match_pytorch_assignment():
    # DDP rebuilds its buckets in gradient-ready order with a first cap, then the bucket cap.
    caps = [100, 100]
    tensors = [torch.empty(math.prod(s)) for _, s in reversed(TOY.params)]
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, caps, [False] * len(tensors))
    ours = ddp_buckets(TOY, torch.float32, bucket_cap_mb=caps[1] / MIB, first_bucket_mb=caps[0] / MIB)
    order = [name for name, _ in reversed(TOY.params)]
    assert [[order.index(n) for n, _ in b] for b in ours] == [list(b) for b in expected]
    assert [[n for n, _ in b] for b in ours] == [
        ["model.head.weight"], ["model.layers.1.w", "model.layers.0.w"], ["model.embed.weight"],
    ]


def test_ddp_dense_step_hand_computed():
    result = simulate_step(Method("none"), toy_workload(), FABRIC, 2, SPEED, algorithm="ring")
    # forward 0.3; backward 0.6 split 40:32:0 over the buckets; ring all_reduce of 160, 128, 160
    # bytes over 2 workers: 2*0.01 + n/1000
    t0 = 0.3 + 0.6 * 40 / 72
    end0 = t0 + 0.02 + 0.160
    t1 = t0 + 0.6 * 32 / 72
    end1 = max(t1, end0) + 0.02 + 0.128
    end2 = max(t1, end1) + 0.02 + 0.160
    assert result.step_s == pytest.approx(end2 + 0.1, rel=1e-12)
    assert result.exposed_comm_s == pytest.approx(end2 + 0.1 - 0.9 - 0.1, rel=1e-12)
    assert result.comm_s == pytest.approx(0.18 + 0.148 + 0.18, rel=1e-12)
    assert result.sent_bytes == 448  # 2 (p-1)/p * 448 bytes
    assert result.codec_s == 0.0


def test_ddp_fp16_step_hand_computed():
    result = simulate_step(Method("fp16"), toy_workload(), FABRIC, 2, SPEED, algorithm="ring")
    # payloads 80, 64, 80 bytes: comm 0.02 + n/1000; encode and decode dense bytes at 1000 B/s
    comm = [0.1, 0.084, 0.1]
    enc = dec = [0.16, 0.128, 0.16]
    shares = [0.6 * 40 / 72, 0.6 * 32 / 72, 0.0]
    t, net, ends = 0.3, 0.0, []
    for share, e, c in zip(shares, enc, comm):
        t += share + e
        net = max(t, net) + c
        ends.append(net)
    done = t
    for end, d in zip(ends, dec):
        done = max(done, end) + d
    assert result.step_s == pytest.approx(done + 0.1, rel=1e-12)
    assert result.codec_s == pytest.approx(2 * 0.448, rel=1e-12)
    assert result.payload_bytes == 224


def test_onebit_adam_step_hand_computed():
    fused = Method("onebit-adam:warmup=0.25,fused=true")
    result = simulate_step(fused, toy_workload(), FABRIC, 2, SPEED, algorithm="ring")
    dense = simulate_step(Method("none"), toy_workload(), FABRIC, 2, SPEED, algorithm="ring")
    # 112 elements, p = 2: two chunks of 56, each a 1-bit payload c (efsignsgd's, or 7 + 4 bytes)
    c = fused.sign_payload_nbytes(56)
    comm = 2 * (0.01 + 0.5 * 2 * c / 1000)  # all_to_all then all_gather of 2 c bytes
    enc, dec = (112 + 56) * 4 / 1000, (2 * 56 + 112) * 4 / 1000
    compressed = 0.9 + enc + comm + dec + 0.1
    assert result.detail["compressed_step_s"] == pytest.approx(compressed, rel=1e-12)
    assert result.step_s == pytest.approx(0.25 * dense.step_s + 0.75 * compressed, rel=1e-12)
    # gradzip's OneBitAdam exchanges each parameter on its own: 4 tensors, 4 times the latency
    per_tensor = simulate_step(Method("onebit-adam:warmup=0.25"), toy_workload(), FABRIC, 2, SPEED, algorithm="ring")
    comm_each = 0.0
    for numel in (40, 16, 16, 40):
        half = numel // 2
        comm_each += 2 * (0.01 + 0.5 * 2 * fused.sign_payload_nbytes(half) / 1000)
    assert per_tensor.detail["compressed_comm_s"] == pytest.approx(comm_each, rel=1e-12)
    assert per_tensor.collectives.endswith("x4")


def test_fsdp_units_and_bytes():
    root, blocks = fsdp_units(TOY)
    assert [n for n, _ in root] == ["model.embed.weight", "model.head.weight"]
    assert [[n for n, _ in b] for b in blocks] == [["model.layers.0.w"], ["model.layers.1.w"]]
    result = simulate_step(Method("none"), toy_workload(), FABRIC, 2, SPEED, strategy="fsdp")
    # bf16 gathers: root 160 bytes once, blocks 32 + 32 twice; fp32 reduce_scatter of 320, 64, 64
    assert result.sent_bytes == pytest.approx(0.5 * (160 + 2 * 64) + 0.5 * 448, rel=1e-12)
    gathers = (0.01 + 0.5 * 160 / 1000) + 2 * 2 * (0.01 + 0.5 * 32 / 1000)
    scatters = (0.01 + 0.5 * 320 / 1000) + 2 * (0.01 + 0.5 * 64 / 1000)
    assert result.comm_s == pytest.approx(gathers + scatters, rel=1e-12)
    assert result.optimizer_s == pytest.approx(0.05)  # sharded over 2
    assert result.step_s >= result.comm_s  # one network, every collective in the step


def test_fsdp_on_a_free_network_is_compute_bound():
    free = single_level(Link(0.0, 1e30))
    result = simulate_step(Method("none"), toy_workload(), free, 4, SPEED, strategy="fsdp")
    assert result.step_s == pytest.approx(0.9 + 0.1 / 4, rel=1e-9)


def test_limit_and_one_worker():
    limit = limit_step(toy_workload(), 8)
    assert limit.step_s == pytest.approx(1.0) and limit.sent_bytes == 0
    single = simulate_step(Method("none"), toy_workload(), FABRIC, 1, SPEED)
    assert single.step_s == pytest.approx(1.0) and single.sent_bytes == 0


def test_compute_from_flops():
    work = Workload(model=TOY, tokens_per_gpu=8, peak_flops=1e3, mfu=0.5)
    # 6 * (112 - 40 lookup) + 12 * 2 * 4 * 8 = 432 + 768 FLOPs per token
    assert TOY.flops_per_token() == 6 * 72 + 12 * 2 * 4 * 8
    assert work.fwd_bwd_s() == pytest.approx(8 * 1200 / (1e3 * 0.5))


def test_bad_arguments():
    with pytest.raises(ValueError, match="strategy"):
        simulate_step(Method("none"), toy_workload(), FABRIC, 2, SPEED, strategy="zero3")
    with pytest.raises(ValueError, match="world_size"):
        simulate_step(Method("none"), toy_workload(), FABRIC, 0, SPEED)
    with pytest.raises(ValueError, match="mfu"):
        Workload(model=TOY, tokens_per_gpu=8, peak_flops=1.0, mfu=0.0)
    with pytest.raises(ValueError, match="tokens_per_gpu"):
        Workload(model=TOY, tokens_per_gpu=0, peak_flops=1.0)
    with pytest.raises(ValueError, match="encode_bytes_per_s"):
        CodecSpeed(0.0, 1.0)


times = st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(fwd=st.floats(0, 5), shares=times, enc=times, comm=times, dec=times, opt=st.floats(0, 5),
       bump=st.floats(0, 5), which=st.integers(0, 5))
def test_timeline_bounds_and_monotone(fwd, shares, enc, comm, dec, opt, bump, which):
    k = min(len(shares), len(enc), len(comm), len(dec))
    shares, enc, comm, dec = shares[:k], enc[:k], comm[:k], dec[:k]
    step, busy = overlapped_step(fwd, shares, enc, comm, dec, opt)
    work = fwd + sum(shares) + sum(enc) + sum(dec) + opt
    assert step >= work - 1e-9  # the compute stream's own work
    assert step >= sum(comm) + opt - 1e-9  # the network's work
    assert busy == pytest.approx(sum(comm))
    if all(c == 0 for c in comm):
        assert step == pytest.approx(work)
    slower = list(comm)
    slower[which % k] += bump
    assert overlapped_step(fwd, shares, enc, slower, dec, opt)[0] >= step - 1e-9
