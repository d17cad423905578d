"""FSDP's reduce-scatter for the codecs with a reducer of their own whose payloads add up
(SEPARATE, Radius, the count sketch): on 2 and 3 gloo ranks, each rank's chunk equals its rows
of what the DDP reducer returns for the unsharded gradient the chunks stack into, the bytes are
that reducer's, the ops scale the same mean, resume is exact, and inf on one rank gives NaN on
every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradzip.comm import make_reducer
from gradzip.compressors import build
from gradzip.fsdp import CompressedReduceScatter
from gradzip.metrics import StepMetrics
from gradzip.testing import run_ranks

# Shapes of the parameters within one chunk: two matrices and two vectors.
SHARD_SHAPES = [torch.Size(s) for s in [(6, 40), (7,), (5, 48), (4,)]]
CHUNK = sum(s.numel() for s in SHARD_SHAPES)
SPECS = ["separate:approx_rank=2", "radius:ratio=0.3,range_size=8,period=2", "countsketch:ratio=0.1,width=2", "int8:group=16"]
STEPS, RESUME_AT = 4, 2


def _buffer(rank: int, step: int, world_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(world_size * CHUNK, generator=gen) * (1 + rank)


def _stacked(buffer: torch.Tensor, world_size: int) -> tuple[torch.Tensor, list[torch.Size]]:
    """The unsharded gradient each parameter's chunks stack into, end to end, and its shapes:
    built here by slicing parameter by parameter, independently of the adapter."""
    grid = buffer.view(world_size, CHUNK)
    parts, shapes, start = [], [], 0
    for s in SHARD_SHAPES:
        n = s.numel()
        parts.append(torch.stack([grid[r, start : start + n].view(s) for r in range(world_size)]).reshape(-1))
        shapes.append(torch.Size((world_size * s[0], *s[1:])))
        start += n
    return torch.cat(parts), shapes


def _own_rows(mean: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    rows, offset = [], 0
    for s in SHARD_SHAPES:
        n = s.numel()
        rows.append(mean[offset : offset + world_size * n].view(world_size, n)[rank])
        offset += world_size * n
    return torch.cat(rows)


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    for spec in SPECS:
        comm = CompressedReduceScatter(build(spec), name="m", shard_shapes=SHARD_SHAPES, metrics=StepMetrics())
        reference = make_reducer(spec)
        got, want, nbytes, want_bytes, saved = [], [], [], [], None
        for step in range(STEPS):
            if step == RESUME_AT:
                saved = comm.state_dict()
            buffer = _buffer(rank, step, world_size)
            output = torch.empty(CHUNK)
            comm(output, buffer, dist.group.WORLD, dist.ReduceOp.AVG)
            got.append(output)
            nbytes.append(comm.metrics.pop()["payload_bytes"])
            flat, shapes = _stacked(buffer, world_size)
            want.append(_own_rows(reference.reduce("m", flat, step=step, shapes=shapes).wait(), rank, world_size))
            want_bytes.append(reference.metrics.pop()["payload_bytes"])
        fresh = CompressedReduceScatter(build(spec), name="m", shard_shapes=SHARD_SHAPES, metrics=StepMetrics())
        fresh.load_state_dict(saved)
        resumed = []
        for step in range(RESUME_AT, STEPS):
            output = torch.empty(CHUNK)
            fresh(output, _buffer(rank, step, world_size), dist.group.WORLD, dist.ReduceOp.AVG)
            resumed.append(output)
        summed = torch.empty(CHUNK)
        CompressedReduceScatter(build(spec), name="m", shard_shapes=SHARD_SHAPES)(
            summed, _buffer(rank, 0, world_size), dist.group.WORLD, dist.ReduceOp.SUM
        )
        poisoned = _buffer(rank, 0, world_size)
        if rank == 1:
            poisoned[3] = float("inf")
        nan_out = torch.empty(CHUNK)
        CompressedReduceScatter(build(spec), name="m", shard_shapes=SHARD_SHAPES)(
            nan_out, poisoned, dist.group.WORLD, dist.ReduceOp.AVG
        )
        out[spec] = {
            "got": got, "want": want, "bytes": nbytes, "want_bytes": want_bytes, "resumed": resumed,
            "exchange": comm.last_exchange, "sum": summed, "nan": nan_out,
        }
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_summed_codecs_keep_their_rows_of_the_ddp_reducers_mean(world_size):
    results = run_ranks(_worker, world_size, timeout_s=300)
    for spec in SPECS:
        for rank, res in enumerate(results):
            r = res[spec]
            assert r["exchange"] == "allreduce", spec
            for step in range(STEPS):
                assert torch.equal(r["got"][step], r["want"][step]), (spec, rank, step)
            assert r["bytes"] == r["want_bytes"], spec
            assert r["bytes"][-1] < world_size * CHUNK * 4, spec  # compressed: fewer than the raw buffer
            for got, want in zip(r["resumed"], r["got"][RESUME_AT:]):
                assert torch.equal(got, want), f"{spec}: a resumed run differs"
            torch.testing.assert_close(r["sum"], r["got"][0] * world_size, msg=spec)
            assert torch.isnan(r["nan"]).all(), spec


def test_a_matrix_codec_without_the_layout_goes_dense_with_a_warning():
    results = run_ranks(_no_layout, 2)
    for rank, (got, exchange, warned) in enumerate(results):
        want = (_buffer(0, 0, 2) + _buffer(1, 0, 2)).view(2, CHUNK)[rank] / 2
        torch.testing.assert_close(got, want)
        assert exchange == "dense" and warned


def _no_layout(rank: int, world_size: int):
    import warnings

    comm = CompressedReduceScatter(build("separate:approx_rank=2"), name="m", shard_shapes=None)
    output = torch.empty(CHUNK)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm(output, _buffer(rank, 0, world_size), dist.group.WORLD, dist.ReduceOp.AVG)
    return output, comm.last_exchange, any("layout" in str(w.message) for w in caught)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(12, 12)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 12))
        self.head = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.mlp(torch.relu(self.attn(x))))


def _train_per_module(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from gradzip.fsdp import compress_reduce_scatter

    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = _Net()
    fully_shard(net.attn)
    fully_shard(net.mlp)
    fully_shard(net)
    # mlp: 1,012 elements, sketched in 2,551 bytes against 4,048 raw (compressed, not the fallback)
    policy = {"attn": "none", "mlp": "countsketch:ratio=0.1,width=2", "": "separate:approx_rank=2"}
    state = compress_reduce_scatter(net, lambda name, module: policy[name])
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    exchanges = []
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(16, 12, generator=gen)).square().mean().backward()
        opt.step()
        exchanges.append({name: comm.last_exchange for name, comm in state.comms.items()})
    full = torch.cat([p.full_tensor().reshape(-1) for p in net.parameters()])
    return {"params": full, "exchanges": exchanges, "specs": state.state_dict()["compressor"]}


def test_a_module_policy_with_the_summed_codecs_trains_alike_on_every_rank():
    """The docs' per-module policy with the count sketch on a fully_shard model: every rank ends
    with the same parameters, and each module took the exchange its codec asks for."""
    results = run_ranks(_train_per_module, 2, timeout_s=300)
    assert torch.isfinite(results[0]["params"]).all()
    assert torch.equal(results[0]["params"], results[1]["params"])
    for res in results:
        assert res["specs"] == {"": "separate:approx_rank=2", "attn": "none", "mlp": "countsketch:ratio=0.1,width=2.0"}
        assert res["exchanges"][-1] == {"": "allreduce", "attn": "reduce_scatter", "mlp": "allreduce"}


def _edges(rank: int, world_size: int) -> dict:
    """An empty chunk, a payload that falls back to dense, and an fp16 SUM near the fp16 maximum."""
    out = {}
    for spec in SPECS:
        empty = torch.empty(0)
        CompressedReduceScatter(build(spec), name="m", shard_shapes=[])(empty, torch.empty(0), dist.group.WORLD, dist.ReduceOp.AVG)
        big = torch.full((world_size * CHUNK,), 60000.0, dtype=torch.float16)
        summed = torch.empty(CHUNK, dtype=torch.float16)
        CompressedReduceScatter(build(spec), name="m", shard_shapes=SHARD_SHAPES)(summed, big, dist.group.WORLD, dist.ReduceOp.SUM)
        out[spec] = {"empty": empty.numel(), "sum_finite": bool(torch.isfinite(summed).all())}
    fallback = CompressedReduceScatter(build("countsketch:ratio=0.5,width=3"), name="m", shard_shapes=SHARD_SHAPES)
    output = torch.empty(CHUNK)
    fallback(output, _buffer(rank, 0, world_size), dist.group.WORLD, dist.ReduceOp.AVG)
    out["fallback"] = fallback.last_exchange
    return out


def test_empty_chunks_fallbacks_and_fp16_sums_near_the_maximum():
    for res in run_ranks(_edges, 2):
        for spec in SPECS:
            assert res[spec] == {"empty": 0, "sum_finite": True}, spec
        assert res["fallback"] == "dense"  # its payload is larger than the raw buffer
