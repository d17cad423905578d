"""Every codec through every collective on spawned gloo ranks (world sizes 2, 3 and 4).

One spawn per world size runs all checks (spawning is the cost):

- each single-round codec, each collective it takes, buckets of odd sizes (empty, one element,
  fewer elements than ranks, not divisible by the world size), two steps with error feedback:
  the result equals the single-process reference (``simulate_ranks``) bit for bit where the
  bytes are exchanged unchanged (``allgather``, ``twophase``) and to rounding where gloo sums
  (``allreduce``, ``dense``); every rank holds the same bits;
- the bytes each rank hands to collectives, recorded by wrapping ``torch.distributed``'s
  collectives, equal the formulas of ``gradzip.comm.traffic`` and the per-bucket metrics;
- several buckets in flight through one queue with uneven compute per rank;
- a DDP model whose small buckets travel fused and uncompressed and whose others take two phases
  (at world size 3).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from gradzip.comm import CollectiveQueue, make_reducer
from gradzip.comm.reference import simulate_ranks
from gradzip.compressors import build, list_compressors
from gradzip.feedback import ErrorFeedback
from gradzip.testing import run_ranks

pytestmark = pytest.mark.dist

SINGLE_ROUND = [name for name in list_compressors() if not build(name).multi_round]


class _Recorder:
    """Wraps the collectives the reducers call and adds up the bytes this rank sends."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.sent = 0
        self.allreduce_bytes = 0  # ring figure applied to the total, as the formula does
        self.originals = {}

    def __enter__(self):
        for name in ("all_to_all_single", "all_gather_single", "all_reduce"):
            self.originals[name] = getattr(dist, name)
            setattr(dist, name, getattr(self, "_" + name))
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(dist, name, fn)

    def pop(self) -> int:
        w = self.world_size
        total = self.sent + 2 * (w - 1) * self.allreduce_bytes // w
        self.sent = self.allreduce_bytes = 0
        return total

    def _all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        itemsize = input.element_size()
        splits = input_split_sizes or [input.numel() // self.world_size] * self.world_size
        self.sent += (input.numel() - splits[self.rank]) * itemsize
        return self.originals["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, **kw)

    def _all_gather_single(self, output, input, **kw):
        self.sent += (self.world_size - 1) * input.numel() * input.element_size()
        return self.originals["all_gather_single"](output, input, **kw)

    def _all_reduce(self, tensor, **kw):
        self.allreduce_bytes += tensor.numel() * tensor.element_size()
        return self.originals["all_reduce"](tensor, **kw)


def _expected_sent(route: str, codec, numel: int, world_size: int, rank: int) -> int:
    """The formulas, written out independently of gradzip.comm.traffic. A codec whose payload
    holds no floating tensor travels with a 2-byte fp16 slot for the NaN skip marker."""
    raw = numel * 4
    probe = codec.compress(torch.randn(8), step=0, key="probe").tensors
    slot = 0 if any(t.is_floating_point() for t in probe) else 2

    def nbytes(n: int) -> int:
        return codec.payload_nbytes(n) + slot

    if route == "dense":
        return 2 * (world_size - 1) * raw // world_size
    if route == "allreduce":
        return 2 * (world_size - 1) * nbytes(numel) // world_size
    if route == "allgather":
        return (world_size - 1) * nbytes(numel)
    assert route == "twophase"
    sizes = [numel // world_size + (1 if j < numel % world_size else 0) for j in range(world_size)]
    chunk = [nbytes(s) if s else 0 for s in sizes]
    return sum(chunk) - chunk[rank] + (world_size - 1) * chunk[rank]


def _grads(world_size: int, numel: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) for _ in range(world_size)]


def _every_codec(rank: int, world_size: int) -> dict:
    """Every rank reduces every case; the single-process reference of each (codec, collective)
    is computed by one rank, in turn (it is the same computation on any rank, and most of the
    work: computed on every rank it multiplied the run's time on two cores)."""
    out = {}
    sizes = sorted({0, 1, world_size - 1, world_size + 1, 2 * world_size + 3, 301})
    turn = 0
    with _Recorder(rank, world_size) as recorder:
        for name in SINGLE_ROUND:
            codec = build(name)
            collectives = ["auto", "allgather", "twophase"] + (["allreduce"] if codec.aggregatable else [])
            for collective in collectives:
                reducer = make_reducer(name, collective=collective)
                mine = turn % world_size == rank
                turn += 1
                use_fb = codec.error_feedback
                fb = [ErrorFeedback() for _ in range(world_size)] if use_fb else None
                sfb = [ErrorFeedback() for _ in range(world_size)] if use_fb else None
                for numel in sizes:
                    key = ("bucket", numel)
                    for step in range(2):
                        grads = _grads(world_size, numel, seed=numel * 10 + step)
                        got = reducer.reduce(key, grads[rank], step=step).wait()
                        sent = recorder.pop()
                        want = simulate_ranks(
                            name, grads, step=step, key=key, feedback=fb, server_feedback=sfb, collective=collective
                        ) if mine else None
                        route = reducer.route(numel, torch.float32) if numel else "none"
                        metrics = reducer.metrics.pop()
                        bucket = metrics["buckets"].get(key, {"sent_bytes": 0, "collective": "none"})
                        out[(name, collective, numel, step)] = {
                            "route": route,
                            "got": got,
                            "want": want,
                            "sent": sent,
                            "expected_sent": 0 if not numel else _expected_sent(route, codec, numel, world_size, rank),
                            "metric_sent": bucket["sent_bytes"],
                            "metric_route": bucket["collective"],
                        }
                if collective == "twophase" and use_fb:
                    state = reducer.state_dict()
                    out[(name, "state")] = {k: tuple(v.shape) for k, v in state["server_feedback"]["residuals"].items()}
    return out


def _buckets_in_flight(rank: int, world_size: int) -> dict:
    """Six buckets through three reducers sharing one queue, ranks pausing unevenly between them;
    the ranks reach each reduce at different times, so round 2 of one bucket races round 1 of
    the next on each rank differently."""
    queue = CollectiveQueue()
    reducers = {
        "twophase": make_reducer("topk:ratio=0.1", collective="twophase", queue=queue),
        "allgather": make_reducer("topk:ratio=0.1", collective="allgather", queue=queue),
        "dense": make_reducer("none", queue=queue),
    }
    plan = [("twophase", 1000), ("allgather", 999), ("twophase", 37), ("dense", 500), ("twophase", 2003), ("twophase", 3)]
    futures, wants = [], []
    for step in range(2):
        for i, (kind, numel) in enumerate(plan):
            time.sleep(0.005 * ((rank + i) % world_size))
            grads = _grads(world_size, numel, seed=1000 + i + 100 * step)
            futures.append(reducers[kind].reduce(i, grads[rank], step=step))
            wants.append((kind, grads))
        torch.futures.wait_all(futures[-len(plan) :])
    # References, with feedback replayed in the same order per reducer.
    fbs = {k: ([ErrorFeedback() for _ in range(world_size)], [ErrorFeedback() for _ in range(world_size)]) for k in reducers}
    results = []
    for n, (fut, (kind, grads)) in enumerate(zip(futures, wants)):
        step, i = divmod(n, len(plan))
        fb, sfb = fbs[kind] if kind != "dense" else (None, None)
        collective = "twophase" if kind == "twophase" else ("allgather" if kind == "allgather" else "auto")
        want = simulate_ranks(
            reducers[kind].compressor, grads, step=step, key=i, feedback=fb, server_feedback=sfb, collective=collective
        )
        results.append((reducers[kind].route(grads[0].numel(), torch.float32), fut.value(), want))
    return {"results": results, "pending": queue.pending()}


_SEEN_BUCKETS: list[tuple[int, int]] = []  # (bucket index, raw bytes) per hook call, this rank


def _recording_hook(state, bucket):
    from gradzip.ddp import compression_hook

    _SEEN_BUCKETS.append((bucket.index(), bucket.buffer().numel() * bucket.buffer().element_size()))
    return compression_hook(state, bucket)


def _ddp_fused(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradzip.ddp import CompressionState

    torch.manual_seed(0)  # the same initial model on every rank
    layers = [torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)]
    model = torch.nn.Sequential(*layers)
    copy = torch.nn.Sequential(*[torch.nn.Linear(m.in_features, m.out_features) if isinstance(m, torch.nn.Linear) else m for m in layers])
    copy.load_state_dict(model.state_dict())
    # Tiny buckets: those below 1024 bytes travel fused, the others take two phases.
    ddp = DDP(model, bucket_cap_mb=0.0001)
    state = CompressionState("topk:ratio=0.25", collective="twophase", min_compress_bytes=1024)
    ddp.register_comm_hook(state, _recording_hook)
    steps = []
    for step in range(3):
        batches = []
        for r in range(world_size):
            gen = torch.Generator().manual_seed(100 * step + r)
            batches.append((torch.randn(8, 16, generator=gen), torch.randn(8, 3, generator=gen)))
        x, y = batches[rank]
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        # The exact mean of every rank's local gradients, from an undistributed copy.
        local = []
        for bx, by in batches:
            copy.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(copy(bx), by).backward()
            local.append([p.grad.clone() for p in copy.parameters()])
        mean = [torch.stack(gs).sum(0) / world_size for gs in zip(*local)]
        grads = [p.grad.clone() for p in model.parameters()]
        steps.append({"grads": grads, "mean": mean, "metrics": state.metrics.pop()})
        ddp.zero_grad(set_to_none=True)
    return {"steps": steps, "step": state.step, "buckets": list(_SEEN_BUCKETS)}


def _all_checks(rank: int, world_size: int, with_ddp: bool) -> dict:
    return {
        "codecs": _every_codec(rank, world_size),
        "in_flight": _buckets_in_flight(rank, world_size),
        # DDP imports torch._dynamo (seconds per rank): checked at one world size.
        "ddp": _ddp_fused(rank, world_size) if with_ddp else None,
    }


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_on_gloo_ranks(world_size):
    with_ddp = world_size == 3
    ranks = run_ranks(_all_checks, world_size, with_ddp, timeout_s=240)

    # Every codec, every collective, odd sizes: reference, identical ranks, bytes.
    codecs = ranks[0]["codecs"]
    cases = [case for case in codecs if case[1] != "state"]
    owners = {case: [r for r, other in enumerate(ranks) if other["codecs"][case]["want"] is not None] for case in cases}
    assert all(len(owner) == 1 for owner in owners.values()), owners  # one reference per case
    wants = {case: ranks[owner]["codecs"][case]["want"] for case, (owner,) in owners.items()}
    routes = set()
    for case in cases:
        entry = codecs[case]
        name, collective, numel, step = case
        routes.add(entry["route"])
        got, want = entry["got"], wants[case]
        assert got.shape == want.shape and got.dtype == want.dtype, case
        if entry["route"] in ("allgather", "twophase", "none"):
            assert torch.equal(got, want), case
        else:
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=str(case))
        for r, other in enumerate(ranks):
            theirs = other["codecs"][case]
            assert torch.equal(theirs["got"], got), (case, r)
            assert theirs["sent"] == theirs["expected_sent"] == theirs["metric_sent"], (case, r, theirs)
            if numel:
                assert theirs["metric_route"] == entry["route"], case
    assert {"allgather", "twophase", "dense", "allreduce"} <= routes
    # The server-side residual is kept for the chunk each rank owns.
    for r, other in enumerate(ranks):
        for case, shapes in other["codecs"].items():
            if case[1] == "state":
                assert shapes[("bucket", 301)] == (301 // world_size + (1 if r < 301 % world_size else 0),)

    # Buckets in flight, uneven compute.
    for other in ranks:
        assert other["in_flight"]["pending"] == 0
        for (route, got, want), (_, got0, _) in zip(other["in_flight"]["results"], ranks[0]["in_flight"]["results"]):
            assert torch.equal(got, got0)
            if route in ("dense", "allreduce"):
                torch.testing.assert_close(got, want)
            else:
                assert torch.equal(got, want)

    # DDP: fused small buckets are the exact mean; every rank ends with the same gradients.
    # The first step runs one bucket; DDP then rebuilds them as (64 x 3 weight + bias), bias,
    # 64 x 64 weight, bias, 64 x 16 weight: 780, 256, 16384, 256 and 4096 bytes.
    if not with_ddp:
        return
    ddp = ranks[0]["ddp"]
    assert ddp["step"] == 3
    assert [nbytes for _, nbytes in ddp["buckets"][1:]] == [780, 256, 16384, 256, 4096] * 2
    for step, entry in enumerate(ddp["steps"]):
        buckets = entry["metrics"]["buckets"]
        for bucket in buckets.values():
            small = bucket["dense_bytes"] < 1024
            assert bucket["collective"] == ("fused" if small else "twophase")
            assert bucket["compressed"] is not small
        assert entry["metrics"]["fused_buckets"] == (0 if step == 0 else 3)
        for other in ranks[1:]:
            for a, b in zip(other["ddp"]["steps"][step]["grads"], entry["grads"]):
                assert torch.equal(a, b)
        if step:
            for grad, mean in zip(entry["grads"], entry["mean"]):
                if grad.numel() * grad.element_size() < 1024:  # in a fused bucket
                    torch.testing.assert_close(grad, mean, rtol=1e-6, atol=1e-7)
