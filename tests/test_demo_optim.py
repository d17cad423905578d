"""DeMo: the chunked DCT, a single-process reference of the algorithm against real gloo ranks
(bit for bit), bytes per step against the formula, exact resume, non-finite steps skipped on
every rank, and bad settings."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.optim_runs import (
    backward,
    nan_in_rank0_bias,
    params_unchanged,
    resumed,
    skip_and_retake,
    tiny_model,
    train,
)

from gradzip.optim import DeMo, dct
from gradzip.testing import run_ranks

STEPS = 6
RESUME_AT = 3
HYPER = {"lr": 1e-2, "compression_decay": 0.9, "compression_topk": 3, "compression_chunk": 4, "weight_decay": 0.1}


def expected_bytes(compact: bool = False, value_bits: int = 16) -> int:
    """chunks * k * (4-byte value + 1-byte index) per parameter at chunk 4, top-k 3: weight 6 x 8
    in 3 x 4 blocks (4 chunks, k 3); bias 6 in chunks of 3 (2, k 3); weight 5 x 6 in 1 x 3 blocks
    (5 has no divisor in 2..4: 10 chunks, k 3); bias 5 in chunks of 1 (5, k 1). Compact: 2-byte
    values, and positions packed at 4 bits (12 elements a block), 2 bits (chunks of 3 elements)
    and 1 bit (chunks of 1 element)."""
    if not compact:
        return 5 * (4 * 3 + 2 * 3 + 10 * 3 + 5 * 1)
    if value_bits == 8:  # a byte per value and 4 per chunk (its scale), then the same positions
        return (12 + 4 * 4 + 6) + (6 + 2 * 4 + 2) + (30 + 10 * 4 + 8) + (5 + 5 * 4 + 1)
    return (2 * 12 + math.ceil(12 * 4 / 8)) + (2 * 6 + math.ceil(6 * 2 / 8)) + (2 * 30 + math.ceil(30 * 2 / 8)) \
        + (2 * 5 + math.ceil(5 * 1 / 8))


# ----- the transform ---------------------------------------------------------------------------


@pytest.mark.parametrize("size, chunk, side", [(768, 64, 64), (100, 64, 50), (67, 64, 1), (10, 64, 10), (6, 4, 3), (1, 64, 1)])
def test_chunk_side_is_the_largest_divisor_up_to_the_chunk(size, chunk, side):
    assert dct.chunk_side(size, chunk) == side


def test_dct_is_the_orthonormal_dct_ii_per_chunk_and_inverts():
    n = 8
    basis = torch.tensor([[math.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt((1 if k == 0 else 2) / n)
                           for k in range(n)] for i in range(n)], dtype=torch.float64)
    x = torch.randn(24, dtype=torch.float64)
    torch.testing.assert_close(dct.encode(x, 8), x.view(3, 8) @ basis)
    m = torch.randn(16, 24, dtype=torch.float64)
    coeffs = dct.encode(m, 8)  # blocks (y, x) of 8 x 8 in row-major block order
    torch.testing.assert_close(coeffs[1 * 3 + 2].view(8, 8), basis.T @ m[8:16, 16:24] @ basis)
    for t in (x, m, torch.randn(4, 6, 3, dtype=torch.float64), torch.tensor(2.5, dtype=torch.float64)):
        torch.testing.assert_close(dct.decode(dct.encode(t, 8), t.shape, 8), t)


# ----- the single-process reference ------------------------------------------------------------


def _e4m3(val: torch.Tensor) -> torch.Tensor:
    """Each row scaled so that its largest magnitude is 448, rounded to e4m3, scaled back."""
    scale = val.abs().amax(-1, keepdim=True) / 448
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (val / scale).to(torch.float8_e4m3fn).float() * scale


@torch.no_grad()
def reference_run(world_size: int, steps: int, compact: bool = False, momenta: list | None = None,
                  value_bits: int = 16) -> list[torch.Tensor]:
    """The algorithm written out: a momentum per rank, top-k of its chunked DCT, the kept part
    subtracted, the mean over senders per position, the sign step. Compact: the values rounded
    to bfloat16 before they are subtracted and sent. ``momenta`` receives each rank's momentum of
    the first weight at the end."""
    models = [tiny_model(0) for _ in range(world_size)]
    lr, decay, topk, chunk, wd = (HYPER[k] for k in ("lr", "compression_decay", "compression_topk", "compression_chunk", "weight_decay"))
    deltas = [[torch.zeros_like(p) for p in models[0].parameters()] for _ in range(world_size)]
    for step in range(steps):
        sent = []  # sent[rank][param] = (values, indices)
        for rank, model in enumerate(models):
            model.zero_grad()
            with torch.enable_grad():
                backward(model, rank, step)
            mine = []
            for j, p in enumerate(model.parameters()):
                delta = deltas[rank][j].mul(decay).add_(p.grad, alpha=lr)
                coeffs = dct.encode(delta, chunk)
                idx = torch.topk(coeffs.abs(), min(topk, coeffs.shape[1]), dim=-1, sorted=False).indices
                val = torch.gather(coeffs, -1, idx)
                if compact:
                    val = val.bfloat16().float() if value_bits == 16 else _e4m3(val)
                deltas[rank][j] = delta - dct.decode(torch.zeros_like(coeffs).scatter_(-1, idx, val), p.shape, chunk)
                mine.append((val, idx))
            sent.append(mine)
        for j, p in enumerate(models[0].parameters()):
            coeffs = dct.encode(torch.zeros_like(p), chunk)
            sums, counts = torch.zeros_like(coeffs), torch.zeros_like(coeffs)
            for rank in range(world_size):
                val, idx = sent[rank][j]
                sums.scatter_add_(-1, idx, val)
                counts.scatter_add_(-1, idx, torch.ones_like(val))
            update = dct.decode(sums / counts.clamp(min=1), p.shape, chunk)
            p.mul_(1 - lr * wd).add_(update.sign(), alpha=-lr)
        for model in models[1:]:
            model.load_state_dict(models[0].state_dict())
    if momenta is not None:
        momenta.extend(deltas[rank][0].clone() for rank in range(world_size))
    return [p.detach().clone() for p in models[0].parameters()]


# ----- real ranks ------------------------------------------------------------------------------


def _ranks(rank: int, world_size: int, compact: bool = False, value_bits: int = 16) -> dict:
    out: dict = {}
    hyper = dict(HYPER, compact=compact, value_bits=value_bits)
    model = tiny_model(0)
    opt = DeMo(model.parameters(), **hyper)
    saves, bytes_log = [], []
    train(rank, model, opt, range(STEPS), resume_at=RESUME_AT, saves=saves, bytes_log=bytes_log)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["bytes"] = bytes_log
    out["momentum"] = opt.state[model[0].weight]["delta"].clone()

    fresh = tiny_model(4)
    out["resumed"] = resumed(rank, saves[0], fresh, DeMo(fresh.parameters(), **hyper), range(RESUME_AT, STEPS))

    def check(before, model, opt):
        same_state = all(torch.equal(before[1]["state"][k]["delta"], v["delta"]) for k, v in opt.state_dict()["state"].items())
        return opt.last_step_skipped, params_unchanged(before[0], model), same_state, opt.steps_taken

    model = tiny_model(0)
    opt = DeMo(model.parameters(), **hyper)
    skips = skip_and_retake(rank, model, opt, range(STEPS), bad_steps=(2,), spoil=nan_in_rank0_bias,
                            check=check)
    out["skips"] = skips
    out["after_skips"] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.parametrize("world_size, compact, value_bits", [(2, False, 16), (3, True, 16), (3, True, 8)],
                         ids=["reference-wire", "compact-3-ranks", "compact-8-bit-3-ranks"])
def test_demo_on_gloo_ranks_equals_the_reference_bit_for_bit(world_size, compact, value_bits):
    results = run_ranks(_ranks, world_size, compact, value_bits)
    momenta: list[torch.Tensor] = []
    reference = reference_run(world_size, STEPS, compact, momenta, value_bits)
    dense = 4 * sum(p.numel() for p in tiny_model().parameters())
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], reference))
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], reference))
        assert all(torch.equal(a, b) for a, b in zip(r["after_skips"], reference))
        assert r["skips"] == [(True, True, True, 2)]
        for predicted, popped in r["bytes"]:
            assert predicted == popped["payload_bytes"] == expected_bytes(compact, value_bits)
            assert popped["sent_bytes"] == (world_size - 1) * popped["payload_bytes"]  # all_gather: (W - 1) P
            assert popped["dense_bytes"] == dense
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0]["params"], r["params"]))
    assert not torch.equal(results[0]["momentum"], results[1]["momentum"])  # the momenta stay local
    assert all(torch.equal(r["momentum"], m) for r, m in zip(results, momenta))
    if compact:  # the rounding is fed back: the momenta tell the encodings apart where signs may not
        plain: list[torch.Tensor] = []
        reference_run(world_size, STEPS, False, plain)
        assert not torch.equal(momenta[0], plain[0])


# ----- one process -----------------------------------------------------------------------------


@pytest.mark.parametrize("compact", [False, True])
def test_single_rank_is_the_reference_at_world_size_one(compact):
    model = tiny_model(0)
    opt = DeMo(model.parameters(), **HYPER, compact=compact)
    train(0, model, opt, range(STEPS))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference_run(1, STEPS, compact)))


def test_compact_packs_12_bit_positions_and_bfloat16_values():
    opt = DeMo(torch.nn.Linear(256, 128).parameters(), compact=True)
    weight, bias = opt.param_groups[0]["params"]
    assert opt.param_payload_nbytes(weight) == 8 * 32 * 2 + 8 * 32 * 12 // 8  # 64 x 64 blocks: 12 bits
    assert opt.param_payload_nbytes(bias) == 2 * 32 * 2 + 2 * 32 * 6 // 8  # chunks of 64: 6 bits


def test_wide_chunks_use_int16_indices_and_paper_defaults():
    opt = DeMo(torch.nn.Linear(256, 128).parameters())
    assert (opt.compression_decay, opt.compression_topk, opt.compression_chunk) == (0.999, 32, 64)
    assert opt.defaults["lr"] == 4e-4 and opt.defaults["weight_decay"] == 0.0
    weight, bias = opt.param_groups[0]["params"]
    assert opt.param_payload_nbytes(weight) == 2 * 4 * 32 * (4 + 2)  # 64 x 64 blocks: int16 positions
    assert opt.param_payload_nbytes(bias) == 2 * 32 * (4 + 1)  # chunks of 64: uint8 positions


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"compression_chunk": 0}, "compression_chunk"),
        ({"compression_chunk": 4097}, r"compression_chunk must be an integer in \[1, 4096\]"),
        ({"compression_topk": 0}, "compression_topk"),
        ({"compression_decay": 1.0}, "compression_decay"),
        ({"compression_decay": -0.1}, "compression_decay"),
        ({"lr": 0.0}, "lr"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"compact": "yes"}, "compact"),
        ({"value_bits": 4}, "value_bits"),
        ({"value_bits": 12, "compact": True}, "value_bits must be one of 8, 16; got 12"),
        ({"value_bits": 8}, "value_bits=8 needs compact=True"),
    ],
)
def test_bad_settings_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DeMo(tiny_model().parameters(), **kwargs)
