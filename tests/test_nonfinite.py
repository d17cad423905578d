"""Non-finite gradients and extreme finite values through every registered codec.

Contract (``gradzip.comm.nonfinite``): finite input never becomes inf or NaN; inf or NaN on any rank
makes the bucket all NaN on every rank, and the step leaves residuals, warm-start factors and
codec state exactly as they were.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_run import same

import gradzip
from gradzip.comm import make_reducer
from gradzip.comm.reference import simulate_ranks
from gradzip.compressors import build
from gradzip.feedback import ErrorFeedback
from gradzip.testing import run_ranks

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def extreme_inputs(dtype: torch.dtype, numel: int = 96) -> dict[str, torch.Tensor]:
    """Finite inputs that break careless codecs: zeros, subnormals, the dtype's extremes, an outlier."""
    info = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(7)
    small = (torch.randn(numel, generator=gen, dtype=torch.float64) * 1e-3).to(dtype)
    alternating = torch.tensor([info.max, -info.max] * (numel // 2), dtype=dtype)
    outlier = small.clone()
    outlier[numel // 3] = info.max
    return {
        "zeros": torch.zeros(numel, dtype=dtype),
        "subnormal": torch.full((numel,), info.smallest_normal / 4, dtype=dtype),
        "max": torch.full((numel,), info.max, dtype=dtype),
        "alternating_max": alternating,
        "outlier": outlier,
    }


def single_round_codecs() -> list[str]:
    return [name for name in gradzip.list_compressors() if not build(name).multi_round]


@pytest.mark.parametrize("name", single_round_codecs())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finite_input_gives_finite_output(name, dtype):
    codec = build(name)
    for case, x in extreme_inputs(dtype).items():
        decoded = codec.decompress(codec.compress(x, step=0, key=0), like=x)
        assert torch.isfinite(decoded).all(), f"{name} {case}: decode holds inf or NaN"
        for world_size in (2, 3):
            # Every rank holds the same extreme tensor: the mean must stay finite too.
            mean = simulate_ranks(codec, [x] * world_size)
            assert torch.isfinite(mean).all(), f"{name} {case} over {world_size} ranks: inf or NaN"
            assert mean.dtype == dtype and mean.shape == x.shape


def test_zero_input_decodes_to_exact_zeros():
    for name in single_round_codecs():
        codec = build(name)
        x = torch.zeros(64)
        assert torch.equal(codec.decompress(codec.compress(x), like=x), x), name


def test_deferred_feedback_commits_or_discards():
    fb = ErrorFeedback(deferred=True)
    grad = torch.tensor([1.0, 2.0])
    fb.update("k", fb.compensate("k", grad, step=0), torch.tensor([1.0, 0.0]), step=0)
    fb.update("new", grad, grad, step=0)
    fb.discard()
    assert fb.residuals == {}, "a discarded first step left residuals"
    fb.update("k", fb.compensate("k", grad, step=0), torch.tensor([1.0, 0.0]), step=0)
    fb.commit()
    assert torch.equal(fb.residuals["k"], torch.tensor([0.0, 2.0]))
    compensated = fb.compensate("k", grad, step=1)
    fb.update("k", compensated, torch.zeros(2), step=1)
    assert torch.equal(fb.residuals["k"], torch.tensor([1.0, 4.0]))  # visible at once
    fb.discard()
    assert torch.equal(fb.residuals["k"], torch.tensor([0.0, 2.0])), "a discarded step changed the residual"


# --- real gloo ranks --------------------------------------------------------------------------

SHAPES = [torch.Size([12, 10]), torch.Size([10]), torch.Size([6, 8])]  # a bucket of three gradients
NUMEL = sum(s.numel() for s in SHAPES)


def reducer_specs() -> list[tuple[str, dict]]:
    """(codec spec, reducer options) for every registered codec on every route it allows, and
    the fused route of small buckets."""
    out = []
    for name in gradzip.list_compressors():
        codec = build(name)
        if codec.multi_round:
            out.append((name, {}))
            continue
        for collective in ("allgather", "twophase") + (("allreduce",) if codec.aggregatable else ()):
            out.append((name, {"collective": collective}))
    out.append(("topk:ratio=0.1", {"min_compress_bytes": 1 << 30}))
    # --compressor auto, bucket 0 forced to Top-K and bucket 1 to PowerSGD: a bad bucket 0 must
    # put back bucket 1's PowerSGD state too.
    out.append(("auto", {"candidates": ("topk:ratio=0.1", "powersgd:approx_rank=1"), "force": ("topk:ratio=0.1", "powersgd:approx_rank=1")}))
    return out


def _make(spec: str, options: dict):
    if spec != "auto":
        return make_reducer(spec, **options)
    from gradzip.control.auto import AutoConfig, make_controller
    from gradzip.control.auto_reducer import AutoReducer

    cfg = AutoConfig(adapt_every=1000, candidates=options["candidates"])
    specs = cfg.candidate_specs()
    reducer = AutoReducer(specs, make_controller(cfg, specs))
    reducer.force(0, dict(enumerate(options["force"])))
    return reducer


def _gathered_left_out(state: dict) -> dict:
    """An auto state without the buckets its window has seen: a skipped step was still hooked, and
    the window's list of its buckets (which a resumed decision needs) follows the hook, not the
    gradient."""
    if "window_figures" not in state:
        return state
    figures = {k: v for k, v in state["window_figures"].items() if k not in ("seen", "order")}
    return {**state, "window_figures": figures}


def _grad(rank: int, step: int, key: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + key)
    return torch.randn(NUMEL, generator=gen)


def _reduce(reducer, step: int, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    futures = {key: reducer.reduce(key, g, step=step, shapes=SHAPES) for key, g in grads.items()}
    return {key: fut.wait().clone() for key, fut in futures.items()}


def _nonfinite_worker(rank: int, world_size: int, specs: list[tuple[str, dict]]) -> dict:
    report = {}
    for spec, kwargs in specs:
        reducer = _make(spec, kwargs)
        twin = _make(spec, kwargs)  # never sees the bad steps
        steps = {s: {key: _grad(rank, s, key) for key in (0, 1)} for s in range(4)}
        for r in (reducer, twin):
            _reduce(r, 0, steps[0])
        before = reducer.state_dict()

        bad = {key: g.clone() for key, g in steps[1].items()}
        if rank == 1:
            bad[0][5] = float("inf")
        out1 = _reduce(reducer, 1, bad)
        worse = {key: g.clone() for key, g in steps[2].items()}
        if rank == 0:
            worse[1][NUMEL - 1] = float("nan")
        out2 = _reduce(reducer, 2, worse)
        after = reducer.state_dict()

        out3 = _reduce(reducer, 3, steps[3])
        ref3 = _reduce(twin, 3, steps[3])

        extremes = {}
        big = torch.finfo(torch.float32).max
        for case, x in {
            "max": torch.full((NUMEL,), big),
            "alternating": torch.tensor([big, -big] * (NUMEL // 2)),
            "subnormal": torch.full((NUMEL,), 1e-40),
            "zeros": torch.zeros(NUMEL),
        }.items():
            fresh = _make(spec, kwargs)
            extremes[case] = _reduce(fresh, 0, {0: x})[0]
        report[f"{spec}/{kwargs}"] = {
            "bad_bucket_all_nan": bool(torch.isnan(out1[0]).all()) and bool(torch.isnan(out2[1]).all()),
            "state_unchanged": same(_gathered_left_out(before), _gathered_left_out(after)),
            "next_step_equal_to_twin": all(torch.equal(out3[k], ref3[k]) for k in out3),
            "state_equal_to_twin": same(reducer.state_dict(), twin.state_dict()),
            "out3": out3,
            "extremes_finite": {case: bool(torch.isfinite(t).all()) for case, t in extremes.items()},
            "extremes": extremes,
        }
    return report


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [3])
def test_reducers_agree_on_nonfinite_and_keep_state(world_size):
    specs = reducer_specs()
    check_contract(run_ranks(_nonfinite_worker, world_size, specs, timeout_s=400))


def check_contract(reports: list[dict]) -> None:
    """Assert what every rank's ``_nonfinite_worker`` report must show, and that ranks agree."""
    for name, first in reports[0].items():
        for rank, report in enumerate(reports):
            entry = report[name]
            assert entry["bad_bucket_all_nan"], f"{name}: rank {rank} did not get the NaN marker"
            assert entry["state_unchanged"], f"{name}: rank {rank} state changed by a skipped step"
            assert entry["next_step_equal_to_twin"], f"{name}: rank {rank} result differs from a run without the bad steps"
            assert entry["state_equal_to_twin"], f"{name}: rank {rank} state differs from a run without the bad steps"
            assert all(entry["extremes_finite"].values()), f"{name}: rank {rank} {entry['extremes_finite']}"
            for key, t in entry["out3"].items():
                assert torch.equal(t, first["out3"][key]), f"{name}: ranks disagree on bucket {key}"
            for case, t in entry["extremes"].items():
                assert torch.equal(t, first["extremes"][case]), f"{name} {case}: ranks disagree"
