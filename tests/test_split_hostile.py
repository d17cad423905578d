"""``embeddings=CODEC`` (:mod:`gradzip.comm.split`) pushed at its edges: buckets of tables only
beside a main codec that holds small buckets back, models without tables, tables of zero rows,
bf16 buckets, a bucket rebuild and a resume in a fresh state, inf in the tables' part, the
exactness check, and specs that must be refused.

Every result is checked against a reference computed apart: the main codec's and the tables'
codec's own reducers (:func:`gradzip.comm.make_reducer`) run on the pieces cut from the same
bucket inputs by hand (:func:`_apart`), the plain codec's hook, a twin run that never saw a bad
step, or a dense all_reduce.
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.choice import parse_compressor
from gradzip.comm import CollectiveQueue, make_reducer
from gradzip.keys import bucket_key
from gradzip.metrics import relative_difference
from gradzip.testing import run_ranks

TIMEOUT_S = 120
#: the main codec that holds buckets below MIN_BYTES back (fused, sent at the flush)
TOPK = "topk:ratio=0.1"
MIN_BYTES = 200


def _spec(main: str, side: str) -> str:
    return main + ("," if ":" in main else ":") + f"embeddings={side}"


def _grad(rank: int, step: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * rank + 31 * step + numel)
    return (torch.randn(numel, generator=gen) * (1 + rank)).to(dtype)


# -- the reference: the two codecs' reducers run apart on pieces cut by hand -----------------


def _apart(calls: list[dict], main_spec: str, side_spec: str, taken, *, main_kwargs=None, skip=()) -> dict:
    """Replay ``calls`` (dicts with ``step``, ``key``, ``shapes``, ``grad``, in the order the
    buckets came) through ``make_reducer(main_spec)`` and ``make_reducer(side_spec)``: each
    bucket cut into the taken parameters' gradients and the others, each piece sent by its own
    reducer under the key of its own parameters, the main reducer flushed once at the end of each
    step, and the two results laid back in the bucket's order. Steps in ``skip`` are not run (a
    twin that never saw them). Returns ``{(step, index in calls): result}``."""
    taken = set(taken)
    queue = CollectiveQueue()  # one launch order for both, as the hook's reducers share
    main = make_reducer(main_spec, queue=queue, **(main_kwargs or {}))
    side = make_reducer(side_spec, queue=queue)
    results = {}
    for step in sorted({c["step"] for c in calls}):
        if step in skip:
            continue
        pending = []
        for index, call in enumerate(calls):
            if call["step"] != step:
                continue
            params, numels = call["key"][1], call["key"][2]
            starts = [sum(numels[:i]) for i in range(len(numels))]
            flat = call["grad"].reshape(-1)
            parts = []
            for reducer, chosen in (
                (side, [i for i, p in enumerate(params) if p in taken]),
                (main, [i for i, p in enumerate(params) if p not in taken]),
            ):
                if not chosen:
                    continue
                piece = torch.cat([flat[starts[i] : starts[i] + numels[i]] for i in chosen])
                key = bucket_key([params[i] for i in chosen], [numels[i] for i in chosen])
                shapes = [torch.Size(call["shapes"][i]) for i in chosen]
                parts.append((chosen, reducer.reduce(key, piece, step=step, shapes=shapes, flush=reducer is side)))
            pending.append((index, call, starts, parts))
        main.flush()
        for index, call, starts, parts in pending:
            out = torch.full_like(call["grad"].reshape(-1), 12345.0)  # every element is overwritten
            for chosen, fut in parts:
                value, at = fut.wait().reshape(-1), 0
                for i in chosen:
                    n = call["key"][2][i]
                    out[starts[i] : starts[i] + n] = value[at : at + n]
                    at += n
            results[(step, index)] = out.view_as(call["grad"])
    return results


# -- the reducer alone: a bucket of tables only, held-back buckets, inf in the tables ---------

#: parameters 0..5: 0 small (held back under MIN_BYTES), 1 a table alone in its bucket, 2 a table
#: and 3, 4 others in one bucket, 5 a large matrix alone
SHAPES = {0: (6,), 1: (12, 4), 2: (5, 4), 3: (20, 8), 4: (3,), 5: (16, 10)}
TAKEN = (1, 2)


def _bucket(params, rank: int, step: int, dtype=torch.float32) -> dict:
    numels = [math.prod(SHAPES[p]) for p in params]
    return {
        "step": step, "key": bucket_key(params, numels), "shapes": [SHAPES[p] for p in params],
        "grad": _grad(rank, step, sum(numels), dtype),
    }


def _layout(tables_flush: bool) -> list[tuple[tuple[int, ...], bool]]:
    """The buckets of one step and the flush each is handed: a small bucket held back, then the
    bucket of tables only, last (``tables_flush``) or followed by a mixed bucket and a large one."""
    if tables_flush:
        return [((0,), False), ((5,), False), ((1,), True)]
    return [((0,), False), ((1,), False), ((4, 2, 3), False), ((5,), True)]


def _split_state(spec: str, **kwargs) -> gradzip.CompressionState:
    state = gradzip.CompressionState(spec, **kwargs)
    state.reducer.take(TAKEN)
    return state


def _tables_only_worker(rank: int, world_size: int, side: str, tables_flush: bool, steps: int) -> dict:
    state = _split_state(_spec(TOPK, side), min_compress_bytes=MIN_BYTES)
    calls, outs = [], []
    for step in range(steps):
        futures = []
        for params, flush in _layout(tables_flush):
            call = _bucket(params, rank, step)
            futures.append(state.reducer.reduce(call["key"], call["grad"], step=step, shapes=call["shapes"], flush=flush))
            calls.append(call)
        # nothing flushes after the step's last call: a held-back bucket it did not send never
        # completes, and this wait hangs the ranks (a TimeoutError from run_ranks)
        outs.extend(fut.wait().clone() for fut in futures)
    reference = _apart(calls, TOPK, side, TAKEN, main_kwargs={"min_compress_bytes": MIN_BYTES})
    return {"outs": outs, "reference": [reference[(c["step"], i)] for i, c in enumerate(calls)]}


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_bucket_of_tables_only_sends_what_the_main_codec_held_back(world_size):
    """A bucket of tables only, last in its step (flush=True) or not (flush=False), after a bucket
    topk held back under min_compress_bytes: every bucket completes, equal to the reducers apart."""
    jobs = [(side, tables_flush) for side in ("int8", "none") for tables_flush in (True, False)]
    reports = run_ranks(_tables_only_many, world_size, jobs, timeout_s=TIMEOUT_S)
    for job in jobs:
        for rank, report in enumerate(reports):
            got = report[job]
            assert len(got["outs"]) == len(got["reference"])
            for i, (out, want) in enumerate(zip(got["outs"], got["reference"])):
                assert torch.equal(out, want), (job, rank, i)
                assert torch.equal(out, reports[0][job]["outs"][i]), (job, rank, i)  # the same on every rank


def _tables_only_many(rank: int, world_size: int, jobs: list) -> dict:
    return {job: _tables_only_worker(rank, world_size, *job, steps=3) for job in jobs}


#: the step at which the last rank's tables hold an inf
BAD = 2
STEPS = 5


def _inf_worker(rank: int, world_size: int, where: tuple[int, ...]) -> dict:
    """Steps of three buckets (tables only, mixed, others only) under topk with error feedback
    beside int8 with error feedback; at BAD the last rank's bucket ``where`` holds an inf in a
    table's part."""
    layout = [((1,), False), ((4, 2, 3), False), ((5, 0), True)]
    state = _split_state(_spec(TOPK, "int8"))
    calls, outs = [], []
    for step in range(STEPS):
        futures = []
        for params, flush in layout:
            call = _bucket(params, rank, step)
            if step == BAD and rank == world_size - 1 and params == where:
                table = next(i for i, p in enumerate(params) if p in TAKEN)
                call["grad"] = call["grad"].clone()
                call["grad"][sum(math.prod(SHAPES[p]) for p in params[:table]) + 3] = float("inf")
            futures.append(state.reducer.reduce(call["key"], call["grad"], step=step, shapes=call["shapes"], flush=flush))
            calls.append(call)
        outs.extend(fut.wait().clone() for fut in futures)
    clean = [c if c["step"] != BAD else _bucket(c["key"][1], rank, BAD) for c in calls]
    return {
        "calls": [(c["step"], c["key"]) for c in calls], "outs": outs,
        # what the finite buckets of the bad step must be (the reducers' state before it)
        "reference": _apart(clean, TOPK, "int8", TAKEN),
        # what every later step must be: the bad step left nothing behind
        "twin": _apart(clean, TOPK, "int8", TAKEN, skip=(BAD,)),
    }


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("where", [(1,), (4, 2, 3)], ids=["tables-only", "mixed"])
def test_inf_in_the_tables_makes_the_bucket_nan_everywhere_and_leaves_no_trace(world_size, where):
    for rank, report in enumerate(run_ranks(_inf_worker, world_size, where, timeout_s=TIMEOUT_S)):
        for i, ((step, key), out) in enumerate(zip(report["calls"], report["outs"])):
            if step == BAD and key[1] == where:
                assert torch.isnan(out).all(), (rank, i)
            elif step == BAD:  # a finite bucket of the bad step: the mean as if nothing were wrong
                assert torch.equal(out, report["reference"][(step, i)]), (rank, i)
                assert torch.isfinite(out).all()
            else:  # before the bad step as the twin, after it as the twin that never saw it
                assert torch.equal(out, report["twin"][(step, i)]), (rank, i, step)
        # the premise: keeping the bad step's residual updates would have shown
        later = [k for k in report["twin"] if k[0] > BAD]
        assert any(not torch.equal(report["twin"][k], report["reference"][k]) for k in later)


# -- DDP: a model with tables (several buckets, a rebuild after the first pass) ---------------


class _Net(nn.Module):
    """Two tables and two layers, registered in another order than the forward pass uses them
    (so DDP's rebuilt layout differs from its first), optionally with a table of zero rows and a
    parameter of no elements, in ``dtype``."""

    def __init__(self, *, tables: bool = True, empty: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.head = nn.Linear(16, 10)
            if tables:
                self.wpe = nn.Embedding(8, 16)
            self.mid = nn.Linear(16, 16)
            self.wte = nn.Embedding(30, 16) if tables else nn.Linear(30, 16)
            if empty:
                self.nothing = nn.Parameter(torch.zeros(0))
                self.no_rows = nn.Embedding(0, 16)
        self.tables, self.empty = tables, empty
        self.to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tables:
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        else:
            x = self.wte(nn.functional.one_hot(ids, 30).to(self.mid.weight.dtype))
        out = self.head(torch.tanh(self.mid(x)))
        if self.empty:
            out = out + self.nothing.sum() + self.no_rows.weight.sum()
        return out


class _Holder:
    """The hook's state behind one more reference, so that a run can put a fresh state in place
    (a resume) under the same DDP; every bucket's input and result are logged."""

    def __init__(self, state: gradzip.CompressionState) -> None:
        self.state = state
        self.log: list[dict] = []


def _logging_hook(holder: _Holder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state = holder.state
    shapes = [tuple(g.shape) for g in bucket.gradients()]
    call = {
        "step": state.step, "key": bucket_key(state.numbering.of(bucket.parameters()), [math.prod(s) for s in shapes]),
        "shapes": shapes, "grad": bucket.buffer().clone(), "last": bucket.is_last(),
    }
    holder.log.append(call)

    def keep(fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()
        call["out"] = value.clone()
        return value

    return gradzip.compression_hook(state, bucket).then(keep)


def _ids(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 30, (3, 8), generator=torch.Generator().manual_seed(100 * rank + step))


def _train(
    rank: int, world_size: int, spec: str, steps: int, *, model: dict | None = None, state: dict | None = None,
    resume_at: int | None = None, load: bool = True, fresh_ddp: bool = False, bad: int | None = None, skip=(),
    bucket_cap_mb: float = 0.0015,
) -> dict:
    """``steps`` SGD steps under DDP with the hook. At ``resume_at`` the state is saved and a fresh
    one, loaded from it (or not: ``load=False``), takes over under the same DDP, or with
    ``fresh_ddp`` under a fresh DDP of a copy of the model, as a restarted process has. At ``bad``
    the last rank's token table gradient holds an inf and the optimizer step is skipped; steps in
    ``skip`` are not run at all. Returns the bucket log, gradients per step, final parameters,
    metrics per step, the numbers the state took and those of the model's tables by name."""
    model_kw, state_kw = model or {}, state or {}
    net = _Net(**model_kw)
    ddp = DDP(net, bucket_cap_mb=bucket_cap_mb)
    holder = _Holder(gradzip.CompressionState(spec, **state_kw).bind(net))
    ddp.register_comm_hook(holder, _logging_hook)
    poison = {"on": False}
    if model_kw.get("tables", True):
        net.wte.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if poison["on"] else g)
    metrics, grads = [], []
    for step in range(steps):
        if step in skip:
            continue
        if step == resume_at:
            saved = holder.state.state_dict()
            if fresh_ddp:
                copy = _Net(**model_kw)
                copy.load_state_dict(net.state_dict())
                net, ddp = copy, DDP(copy, bucket_cap_mb=bucket_cap_mb)
                ddp.register_comm_hook(holder, _logging_hook)
            holder.state = gradzip.CompressionState(spec, **state_kw)
            if load:
                holder.state.load_state_dict(saved)
            holder.state.bind(net)
        poison["on"] = step == bad and rank == world_size - 1
        net.zero_grad(set_to_none=True)
        ddp(_ids(rank, step)).float().logsumexp(-1).mean().backward()
        metrics.append(holder.state.metrics.pop())
        grads.append([p.grad.clone() for p in net.parameters()])
        if all(torch.isfinite(p.grad).all() for p in net.parameters()):
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.5 * p.grad
    taken = getattr(holder.state.reducer, "taken", None)
    return {
        "log": holder.log, "params": [p.detach().clone() for p in net.parameters()], "metrics": metrics, "grads": grads,
        "taken": None if taken is None else sorted(taken),
        "tables": [n for n, (name, _) in enumerate(net.named_parameters()) if name.endswith("wte.weight")
                   or name.endswith("wpe.weight") or name.endswith("no_rows.weight")],
    }


def _with_apart(report: dict, main: str, side: str, *, main_kwargs=None) -> dict:
    """``report`` with ``reference``: :func:`_apart` on its logged buckets (run in the ranks)."""
    log = report["log"]
    reference = _apart(log, main, side, report["taken"], main_kwargs=main_kwargs)
    report["reference"] = [reference[(call["step"], i)] for i, call in enumerate(log)]
    return report


def _check_against_apart(report: dict) -> None:
    assert len(report["log"]) == len(report["reference"])
    for call, want in zip(report["log"], report["reference"]):
        assert torch.equal(call["out"], want), (call["step"], call["key"])


def _layouts(log: list[dict]) -> dict[int, list]:
    out: dict[int, list] = {}
    for call in log:
        out.setdefault(call["step"], []).append(call["key"][1])
    return out


def _ddp_tables_worker(rank: int, world_size: int) -> dict:
    """DDP steps where the last bucket holds the token table alone and the small buckets before
    it are held back by the main codec; once plain, once with the exactness check every step,
    whose dense means are then formed apart."""
    reports = {
        verify: _with_apart(
            _train(rank, world_size, _spec(TOPK, "int8"), 3, bucket_cap_mb=0.0005,
                   state={"min_compress_bytes": 700, "verify_every": verify}),
            TOPK, "int8", main_kwargs={"min_compress_bytes": 700},
        )
        for verify in (0, 1)
    }
    for call in reports[1]["log"]:
        call["dense"] = call["grad"].div(world_size)
        dist.all_reduce(call["dense"])
    return reports


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_tables_last_with_held_buckets_and_the_exactness_check(world_size):
    """DDP's last bucket holds the tables alone after the rebuild, a bucket before it is held back;
    with verify_every=1 the results are the same and the figures are those of a dense all_reduce."""
    reports = run_ranks(_ddp_tables_worker, world_size, timeout_s=TIMEOUT_S)
    for rank, by_verify in enumerate(reports):
        plain, verified = by_verify[0], by_verify[1]
        assert plain["taken"] == plain["tables"]
        # the premise: after DDP's rebuild, a last bucket of tables only and a bucket held back
        last = [c for c in plain["log"] if c["last"] and c["step"] > 0]
        assert last and all(set(c["key"][1]) <= set(plain["taken"]) for c in last), [c["key"] for c in last]
        assert all(m["fused_buckets"] > 0 for m in plain["metrics"][1:]), plain["metrics"]
        for report in (plain, verified):
            _check_against_apart(report)
        # the check changes nothing, and records the compressed mean against the dense one
        for a, b in zip(plain["log"], verified["log"], strict=True):
            assert a["key"] == b["key"] and torch.equal(a["out"], b["out"])
        for step, metrics in enumerate(verified["metrics"]):
            for call in (c for c in verified["log"] if c["step"] == step):
                want = {**relative_difference(call["out"], call["dense"]), "dense_bytes": call["grad"].nbytes}
                assert metrics["buckets"][call["key"]]["verify"] == want, (rank, step, call["key"])
            assert not any("verify" in b for b in plain["metrics"][step]["buckets"].values())


def _same_runs(a: dict, b: dict, *, from_step: int = 0) -> None:
    """Two runs' buckets (same layout) and gradients from ``from_step`` on, and their final
    parameters, bit for bit."""
    calls_a = [c for c in a["log"] if c["step"] >= from_step]
    calls_b = [c for c in b["log"] if c["step"] >= from_step]
    assert [c["key"] for c in calls_a] == [c["key"] for c in calls_b]
    for x, y in zip(calls_a, calls_b, strict=True):
        assert torch.equal(x["out"], y["out"]), x["key"]
    for step, (ga, gb) in enumerate(zip(a["grads"][from_step:], b["grads"][from_step:], strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True)), from_step + step
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))


def _no_tables_worker(rank: int, world_size: int) -> dict:
    """A model without nn.Embedding under each codec, with embeddings= and without."""
    runs = {}
    for main, state in ((TOPK, {"min_compress_bytes": 700}), ("separate", {}), ("powersgd:approx_rank=2", {})):
        for spec in (main, _spec(main, "int8")):
            runs[spec] = _train(rank, world_size, spec, 3, model={"tables": False}, state=state, bucket_cap_mb=0.0005)
    return runs


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_model_without_tables_is_the_plain_codec_bit_for_bit(world_size):
    """bind takes nothing: every bucket, gradient, parameter and byte count as the plain codec's."""
    for rank, runs in enumerate(run_ranks(_no_tables_worker, world_size, timeout_s=TIMEOUT_S)):
        for main in (TOPK, "separate", "powersgd:approx_rank=2"):
            plain, split = runs[main], runs[_spec(main, "int8")]
            assert split["taken"] == [] and plain["taken"] is None, (main, rank)
            _same_runs(plain, split)
            assert [m["payload_bytes"] for m in plain["metrics"]] == [m["payload_bytes"] for m in split["metrics"]]
            assert [m["fused_buckets"] for m in plain["metrics"]] == [m["fused_buckets"] for m in split["metrics"]]


def _empty_worker(rank: int, world_size: int, jobs: list) -> dict:
    return {
        (main, side): _with_apart(
            _train(rank, world_size, _spec(main, side), 3, model={"empty": True}, state=state, bucket_cap_mb=0.0005),
            main, side, main_kwargs=state,
        )
        for main, side, state in jobs
    }


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_table_of_zero_rows_and_a_parameter_of_no_elements(world_size):
    """An nn.Embedding(0, 16) and a parameter of no elements in the buckets, against the reducers apart."""
    jobs = [(TOPK, "int8", {"min_compress_bytes": 700}), ("separate", "none", {})]
    reports = run_ranks(_empty_worker, world_size, jobs, timeout_s=TIMEOUT_S)
    for by_job in reports:
        for report in by_job.values():
            assert report["taken"] == report["tables"]
            # the premise: a bucket whose tables' part is all zero rows, and one whose main part
            # holds a parameter of no elements
            empty = {p for c in report["log"] for p, n in zip(c["key"][1], c["key"][2]) if n == 0}
            assert empty & set(report["taken"]) and empty - set(report["taken"]), empty
            assert any(
                {p for p, n in zip(c["key"][1], c["key"][2]) if p in report["taken"]} <= empty
                and any(p not in report["taken"] for p in c["key"][1])
                for c in report["log"]
            )
            _check_against_apart(report)
            assert all(torch.isfinite(p).all() for p in report["params"])


def _low_precision_worker(rank: int, world_size: int, jobs: list) -> dict:
    out = {}
    for dtype, main, side in jobs:
        report = _train(rank, world_size, _spec(main, side), 3, model={"dtype": dtype}, bucket_cap_mb=0.0005)
        out[(dtype, main, side)] = _with_apart(report, main, side)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_and_fp16_buckets(world_size):
    """A model in bfloat16 or float16: DDP's buckets in that dtype, against the reducers apart."""
    jobs = [
        (torch.bfloat16, TOPK, "int8"), (torch.bfloat16, "separate", "fp16"),
        (torch.float16, "powersgd:approx_rank=2", "bf16"), (torch.float16, TOPK, "none"),
    ]
    reports = run_ranks(_low_precision_worker, world_size, jobs, timeout_s=TIMEOUT_S)
    for rank, by_job in enumerate(reports):
        for job, report in by_job.items():
            assert all(c["grad"].dtype == job[0] and c["out"].dtype == job[0] for c in report["log"]), job
            assert any(set(c["key"][1]) & set(report["taken"]) for c in report["log"])
            _check_against_apart(report)
            for call, other in zip(report["log"], reports[0][job]["log"], strict=True):
                assert torch.equal(call["out"], other["out"]), (job, rank)  # the same on every rank


RESUME_AT = 3


def _resume_worker(rank: int, world_size: int, spec: str, state: dict, fresh_ddp: bool) -> dict:
    kw = {"state": state, "bucket_cap_mb": 0.0005}
    return {
        "continued": _train(rank, world_size, spec, 5, **kw),
        "resumed": _train(rank, world_size, spec, 5, resume_at=RESUME_AT, fresh_ddp=fresh_ddp, **kw),
        "unloaded": _train(rank, world_size, spec, 5, resume_at=RESUME_AT, load=False, fresh_ddp=fresh_ddp, **kw),
    }


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_resume_in_a_fresh_state_after_the_rebuild_is_bit_exact(world_size):
    """A fresh state loaded mid-run under the same DDP (its rebuilt layout) continues bit for bit."""
    spec = _spec(TOPK, "int8")
    reports = run_ranks(_resume_worker, world_size, spec, {"min_compress_bytes": 700}, False, timeout_s=TIMEOUT_S)
    for runs in reports:
        layouts = _layouts(runs["continued"]["log"])
        assert layouts[0] != layouts[1] and layouts[1] == layouts[RESUME_AT], layouts  # DDP re-bucketed
        _same_runs(runs["continued"], runs["resumed"], from_step=0)
        # the premise: both reducers' residuals carried something (mid.weight by topk, wte by int8)
        continued, unloaded = runs["continued"]["grads"][RESUME_AT], runs["unloaded"]["grads"][RESUME_AT]
        for name in ("mid.weight", "wte.weight"):
            at = [n for n, _ in _Net().named_parameters()].index(name)
            assert not torch.equal(continued[at], unloaded[at]), name


def _grads_equal(a: dict, b: dict, from_step: int) -> bool:
    return all(
        torch.equal(x, y) for ga, gb in zip(a["grads"][from_step:], b["grads"][from_step:], strict=True)
        for x, y in zip(ga, gb, strict=True)
    )


@pytest.mark.dist
def test_resume_in_a_fresh_process_follows_the_parameters_into_the_first_layout():
    """A restarted process starts from DDP's first layout: every piece's residual must follow its
    parameters there. Elementwise codecs with error feedback at two ranks (a + b sums alike in any
    layout), so the resumed run must match the continued one bit for bit."""
    state = {"error_feedback": True, "collective": "allreduce"}
    spec = "fp16:embeddings=bf16"
    for rank, runs in enumerate(run_ranks(_resume_worker, 2, spec, state, True, timeout_s=TIMEOUT_S)):
        continued, resumed = runs["continued"], runs["resumed"]
        # the premise: the resumed run's first step has another layout than the continued one's
        assert _layouts(resumed["log"])[RESUME_AT] == _layouts(continued["log"])[0] != _layouts(continued["log"])[RESUME_AT]
        assert _grads_equal(continued, resumed, 0), rank
        assert all(torch.equal(x, y) for x, y in zip(continued["params"], resumed["params"], strict=True))
        assert not _grads_equal(continued, runs["unloaded"], RESUME_AT)  # the residuals mattered


def _inf_ddp_worker(rank: int, world_size: int, caps: tuple) -> dict:
    spec = _spec(TOPK, "int8")
    return {
        cap: {
            "bad": _train(rank, world_size, spec, STEPS, bad=BAD, bucket_cap_mb=cap),
            "twin": _train(rank, world_size, spec, STEPS, skip=(BAD,), bucket_cap_mb=cap),
            "kept": _train(rank, world_size, spec, STEPS, bucket_cap_mb=cap),
        }
        for cap in caps
    }


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_inf_in_a_table_on_one_rank(world_size):
    """The last rank's token table holds an inf at BAD (its bucket: the tables alone, or
    everything): every rank gets that bucket all NaN, the other buckets finite, and from the next
    step on the run equals a twin that never ran BAD."""
    caps = (0.0005, 0.003)
    reports = run_ranks(_inf_ddp_worker, world_size, caps, timeout_s=TIMEOUT_S)
    wte = [n for n, _ in _Net().named_parameters()].index("wte.weight")
    for rank, by_cap in enumerate(reports):
        for cap, runs in by_cap.items():
            bad, twin = runs["bad"], runs["twin"]
            at_bad = [c for c in bad["log"] if c["step"] == BAD]
            for call in at_bad:
                if wte in call["key"][1]:
                    assert torch.isnan(call["out"]).all(), (cap, rank)
                else:
                    assert torch.isfinite(call["out"]).all(), (cap, rank, call["key"])
            assert len(at_bad) > 1 or cap == 0.003, [c["key"] for c in at_bad]
            after = [c for c in bad["log"] if c["step"] > BAD]
            # the twin's step numbers run one behind after the step it skipped
            twin_after = [c for c in twin["log"] if c["step"] >= BAD]
            assert [c["key"] for c in after] == [c["key"] for c in twin_after]
            for x, y in zip(after, twin_after, strict=True):
                assert torch.equal(x["out"], y["out"]), (cap, rank, x["step"], x["key"])
            assert all(torch.equal(x, y) for x, y in zip(bad["params"], twin["params"], strict=True))
            # the premise: the step's residual updates, had they been kept, would show
            assert not _grads_equal(runs["kept"], twin, BAD + 1)


# -- specs ------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "spec",
    [
        "separate:embeddings=",
        "separate:embeddings",
        "topk:ratio=0.01+fp16:embeddings=int8",
        "topk:ratio=0.01,embeddings=int8+fp16",
        "separate:embeddings=none+int8",
        "auto:embeddings=int8",
        "AUTO:embeddings=INT8",
        "kimad:embeddings=int8",
        "separate:embeddings=int4",
        "separate:embeddings=topk",
        "separate:embeddings=int8:fp16",
        "separate:embeddings=int8,embeddings=fp16",
        "dgc:ratio=0.01,warmup_steps=5,embeddings=int8",
        "torch:fp16:embeddings=int8",
    ],
)
def test_bad_embeddings_specs_are_refused_naming_the_option(spec):
    """A ValueError (SpecError) naming embeddings, and no message that denies a codec the option."""
    for make in (parse_compressor, gradzip.CompressionState):
        with pytest.raises(ValueError, match="embeddings") as exc:
            make(spec)
        message = str(exc.value)
        # no message may deny a codec the option it takes alone
        for name in ("topk", "separate", "fp16"):
            if _spec(name, "int8") != spec:
                gradzip.CompressionState(_spec(name, "int8"))
                assert f"{name} has no parameter 'embeddings'" not in message, message
        if spec.lower().startswith("auto"):  # not "unknown compressor 'auto'" beside a list that holds it
            assert "unknown compressor" not in message, message


@pytest.mark.unit
def test_the_tables_codec_is_read_as_codec_names_are_in_any_case():
    """Codec names and parameter names are case-insensitive (``TOPK:RATIO=0.1``), and so is
    the tables' codec: ``INT8`` is ``int8``, and a checkpoint of one loads into the other."""
    assert parse_compressor("TOPK:RATIO=0.1").spec == parse_compressor("topk:ratio=0.1").spec
    upper, lower = parse_compressor("separate:embeddings=INT8"), parse_compressor("separate:embeddings=int8")
    assert upper.embeddings == lower.embeddings and upper.spec == lower.spec
    state = gradzip.CompressionState("Separate:Embeddings=Int8")
    gradzip.CompressionState("separate:embeddings=int8").load_state_dict(state.state_dict())
    with pytest.raises(ValueError, match="checkpoint holds compressor state"):
        gradzip.CompressionState("separate:embeddings=fp16").load_state_dict(state.state_dict())
