"""Every route of the registry on spawned gloo ranks (world sizes 2 and 3, odd sizes).

For each registered route and each codec it accepts, one bucket per size, two steps with the
codec's error feedback:

- the bytes each rank hands to ``torch.distributed`` (recorded by wrapping its collectives)
  equal the route's ``nbytes``, and the bytes they put on the wire by the per-collective
  formulas written out here equal its ``sent_nbytes`` (to the ring's integer rounding) and the
  metrics;
- the result equals the route's single-process ``reference``: bit for bit where no collective
  sums (and at two ranks, where a sum of two is exact in either order), to rounding where gloo
  sums three ranks in an order of its own; every rank of a ``mean`` route holds the same bits.

The test iterates :data:`gradzip.comm.routes.REGISTRY`: a new route is tested by registering it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradzip.comm.nonfinite import with_marker_slot
from gradzip.comm.reduce_scatter import CompressedReduceScatter
from gradzip.comm.reducer import CompressedReducer
from gradzip.comm.routes import COLLECTIVES, MEAN, REGISTRY, ROUTES, SHARD, choose_collective
from gradzip.compressors import build
from gradzip.feedback import ErrorFeedback
from gradzip.metrics import StepMetrics
from gradzip.testing import run_ranks

#: aggregatable (float payload; shared seed with feedback), not aggregatable (indices; no float
#: tensor at all, so the 2-byte marker slot travels too)
SPECS = ("fp16", "randomk:ratio=0.25", "topk:ratio=0.25", "signsgd")
STEPS = 2
OPS = {"sum": dist.ReduceOp.SUM, "premul": dist.ReduceOp.PREMUL_SUM(0.25)}


def _sizes(route, world_size: int) -> tuple[int, ...]:
    """Bucket sizes: fewer elements than ranks, uneven chunks, odd; shard buffers hold W chunks."""
    if route.family == SHARD:
        return tuple(world_size * c for c in (1, 3, 7))
    return (1, world_size + 2, 37)


def _inputs(world_size: int, numel: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + numel)
    return [torch.randn(numel, generator=gen) * (1 + r) for r in range(world_size)]


class _Recorder:
    """Wraps the collectives; per call, the bytes handed in and the bytes put on the wire."""

    NAMES = ("all_reduce", "all_gather_single", "all_to_all_single", "reduce_scatter_single")

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.handed = 0
        self.wire = 0.0
        self.summing_calls = 0
        self.originals = {}

    def __enter__(self):
        for name in self.NAMES:
            self.originals[name] = getattr(dist, name)
            setattr(dist, name, getattr(self, "_" + name))
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(dist, name, fn)

    def pop(self) -> tuple[int, float, int]:
        out = (self.handed, self.wire, self.summing_calls)
        self.handed, self.wire, self.summing_calls = 0, 0.0, 0
        return out

    def _ring(self, nbytes: int) -> None:
        # Ring all_reduce; gloo's reduce-scatter moves as much (measured, benchmarks/collectives.py).
        w = self.world_size
        self.handed += nbytes
        self.wire += 2 * (w - 1) * nbytes / w
        self.summing_calls += 1

    def _all_reduce(self, tensor, *args, **kw):
        self._ring(tensor.numel() * tensor.element_size())
        return self.originals["all_reduce"](tensor, *args, **kw)

    def _reduce_scatter_single(self, output, input, *args, **kw):
        self._ring(input.numel() * input.element_size())
        return self.originals["reduce_scatter_single"](output, input, *args, **kw)

    def _all_gather_single(self, output, input, *args, **kw):
        nbytes = input.numel() * input.element_size()
        self.handed += nbytes
        self.wire += (self.world_size - 1) * nbytes
        return self.originals["all_gather_single"](output, input, *args, **kw)

    def _all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        itemsize = input.element_size()
        splits = input_split_sizes or [input.numel() // self.world_size] * self.world_size
        self.handed += input.numel() * itemsize
        self.wire += (input.numel() - splits[self.rank]) * itemsize
        return self.originals["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, **kw)


def _cases(world_size: int):
    for name, route in REGISTRY.items():
        for spec in SPECS:
            if not route.accepts(build(spec)):
                continue
            for numel in _sizes(route, world_size):
                ops = OPS if route.family == SHARD else {"mean": None}
                for op_name in ops:
                    yield name, spec, numel, op_name


def _run(route, spec: str, numel: int, op, rank: int, world_size: int, recorder: _Recorder) -> list[dict]:
    """Two steps of one bucket through ``route`` on this rank."""
    out = []
    if route.family == MEAN:
        owner = CompressedReducer(build(spec), metrics=StepMetrics())
    else:
        owner = CompressedReduceScatter(build(spec), name="m", metrics=StepMetrics())
    for step in range(STEPS):
        x = _inputs(world_size, numel, step)[rank]
        if route.family == MEAN:
            got = route.launch(owner, "b", x, step=step)
            owner.flush()  # the fused route sends on flush
            got = got.wait()
            owner.settle()
            bucket = owner.metrics.pop()["buckets"]["b"]
        else:
            got = torch.empty(numel // world_size)
            route.launch(owner, got, x, dist.group.WORLD, op, step=step)
            bucket = owner.metrics.pop()["buckets"]["m"]
        handed, wire, summing_calls = recorder.pop()
        out.append({
            "got": got, "handed": handed, "wire": wire, "summing_calls": summing_calls,
            "metric_sent": bucket["sent_bytes"], "metric_route": bucket["collective"],
        })
    return out


def _on_ranks(rank: int, world_size: int) -> dict:
    out = {}
    with _Recorder(rank, world_size) as recorder:
        for name, spec, numel, op_name in _cases(world_size):
            op = OPS.get(op_name)
            out[(name, spec, numel, op_name)] = _run(REGISTRY[name], spec, numel, op, rank, world_size, recorder)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request):
    return request.param, run_ranks(_on_ranks, request.param, timeout_s=240)


def _reference(route, spec: str, numel: int, op_name: str, world_size: int) -> list[list[torch.Tensor]]:
    """Per step, what each rank should end with, from the route's single-process reference."""
    codec = with_marker_slot(build(spec))
    keeps = codec.error_feedback
    if route.family == MEAN:
        fb = [ErrorFeedback() for _ in range(world_size)] if keeps else None
        sfb = [ErrorFeedback() for _ in range(world_size)] if keeps else None
        kwargs = {"key": "b", "feedback": fb, "server_feedback": sfb}
    else:
        fb = [ErrorFeedback(dtype=torch.float32) for _ in range(world_size)] if keeps else None
        kwargs = {"key": "m", "feedback": fb, "op": OPS[op_name]}
    return [route.reference(codec, _inputs(world_size, numel, step), step=step, **kwargs) for step in range(STEPS)]


def test_every_route_hands_its_formula_and_matches_its_reference(ranks):
    world_size, results = ranks
    cases = list(_cases(world_size))
    assert {name for name, *_ in cases} == set(REGISTRY), "every route is exercised"
    for name, spec, numel, op_name in cases:
        route = REGISTRY[name]
        codec = with_marker_slot(build(spec))
        want = _reference(route, spec, numel, op_name, world_size)
        exact = not route.sums_on_wire or world_size == 2
        for rank in range(world_size):
            for step, got in enumerate(results[rank][(name, spec, numel, op_name)]):
                where = (name, spec, numel, op_name, rank, step)
                assert got["handed"] == route.nbytes(codec, numel, torch.float32, world_size, rank), where
                sent = route.sent_nbytes(codec, numel, torch.float32, world_size, rank, backend="gloo")
                assert abs(got["wire"] - sent) < max(got["summing_calls"], 1), where  # floor of 2(W-1)B/W
                assert got["metric_sent"] == sent and got["metric_route"] == route.metric_name, where
                if exact:
                    assert torch.equal(got["got"], want[step][rank]), where
                else:
                    # Another summation order moves each partial sum by at most an ulp of the
                    # wire dtype (fp16 here at worst): scale the tolerance by the summands.
                    scale = world_size * max(float(x.abs().max()) for x in _inputs(world_size, numel, step))
                    atol = 2 * torch.finfo(torch.float16).eps * scale
                    torch.testing.assert_close(got["got"], want[step][rank], rtol=0, atol=atol, msg=str(where))
                if route.family == MEAN:
                    assert torch.equal(got["got"], results[0][(name, spec, numel, op_name)][step]["got"]), where


def test_choices_and_chooser_come_from_the_registry():
    import argparse

    from gradzip.lab.simulate.exchange import COLLECTIVE_CHOICES
    from gradzip.lab.train.cli import add_parser

    requestable = [n for n, r in REGISTRY.items() if r.requestable]
    assert COLLECTIVES == ("auto", *requestable)
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    (train,) = sub.choices.values()
    (action,) = [a for a in train._actions if "--collective" in a.option_strings]
    assert tuple(action.choices) == COLLECTIVES
    assert set(COLLECTIVE_CHOICES) == {"auto"} | {n for n in requestable if not REGISTRY[n].needs_aggregatable}
    # auto answers the route with the fewest bytes summed over ranks, among those it weighs.
    for spec in SPECS:
        codec = with_marker_slot(build(spec))
        for numel in (1, 37, 10_000):
            for world_size in (2, 3, 8):
                got = choose_collective("auto", codec, numel, torch.float32, world_size)
                assert got in ROUTES
                totals = {
                    n: sum(REGISTRY[n].sent_nbytes(codec, numel, torch.float32, world_size, r) for r in range(world_size))
                    for n in ROUTES
                    if not REGISTRY[n].compressed or REGISTRY[n].auto_takes(codec)
                    and REGISTRY[n].payload_nbytes(codec, numel, torch.float32, world_size) <= numel * 4
                }
                assert totals[got] == min(totals.values()), (spec, numel, world_size)


def test_multi_round_codecs_name_a_reducer_that_make_reducer_builds():
    from gradzip.comm import make_reducer
    from gradzip.compressors import REGISTRY as CODECS

    own = {name for name, cls in CODECS.items() if cls.multi_round}
    assert own == {name for name, cls in CODECS.items() if cls.own_reducer is not None}
    assert {"powersgd", "separate", "countsketch"} <= own
    for name in sorted(own):
        module, cls_name = CODECS[name].own_reducer.split(":")
        reducer = make_reducer(build(name))
        assert type(reducer).__module__ == module and type(reducer).__name__ == cls_name
    assert type(make_reducer(build("topk"))) is CompressedReducer


def test_explanation_names_the_route_taken_and_the_bytes_weighed():
    from gradzip.comm.routes import explain_collective

    numel = 10_000
    sign = build("efsignsgd")
    payload = sign.payload_nbytes(numel, torch.float32)
    # 3 ranks: all_gather hands every rank's payload to the 2 others, 3 * 2 * payload in all
    text = explain_collective("auto", sign, numel, torch.float32, 3)
    chosen = choose_collective("auto", sign, numel, torch.float32, 3)
    assert text.startswith("fewest bytes sent over 3 ranks (" + chosen + " ")
    assert f"allgather {3 * 2 * payload:,} B" in text
    assert ("compress the mean a second time" in text) == (chosen == "twophase")
    # quality weighed: the sign codecs' second compression costs loss, so auto leaves two phases out
    assert chosen == "allgather" and "twophase not weighed for efsignsgd (two phases cost it loss: " in text
    topk = build("topk:ratio=0.01")
    assert choose_collective("auto", topk, numel, torch.float32, 3) == "twophase"
    assert choose_collective("twophase", sign, numel, torch.float32, 3) == "twophase"  # asked for: taken
    summed = build("randomk:ratio=0.25")
    text = explain_collective("auto", summed, numel, torch.float32, 3)
    assert "allgather, twophase not weighed for randomk (its payloads add up" in text
    assert explain_collective("allgather", sign, numel, torch.float32, 3) == "allgather asked for"
    # a codec whose payload exceeds the raw bucket is sent dense even when a route is asked for
    tiny = explain_collective("allgather", build("topk:ratio=1"), 3, torch.float32, 3)
    assert tiny.endswith("sent dense") and choose_collective("allgather", build("topk:ratio=1"), 3, torch.float32, 3) == "dense"


def _route_events(rank: int, world_size: int) -> list[list[dict]]:
    reducer = CompressedReducer(build("efsignsgd:start_step=1"), min_compress_bytes=64)
    events = []
    for step in range(3):
        futures = [reducer.reduce(key, torch.full((n,), float(rank + step)), step=step, flush=False)
                   for key, n in (("big", 4096), ("small", 4))]
        reducer.flush()
        for fut in futures:
            fut.wait()
        events.append(reducer.metrics.pop()["events"])
    return events


@pytest.mark.dist
def test_reducer_records_each_buckets_route_when_it_starts_or_changes():
    results = run_ranks(_route_events, 3, timeout_s=90)
    for events in results:
        routes = [[(e["bucket"], e["route"]) for e in step if e["kind"] == "route"] for step in events]
        want_big = choose_collective("auto", build("efsignsgd"), 4096, torch.float32, 3)
        assert routes == [[("big", "dense"), ("small", "dense")], [("big", want_big), ("small", "fused")], []]
        whys = {(e["bucket"], e["step"]): e["why"] for step in events for e in step}
        assert whys[("big", 0)] == "before the codec's start_step (1)"
        assert whys[("small", 1)] == "below min_compress_bytes (64 raw bytes): fused, uncompressed"
        assert whys[("big", 1)].startswith(f"fewest bytes sent over 3 ranks ({want_big} ")
