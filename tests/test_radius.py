"""Radius (Zheng & Zhang, MLSys 2025): the range selection against a brute force, the payload
formulas, and the reducer on 2-4 gloo ranks (one spawn per world size): bit-identical ranks,
bytes on dense, refresh and in-between steps, the aggregatable property and the residual
identity in float64, exact resume between refreshes, non-finite input and the DDP hook."""

import itertools

import pytest
import torch
from helpers.aggregatable_runs import _check_nonfinite_report, bucket_grad, ddp_steps
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.choice import CodecChoice, parse_compressor
from gradzip.comm import make_reducer
from gradzip.compressors import build
from gradzip.compressors.radius import Radius, covered_index, kept_elements, kept_ranges, select_ranges
from gradzip.testing import run_ranks

RANGE, PERIOD, START = 4, 3, 1
SPEC = f"radius:ratio=0.25,range_size={RANGE},period={PERIOD},start_step={START}"
NUMEL = 9 * RANGE + 3  # nine whole ranges and a tail of three
STEPS, RESUME_AT = 7, 3  # step 0 dense; refreshes at 1 and 4; resumed at 3, between refreshes
REFRESHES = (1, 4)


@pytest.mark.unit
@pytest.mark.parametrize(
    "params", [{"ratio": 0}, {"ratio": 1.5}, {"range_size": 0}, {"period": 0}, {"period": 2.5}, {"start_step": -1}]
)
def test_bad_parameters_raise_value_error_naming_them(params):
    with pytest.raises(ValueError, match=next(iter(params))):
        Radius(**params)


@pytest.mark.unit
def test_spec_parses_and_payload_formulas():
    choice = parse_compressor("radius:ratio=0.1,range_size=8,period=50")
    assert isinstance(choice, CodecChoice) and choice.codec.name == "radius" and choice.codec.multi_round
    codec = build("radius:ratio=0.25,range_size=4")
    # nine whole ranges, round(0.25 * 9) = 2 kept (8 values), and the tail of 3
    assert codec.payload_nbytes(39) == (2 * 4 + 3) * 4
    assert codec.payload_nbytes(39, torch.bfloat16) == (2 * 4 + 3) * 2
    assert codec.refresh_payload_nbytes(39) == 39 * 4
    assert codec.payload_nbytes(3) == 3 * 4  # no whole range: the tensor travels whole
    assert build("radius").payload_nbytes(1 << 20) == round(0.6 * (1 << 14)) * 64 * 4


def _brute_force_starts(values: list[int], ratio: float, range_size: int) -> list[int]:
    """Of every set of ``m`` whole ranges, the one of largest total squared norm (exact integer
    arithmetic), the lowest starts among equals."""
    n = len(values) // range_size
    scores = [sum(v * v for v in values[i * range_size : (i + 1) * range_size]) for i in range(n)]
    m = min(max(round(ratio * n), 1), n) if n else 0
    best = max(itertools.combinations(range(n), m), key=lambda c: (sum(scores[i] for i in c), [-i for i in c]))
    return [i * range_size for i in best]


@pytest.mark.unit
@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    range_size=st.integers(1, 4),
    n_full=st.integers(0, 9),
    tail=st.integers(0, 3),
    ratio=st.floats(0.01, 1.0),
    data=st.data(),
)
def test_range_selection_properties_and_brute_force(range_size, n_full, tail, ratio, data):
    numel = n_full * range_size + min(tail, range_size - 1)
    if numel == 0:
        return
    # Small integers: scores are exact, ties are frequent and must go to the lower start.
    values = data.draw(st.lists(st.integers(-3, 3), min_size=numel, max_size=numel))
    mean = torch.tensor(values, dtype=torch.float32)
    starts = select_ranges(mean, ratio, range_size)
    assert starts.tolist() == _brute_force_starts(values, ratio, range_size)
    assert starts.numel() == kept_ranges(numel, ratio, range_size)
    index = covered_index(starts, numel, range_size)
    assert index.numel() == kept_elements(numel, ratio, range_size) <= numel
    assert torch.equal(index, index.unique()), "ranges overlap or are out of order"
    assert index.numel() == 0 or (int(index.min()) >= 0 and int(index.max()) < numel)
    assert all(int(s) % range_size == 0 and int(s) + range_size <= n_full * range_size for s in starts)
    assert set(range(n_full * range_size, numel)) <= set(index.tolist()), "the tail is always sent"


def _worker(rank: int, world_size: int) -> dict:
    """One spawn per world size: fp32 and fp64 runs of one bucket through the steps, a resume
    from the state before ``RESUME_AT``; at 3 ranks the non-finite contract, at 2 the DDP hook."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        reducer = make_reducer(SPEC)
        outs, nbytes, residuals, saved = [], [], [], None
        for step in range(STEPS):
            if step == RESUME_AT:
                saved = reducer.state_dict()
            grad = bucket_grad(rank, step, NUMEL).to(dtype)
            outs.append(reducer.reduce(0, grad, step=step).wait().clone())
            nbytes.append(reducer.metrics.pop()["payload_bytes"])
            residuals.append(reducer.state_dict()["feedback"]["residuals"].get(0))
        fresh = make_reducer(SPEC)
        fresh.load_state_dict(saved)
        resumed = [fresh.reduce(0, bucket_grad(rank, s, NUMEL).to(dtype), step=s).wait().clone() for s in range(RESUME_AT, STEPS)]
        out[dtype] = {"outs": outs, "bytes": nbytes, "residuals": residuals, "resumed": resumed, "ranges": saved["ranges"]}
    if world_size == 3:
        from test_nonfinite import _nonfinite_worker

        out["nonfinite"] = _nonfinite_worker(rank, world_size, [("radius:ratio=0.3,range_size=8,period=2", {})])
    if world_size == 2:
        out["ddp"] = ddp_steps(rank, world_size, "radius:ratio=0.3,range_size=8,period=2", steps=5)
    return out


def _check_run(results: list, world_size: int, dtype: torch.dtype) -> None:
    codec = build(SPEC)
    item = torch.empty((), dtype=dtype).element_size()
    runs = [r[dtype] for r in results]
    expected_bytes = [
        NUMEL * item if step < START or step in REFRESHES else codec.payload_nbytes(NUMEL, dtype) for step in range(STEPS)
    ]
    assert codec.payload_nbytes(NUMEL, dtype) == (2 * RANGE + 3) * item < NUMEL * item
    residuals = [torch.zeros(NUMEL, dtype=dtype) for _ in range(world_size)]
    starts = None
    for step in range(STEPS):
        applied = runs[0]["outs"][step]
        grads = [bucket_grad(rank, step, NUMEL).to(dtype) for rank in range(world_size)]
        for rank, run in enumerate(runs):
            assert run["bytes"][step] == expected_bytes[step], (rank, step)
            assert torch.equal(run["outs"][step], applied), f"rank {rank} differs at step {step}"
        if step < START:  # dense: the plain mean, residuals untouched (none yet)
            torch.testing.assert_close(applied, sum(grads) / world_size)
            assert all(run["residuals"][step] is None for run in runs)
            continue
        compensated = [g + e for g, e in zip(grads, residuals, strict=True)]
        true_mean = sum(c / world_size for c in compensated)
        if step in REFRESHES:
            # Everything is sent; the next ranges are the top ranges of the mean every rank got.
            torch.testing.assert_close(applied, true_mean.to(dtype), rtol=1e-6, atol=1e-6)
            assert all(run["residuals"][step] is None for run in runs), "a refresh left a residual"
            residuals = [torch.zeros(NUMEL, dtype=dtype) for _ in range(world_size)]
            norms = applied[: 9 * RANGE].double().view(9, RANGE).norm(dim=1)
            starts = (norms.topk(2).indices.sort().values * RANGE).tolist()
            continue
        sent = torch.zeros(NUMEL, dtype=torch.bool)
        for s in starts:
            sent[s : s + RANGE] = True
        sent[9 * RANGE :] = True
        # The aggregatable property: the summed payloads decode to the sum of the inputs there.
        assert torch.equal(applied[~sent], torch.zeros_like(applied[~sent]))
        tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-6}
        torch.testing.assert_close(applied[sent], true_mean[sent], **tol)
        # The residual identity: each residual is exactly the compensated gradient where it was
        # not sent, zero where it was; so applied + mean residual = mean compensated.
        for rank, run in enumerate(runs):
            want = torch.where(sent, torch.zeros_like(compensated[rank]), compensated[rank])
            assert torch.equal(run["residuals"][step].to(dtype), want), (rank, step)
        residuals = [run["residuals"][step].to(dtype) for run in runs]
        if dtype == torch.float64:
            torch.testing.assert_close(applied + sum(residuals) / world_size, true_mean, rtol=1e-12, atol=1e-12)
    for rank, run in enumerate(runs):
        assert run["ranges"][0]["chosen_at"] == 1 and run["ranges"][0]["starts"].tolist() == runs[0]["ranges"][0]["starts"].tolist()
        for got, want in zip(run["resumed"], run["outs"][RESUME_AT:], strict=True):
            assert torch.equal(got, want), f"rank {rank}: a run resumed between refreshes differs"


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_bit_identical_aggregatable_bytes_residuals_resume(world_size):
    results = run_ranks(_worker, world_size)
    for dtype in (torch.float32, torch.float64):
        _check_run(results, world_size, dtype)
    if world_size == 3:
        name = "radius:ratio=0.3,range_size=8,period=2/{}"
        _check_nonfinite_report([r["nonfinite"] for r in results], name)
    if world_size == 2:
        params = [r["ddp"] for r in results]
        assert torch.isfinite(params[0]).all()
        assert torch.equal(params[0], params[1])



@pytest.mark.unit
def test_auto_refuses_radius_by_name():
    """auto cannot probe a codec with rounds of its own; FSDP takes it (tests/test_fsdp_summed.py)."""
    from gradzip.control.auto import AutoConfig, make_controller
    from gradzip.control.auto_reducer import AutoReducer

    specs = AutoConfig(candidates=("radius", "topk:ratio=0.1")).candidate_specs()
    with pytest.raises(ValueError, match="radius"):
        AutoReducer(specs, make_controller(AutoConfig(candidates=("radius", "topk:ratio=0.1")), specs))
