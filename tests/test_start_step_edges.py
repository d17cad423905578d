"""Edges of ``start_step=N`` and of the sign codecs' ``group=G``, on 3 spawned gloo ranks.

- spec lists (``gradzip compare`` / ``simulate`` / ``bench``) keep a ``key=value`` that is
  followed by ``+`` with the spec before it (``topk:ratio=0.01,start_step=3+uniform:bits=8``);
- ``auto``'s probe prices a candidate before its ``start_step`` as the dense exchange it takes;
- DGC's sparsity warm-up (``warmup_steps``) starts at ``start_step``, where compression does;
- FSDP's compressed reduce-scatter with an inf on one rank: all NaN on every rank, residuals
  untouched (they never turn inf or NaN), for ``efsignsgd:group=G``, ``topk`` and ``natural``
  (whose payload needs the marker slot); payload bytes as the formula says on every step;
- ``signsgd:group=G`` / ``efsignsgd:group=G`` over the two-phase route (chunks of unequal size)
  bit-identical to the single-process reference, in fp16, bf16 and fp64.
"""

import pytest
import torch
import torch.distributed as dist

from gradzip.comm import make_reducer
from gradzip.comm.nonfinite import with_marker_slot
from gradzip.comm.reference import simulate_ranks
from gradzip.comm.warmup import WarmupReducer
from gradzip.compressors import build
from gradzip.compressors.spec import split_training_options
from gradzip.feedback import ErrorFeedback
from gradzip.fsdp import CompressedReduceScatter
from gradzip.lab.bench import split_specs as bench_split
from gradzip.lab.cli import main
from gradzip.lab.compare.core import split_compressors
from gradzip.lab.simulate.cli import split_specs as simulate_split
from gradzip.metrics import StepMetrics
from gradzip.testing import run_ranks

WORLD_SIZE = 3
CHUNK = 337  # elements per FSDP chunk; odd, so groups and bytes do not divide evenly
FSDP_SPECS = ["efsignsgd:group=7", "topk:ratio=0.1", "natural"]
FSDP_STEPS = 4
BAD_STEP, BAD_RANK = 2, 1
TWOPHASE_SPECS = ["efsignsgd:group=7", "signsgd:group=64,start_step=1"]
TWOPHASE_DTYPES = [torch.float16, torch.bfloat16, torch.float64]
NUMEL = 1001


def _grad(rank: int, step: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + rank)).to(dtype)


@pytest.mark.parametrize("split", [split_compressors, simulate_split, bench_split])
def test_spec_lists_keep_a_start_step_before_a_plus_with_its_spec(split):
    text = "none,topk:ratio=0.01,start_step=3+uniform:bits=8,fp16:start_step=2,qsgd:bits=4,bucket=512"
    specs = split(text)
    assert specs == ["none", "topk:ratio=0.01,start_step=3+uniform:bits=8", "fp16:start_step=2", "qsgd:bits=4,bucket=512"]
    assert build(specs[1]).start_step == 3
    with pytest.raises(ValueError, match="codec name"):
        split("start_step=3,none")


def test_simulate_cli_takes_a_composed_spec_with_start_step(tmp_path, capsys):
    args = ["simulate", "--model", "gpt2", "--gpus", "8", "--sweep", "8", "--no-plot", "--out", str(tmp_path),
            "--compressors", "none,topk:ratio=0.01,start_step=3+uniform:bits=8"]
    assert main(args) == 0
    assert "topk:ratio=0.01,start_step=3+uniform:bits=8" in capsys.readouterr().out
    assert main([*args[:-1], "start_step=3,none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "codec name" in err


def _on_ranks(rank: int, world_size: int) -> dict:
    out = {}
    # auto's probe of a candidate still in its dense steps, and after them.
    for spec in ("topk:ratio=0.01,start_step=5", "powersgd:approx_rank=1,start_step=5"):
        reducer = make_reducer(spec)
        grad = _grad(rank, 0, 64 * 32)
        for step in (4, 5):
            probe = reducer.probe("b", grad, step=step, shapes=[torch.Size((64, 32))])
            out[("probe", spec, step)] = (probe["payload_bytes"], probe["sent_bytes"], torch.equal(probe["decoded"], grad))
    # FSDP with an inf on one rank at one step.
    for spec in FSDP_SPECS:
        comm = CompressedReduceScatter(build(spec), name="m", metrics=StepMetrics())
        rows = []
        for step in range(FSDP_STEPS):
            output = torch.empty(CHUNK)
            grad = _grad(rank, step, CHUNK * world_size)
            if step == BAD_STEP and rank == BAD_RANK:
                grad[CHUNK + 3] = float("inf")
            comm(output, grad, dist.group.WORLD, dist.ReduceOp.AVG)
            residuals = {} if comm.feedback is None else {k: v.clone() for k, v in comm.feedback.residuals.items()}
            rows.append({"out": output, "bytes": comm.metrics.pop()["buckets"]["m"]["payload_bytes"],
                         "residuals": residuals})
        out[("fsdp", spec)] = rows
    # Grouped sign codecs over the two-phase route.
    for spec in TWOPHASE_SPECS:
        for dtype in TWOPHASE_DTYPES:
            reducer = make_reducer(spec, collective="twophase")
            out[("twophase", spec, dtype)] = [
                reducer.reduce("b", _grad(rank, step, NUMEL, dtype), step=step).wait() for step in range(3)
            ]
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_on_ranks, WORLD_SIZE, timeout_s=180)


def test_auto_probe_prices_a_candidate_dense_before_its_start_step(ranks):
    raw = 64 * 32 * 4
    for spec in ("topk:ratio=0.01,start_step=5", "powersgd:approx_rank=1,start_step=5"):
        dense_bytes, dense_sent, exact = ranks[0][("probe", spec, 4)]
        assert (dense_bytes, dense_sent, exact) == (raw, 2 * (WORLD_SIZE - 1) * raw // WORLD_SIZE, True), spec
        payload_bytes, _, exact = ranks[0][("probe", spec, 5)]
        assert payload_bytes < raw and not exact, spec


def test_fsdp_nonfinite_rank_gives_nan_everywhere_and_keeps_residuals_finite(ranks):
    for spec in FSDP_SPECS:
        codec = with_marker_slot(build(spec))
        for r in range(WORLD_SIZE):
            rows = ranks[r][("fsdp", spec)]
            for step, row in enumerate(rows):
                assert row["bytes"] == WORLD_SIZE * codec.payload_nbytes(CHUNK), (spec, step)
                for residual in row["residuals"].values():
                    assert torch.isfinite(residual).all(), (spec, r, step)
                if step == BAD_STEP:
                    assert torch.isnan(row["out"]).all(), (spec, r)
                    # The skipped step left the residuals as they were.
                    before, after = rows[step - 1]["residuals"], row["residuals"]
                    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
                else:
                    assert torch.isfinite(row["out"]).all(), (spec, r, step)


def test_grouped_sign_over_twophase_matches_the_reference(ranks):
    for spec in TWOPHASE_SPECS:
        codec = build(spec)
        for dtype in TWOPHASE_DTYPES:
            use = codec.error_feedback
            feedback = [ErrorFeedback() for _ in range(WORLD_SIZE)] if use else None
            server = [ErrorFeedback() for _ in range(WORLD_SIZE)] if use else None
            for step in range(3):
                grads = [_grad(r, step, NUMEL, dtype) for r in range(WORLD_SIZE)]
                want = simulate_ranks(spec, grads, step=step, key="b", feedback=feedback, server_feedback=server,
                                      collective="twophase")
                for r in range(WORLD_SIZE):
                    got = ranks[r][("twophase", spec, dtype)][step]
                    assert got.dtype == dtype and torch.isfinite(got).all(), (spec, dtype, step)
                    if step >= codec.start_step:
                        assert torch.equal(got, want), (spec, dtype, step, r)
                    else:
                        # Dense: the exact mean, up to the rounding of the wire dtype's sum.
                        exact = torch.stack([g.double() for g in grads]).mean(0)
                        torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_group_scale_near_the_dtype_max_is_the_true_mean(dtype):
    top = torch.finfo(dtype).max
    x = torch.tensor([top, -top, 0.0, -1.0, 3.0], dtype=dtype)
    codec = build("signsgd:group=3")
    payload = codec.compress(x)
    assert payload.nbytes == codec.payload_nbytes(5, dtype)
    # Group one: (|top| + |-top| + 0) / 3, rounded once to the dtype; group two: (1 + 3) / 2.
    want = torch.tensor([2 * (top / 3), 2.0], dtype=torch.float64).to(dtype)
    assert torch.equal(payload.tensors[1], want)
    decoded = codec.decompress(payload, like=x)
    assert torch.equal(decoded, torch.stack([want[0], -want[0], want[0], -want[1], want[1]]))


@pytest.mark.parametrize("spec", ["topk:ratio=0.1,start_step=2+natural", "natural:start_step=3", "natural"])
def test_marker_slot_keeps_the_codec_spec_and_start_step(spec):
    codec = build(spec)
    slotted = with_marker_slot(codec)
    assert slotted is not codec  # natural's payload has no floating tensor for the marker
    assert slotted.spec == codec.spec and build(slotted.spec).spec == codec.spec
    assert slotted.start_step == codec.start_step


def test_dgc_warmup_starts_where_compression_does():
    spec, options = split_training_options("dgc:ratio=0.01,warmup_steps=8,warmup_stages=4,start_step=3")
    assert build(spec).start_step == 3 and options == {"warmup_steps": 8, "warmup_stages": 4}
    reducer = WarmupReducer(build(spec), **options)
    # Stage s keeps 0.01 ** ((s + 1) / 5) for two steps each, from step 3 on; dense before it.
    stages = [0.01 ** ((s + 1) / 5) for s in range(4)]
    want = [stages[0]] * 3 + [stages[s // 2] for s in range(8)] + [0.01] * 2
    assert [reducer.ratio_at(step) for step in range(13)] == pytest.approx(want, rel=1e-12)
