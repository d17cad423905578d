"""Codec bytes in the model equal the real codecs' payloads, and the collective follows the codec."""

import math

import pytest
import torch

from gradzip.compressors import REGISTRY, build
from gradzip.compressors.kernels import wire
from gradzip.lab.simulate.exchange import Method, lowrank_exchange, twophase_exchange
from gradzip.testing import run_ranks

SHAPES = [(16, 8), (8,), (6, 5), (40, 3)]
NUMEL = sum(math.prod(s) for s in SHAPES)


def _default_single_round_codecs():
    specs = []
    for name in sorted(REGISTRY):
        try:
            codec = build(name)
        except (ValueError, TypeError):
            continue  # a codec without defaults for every parameter
        if not codec.multi_round:
            specs.append(name)
    return specs


def _routes(spec):
    codec = build(spec)
    return ["auto"] if codec.aggregatable or codec.multi_round else ["allgather", "twophase"]


def _reduced_bytes(rank, world_size, specs, shapes):
    """On each rank: payload and sent bytes the real reducers record for one bucket, per route."""
    from gradzip.comm import make_reducer
    from gradzip.metrics import StepMetrics

    out = {}
    numel = sum(math.prod(s) for s in shapes)
    gen = torch.Generator().manual_seed(rank)
    for spec in specs:
        for route in _routes(spec):
            metrics = StepMetrics()
            reducer = make_reducer(spec, metrics=metrics, collective=route)
            grad = torch.randn(numel, generator=gen)
            reducer.reduce(0, grad, step=0, shapes=[torch.Size(s) for s in shapes]).wait()
            figures = metrics.pop()
            out[spec, route] = (figures["payload_bytes"], figures["sent_bytes"])
    return out


def _model_payload(spec, p, route="allgather"):
    candidates = Method(spec).ddp_candidates(SHAPES, torch.float32, p, "allgather" if route == "auto" else route)
    assert len(candidates) == 1
    return candidates[0]


@pytest.mark.dist
def test_model_bytes_equal_what_the_real_reducers_send():
    # Three ranks cut the 286-element bucket into uneven two-phase chunks (96, 95, 95).
    specs = ["none", "fp16", "topk:ratio=0.1", "powersgd:approx_rank=2", *_default_single_round_codecs()]
    specs = list(dict.fromkeys(specs))
    world_size = 3
    results = run_ranks(_reduced_bytes, world_size, specs, SHAPES, timeout_s=120)
    for spec in specs:
        for route in _routes(spec):
            model = _model_payload(spec, world_size, route)
            payloads = {r[spec, route][0] for r in results}
            assert payloads == {model.payload_bytes}, (spec, route)
            # The ring all_reduce floors 2 (W-1) B / W per rank; the model keeps the fraction.
            mean_sent = sum(r[spec, route][1] for r in results) / world_size
            assert model.sent_bytes(world_size) == pytest.approx(mean_sent, abs=1), (spec, route)


@pytest.mark.parametrize("spec", _default_single_round_codecs() + ["topk:ratio=0.3", "topk:ratio=1.0"])
def test_payload_equals_compressed_tensor_bytes(spec):
    from gradzip.comm.nonfinite import with_marker_slot

    codec = with_marker_slot(build(spec))  # as the reducers send it (2 bytes more without a float)
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    payload = codec.compress(x, step=0, key=0)
    dense = NUMEL * 4
    expected = payload.nbytes if payload.nbytes <= dense else dense  # the reducer's dense fallback
    assert _model_payload(spec, 3).payload_bytes == expected


def test_collective_follows_declared_properties():
    aggregatable = Method("fp16").ddp_candidates(SHAPES, torch.float32, 4)
    assert [e.method for e in aggregatable] == ["allreduce"]
    assert aggregatable[0].rounds[0].collective == "allreduce"
    both = Method("topk:ratio=0.1").ddp_candidates(SHAPES, torch.float32, 4)
    assert [e.method for e in both] == ["allgather", "twophase"]
    assert [e.method for e in Method("topk:ratio=0.1").ddp_candidates(SHAPES, torch.float32, 4, "twophase")] == ["twophase"]
    assert [e.method for e in Method("none").ddp_candidates(SHAPES, torch.float32, 4)] == ["dense"]
    with pytest.raises(ValueError, match="collective"):
        Method("topk:ratio=0.1").ddp_candidates(SHAPES, torch.float32, 4, "ring")


def test_allgather_hand_computed():
    # topk at ratio 0.1 of 286 elements: k = 29 values (fp32) + 29 int16 indices = 174 bytes
    assert NUMEL == 286
    (gather,) = Method("topk:ratio=0.1").ddp_candidates(SHAPES, torch.float32, 4, "allgather")
    assert gather.payload_bytes == 29 * (4 + 2) == 174
    assert gather.rounds[0].nbytes == 4 * 174  # the gathered output
    assert gather.sent_bytes(4) == 3 * 174
    assert gather.decode_bytes == 4 * NUMEL * 4  # every rank decodes all four payloads


def test_twophase_bytes_hand_computed_and_flat_in_world_size():
    codec = build("topk:ratio=0.1")
    # p = 4: chunks of 72, 72, 71, 71 elements, k = 7 each: 7 * (4 + 1) = 35 bytes (uint8 indices)
    ex = twophase_exchange(codec.payload_nbytes, NUMEL, torch.float32, 4)
    assert [r.collective for r in ex.rounds] == ["alltoall", "allgather"]
    assert [r.nbytes for r in ex.rounds] == [4 * 35, 4 * 35]
    assert ex.payload_bytes == 4 * 35
    assert ex.sent_bytes(4) == 2 * 3 * 35
    # encode: every chunk, then the own mean (72); decode: 4 versions of the own chunk, every mean
    assert ex.encode_bytes == (286 + 72) * 4 and ex.decode_bytes == (4 * 72 + 286) * 4
    # 1-bit payload of a large tensor: two-phase sends about 2 payloads per worker for any p
    sign = Method("onebit-adam")
    n = 1 << 24
    full = sign.sign_payload_nbytes(n)
    for p in (8, 64, 1024):
        sent = sign.onebit_momentum_exchange(n, p).sent_bytes(p)
        assert sent == 2 * (p - 1) * sign.sign_payload_nbytes(n // p)  # p divides n: equal chunks
        assert 1.75 * full <= sent < 2 * full + 2 * p * 4  # 2 (p-1)/p payloads, plus per-chunk scales


def test_onebit_adam_payload_and_warmup():
    method = Method("onebit-adam:warmup=0.2")
    assert method.onebit_adam and method.warmup_fraction == 0.2
    assert Method("onebit-adam").warmup_fraction == 0.15
    expected = wire.packed_nbytes(1001, 1) + 4
    if any(name in REGISTRY for name in ("efsignsgd", "signsgd")):
        expected = method.sign_codec.payload_nbytes(1001)
    assert method.sign_payload_nbytes(1001) == expected
    assert method.ddp_candidates(SHAPES, torch.float32, 4)[0].rounds == ()
    with pytest.raises(ValueError, match="warmup"):
        Method("onebit-adam:warmup=2")
    with pytest.raises(ValueError, match="fused"):
        Method("onebit-adam:fused=3")
    with pytest.raises(ValueError, match="train's warmup_steps=N of --steps S is warmup=N/S here"):
        Method("onebit-adam:warmup_steps=10")  # gradzip train's key, with the conversion named
    assert len(method.onebit_momentum_exchanges(SHAPES, 4)) == len(SHAPES)
    assert len(Method("onebit-adam:fused=true").onebit_momentum_exchanges(SHAPES, 4)) == 1
    with pytest.raises(ValueError, match="fsdp|ddp"):
        method.fsdp_gradient_exchange(SHAPES, torch.float32, 4)


def test_lowrank_rounds_hand_computed():
    codec = build("powersgd:approx_rank=2")
    ex = lowrank_exchange(codec, SHAPES, torch.float32)
    # (16, 8): P 16x2, Q 8x2; (8,) travels dense in round 1; (6, 5): (6+5)*2 = 22 < 30
    # compresses, P 6x2, Q 5x2; (40, 3): (40+3)*2 = 86 < 120 compresses, P 40x2, Q 3x2
    round1 = (16 * 2 + 8 + 6 * 2 + 40 * 2) * 4
    round2 = (8 * 2 + 5 * 2 + 3 * 2) * 4
    assert [r.nbytes for r in ex.rounds] == [round1, round2]
    assert ex.payload_bytes == sum(codec.matrix_payload_nbytes(s) for s in SHAPES)
    # a bucket of vectors only takes one dense round
    assert Method("powersgd:approx_rank=2").ddp_candidates([(10,), (3,)], torch.float32, 2)[0].method == "dense"


def test_fsdp_gradient_exchanges():
    p = 4
    none = Method("none").fsdp_gradient_exchange(SHAPES, torch.float32, p)
    assert none.rounds[0].collective == "reducescatter" and none.rounds[0].nbytes == NUMEL * 4
    fp16 = Method("fp16").fsdp_gradient_exchange(SHAPES, torch.float32, p)
    assert fp16.rounds[0].nbytes == NUMEL * 2
    topk = Method("topk:ratio=0.1").fsdp_gradient_exchange(SHAPES, torch.float32, p)
    assert topk.rounds[0].collective == "alltoall" and topk.rounds[0].nbytes == 4 * 35


def test_unknown_codec_raises():
    with pytest.raises(ValueError, match="unknown compressor"):
        Method("zip:level=9")
