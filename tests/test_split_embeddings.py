"""``embeddings=CODEC``: the embedding tables of every bucket through a reducer of their own
(:mod:`gradzip.comm.split`), against the two codecs' reducers run apart on the same pieces."""

import math

import pytest
import torch
import torch.distributed as dist
from helpers.aggregatable_runs import bucket_grad
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.choice import parse_compressor
from gradzip.comm import make_reducer
from gradzip.keys import bucket_key
from gradzip.testing import run_ranks

#: a bucket of four parameters (numbers 0..3); number 1, a 40 x 8 table, is the embedding
SHAPES = [(24, 16), (40, 8), (16,), (30, 12)]
NUMELS = [math.prod(s) for s in SHAPES]
TAKEN = [1]
KEY = bucket_key(range(len(SHAPES)), NUMELS)
STEPS, RESUME_AT, BAD_STEP = 6, 3, 2


def _pieces(grad: torch.Tensor, part: list[int]) -> torch.Tensor:
    starts = [sum(NUMELS[:i]) for i in range(len(NUMELS))]
    return torch.cat([grad[starts[i] : starts[i] + NUMELS[i]] for i in part])


def _reference(rank: int, main_spec: str, side_spec: str, steps: list[int], bad: int | None = None) -> list:
    """The two codecs' own reducers on the two pieces of each step, results laid back in the
    bucket's order (what the split must give bit for bit); ``bad`` is not run (the twin of a run
    that skipped it)."""
    main_part = [i for i in range(len(SHAPES)) if i not in TAKEN]
    main, side = make_reducer(main_spec), make_reducer(side_spec)
    main_key = bucket_key(main_part, [NUMELS[i] for i in main_part])
    side_key = bucket_key(TAKEN, [NUMELS[i] for i in TAKEN])
    outs = []
    for step in steps:
        if step == bad:
            continue
        grad = bucket_grad(rank, step, sum(NUMELS))
        got_side = side.reduce(side_key, _pieces(grad, TAKEN), step=step, shapes=[SHAPES[i] for i in TAKEN]).wait()
        got_main = main.reduce(main_key, _pieces(grad, main_part), step=step, shapes=[SHAPES[i] for i in main_part]).wait()
        out, at_main, at_side = [], 0, 0
        for i, n in enumerate(NUMELS):
            if i in TAKEN:
                out.append(got_side[at_side : at_side + n])
                at_side += n
            else:
                out.append(got_main[at_main : at_main + n])
                at_main += n
        outs.append((step, torch.cat(out)))
    return outs


def _split_state(spec: str) -> gradzip.CompressionState:
    state = gradzip.CompressionState(spec)
    state.reducer.take(TAKEN)
    return state


def _split_worker(rank: int, world_size: int, main_spec: str, side_spec: str) -> dict:
    spec = main_spec + ("," if ":" in main_spec else ":") + f"embeddings={side_spec}"
    state = _split_state(spec)
    outs, nbytes, saved = [], [], None
    for step in range(STEPS):
        if step == RESUME_AT:
            saved = state.state_dict()
        out = state.reducer.reduce(KEY, bucket_grad(rank, step, sum(NUMELS)), step=step, shapes=SHAPES).wait()
        outs.append(out.clone())
        nbytes.append(state.metrics.pop()["payload_bytes"])
    fresh = _split_state(spec)
    fresh.load_state_dict(saved)
    resumed = [
        fresh.reducer.reduce(KEY, bucket_grad(rank, step, sum(NUMELS)), step=step, shapes=SHAPES).wait().clone()
        for step in range(RESUME_AT, STEPS)
    ]
    # a NaN on the last rank, in the table's part and then in the other part: the step is skipped
    skipped = {}
    for where in (TAKEN[0], 0):
        state = _split_state(spec)
        seen = []
        for step in range(STEPS):
            grad = bucket_grad(rank, step, sum(NUMELS))
            if step == BAD_STEP and rank == world_size - 1:
                grad[sum(NUMELS[:where])] = float("nan")
            seen.append((step, state.reducer.reduce(KEY, grad, step=step, shapes=SHAPES).wait().clone()))
        skipped[where] = seen
    return {
        "outs": outs, "bytes": nbytes, "resumed": resumed, "skipped": skipped,
        "reference": _reference(rank, main_spec, side_spec, list(range(STEPS))),
        "twin": _reference(rank, main_spec, side_spec, list(range(STEPS)), bad=BAD_STEP),
    }


def _int8_nbytes(numel: int) -> int:
    """int8 codes plus one fp32 scale per 256 elements, or the raw fp32 bytes where no smaller."""
    return min(numel + 4 * math.ceil(numel / 256), 4 * numel)


#: payload bytes per step, written out from each codec's formula for SHAPES
EXPECTED_BYTES = {
    # SEPARATE rank 4: m r fp32 values per matrix; the vector dense
    ("separate", "int8"): 24 * 4 * 4 + 16 * 4 + 30 * 4 * 4 + _int8_nbytes(320),
    # PowerSGD rank 2: (n + m) r per matrix, the vector dense; the table dense in fp32
    ("powersgd:approx_rank=2", "none"): (24 + 16) * 2 * 4 + 16 * 4 + (30 + 12) * 2 * 4 + 320 * 4,
    ("powersgd:approx_rank=2", "bf16"): (24 + 16) * 2 * 4 + 16 * 4 + (30 + 12) * 2 * 4 + 320 * 2,
}


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_split_equals_the_two_reducers_apart(world_size):
    jobs = list(EXPECTED_BYTES)
    reports = run_ranks(_split_many, world_size, jobs, timeout_s=300)
    for job in jobs:
        for rank, report in enumerate(reports):
            got = report[job]
            for step, want in got["reference"]:
                assert torch.equal(got["outs"][step], want), (job, rank, step)
                assert torch.equal(got["outs"][step], reports[0][job]["outs"][step]), (job, rank, step)
            assert got["bytes"] == [EXPECTED_BYTES[job]] * STEPS, (job, got["bytes"])
            for step, out in zip(range(RESUME_AT, STEPS), got["resumed"]):
                assert torch.equal(out, got["outs"][step]), (job, rank, "resume", step)
            twin = dict(got["twin"])
            for where, seen in got["skipped"].items():
                for step, out in seen:
                    if step == BAD_STEP:
                        assert torch.isnan(out).all(), (job, rank, where)
                    else:  # the skipped step left no trace in either reducer
                        assert torch.equal(out, twin[step]), (job, rank, where, step)


def _split_many(rank: int, world_size: int, jobs: list) -> dict:
    return {job: _split_worker(rank, world_size, *job) for job in jobs}


class _Tied(nn.Module):
    """A token table that is also the output layer, a position table, and one hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.wte, self.wpe = nn.Embedding(50, 16), nn.Embedding(8, 16)
            self.hidden = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        return torch.tanh(self.hidden(x)) @ self.wte.weight.T


def _ddp_worker(rank: int, world_size: int) -> dict:
    """One backward pass each under plain DDP, ``powersgd:approx_rank=2`` and the same with
    ``embeddings=none``; the gradients after each."""
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(rank))
    grads = {}
    for spec in (None, "powersgd:approx_rank=2", "powersgd:approx_rank=2,embeddings=none"):
        model = _Tied()
        ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets, one of them holding both kinds
        if spec is not None:
            state = gradzip.CompressionState(spec).bind(model)  # the same parameter numbers in both
            ddp.register_comm_hook(state, gradzip.compression_hook)
        ddp(ids).logsumexp(-1).mean().backward()
        grads[spec] = {name: p.grad.clone() for name, p in model.named_parameters()}
    unbound = gradzip.CompressionState("powersgd:embeddings=none")
    try:
        unbound.reducer.reduce(KEY, torch.zeros(sum(NUMELS)), step=0, shapes=SHAPES)
        grads["unbound"] = None
    except ValueError as exc:
        grads["unbound"] = str(exc)
    dist.barrier()
    return grads


@pytest.mark.dist
def test_ddp_sends_the_tables_by_their_codec_and_the_rest_by_the_main_one():
    for rank, grads in enumerate(run_ranks(_ddp_worker, 2, timeout_s=300)):
        dense, low_rank, split = grads[None], grads["powersgd:approx_rank=2"], grads["powersgd:approx_rank=2,embeddings=none"]
        for name in ("wte.weight", "wpe.weight"):  # the exact mean (summed in another order than DDP's)
            torch.testing.assert_close(split[name], dense[name], rtol=1e-6, atol=1e-7)
            assert not torch.allclose(low_rank[name], dense[name], rtol=1e-3, atol=1e-4), name  # compressed there
        # the hidden layer is PowerSGD's whatever else shares its bucket; its bias goes dense in both
        assert torch.equal(split["hidden.weight"], low_rank["hidden.weight"]), rank
        assert not torch.allclose(split["hidden.weight"], dense["hidden.weight"], rtol=1e-3, atol=1e-4)
        assert torch.equal(split["hidden.bias"], low_rank["hidden.bias"])
        assert "bind(model)" in grads["unbound"], grads["unbound"]


@pytest.mark.unit
def test_the_option_is_parsed_checked_and_kept_in_the_spec():
    choice = parse_compressor("separate:approx_rank=8,embeddings=int8")
    assert choice.embeddings == "int8" and choice.codec.approx_rank == 8
    assert parse_compressor(choice.spec).spec == choice.spec and choice.spec.endswith("embeddings=int8")
    assert parse_compressor("separate").embeddings is None
    with pytest.raises(ValueError, match="embeddings must be one of none, fp16, bf16, int8; got 'int4'"):
        parse_compressor("separate:embeddings=int4")
    with pytest.raises(ValueError, match="embeddings= does not combine with warmup_steps"):
        parse_compressor("dgc:ratio=0.01,warmup_steps=5,embeddings=int8")


@pytest.mark.e2e
def test_the_trainer_sends_the_tables_in_int8_and_the_rest_by_separate(tmp_path):
    import json
    import subprocess
    import sys

    from gradzip.lab.train.config import TrainConfig
    from gradzip.lab.train.model import build_model

    tiny = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "4", "--vocab-size", "512"]
    out = tmp_path / "run"
    args = [*tiny, "--steps", "4", "--eval-every", "2", "--compressor", "separate:embeddings=int8", "--out", str(out), "--quiet"]
    proc = subprocess.run([sys.executable, "-m", "gradzip", "train", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = build_model(TrainConfig(n_layer=1, n_embd=32, n_head=2, seq_len=32, vocab_size=512), 512)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    expected = 0
    for p in model.parameters():
        if id(p) in tables:  # 512 x 32 and 32 x 32: whole groups of 256, however DDP buckets them
            expected += _int8_nbytes(p.numel())
        elif p.dim() >= 2 and p[0].numel() > 4:  # SEPARATE at rank 4: m x 4 fp32 values
            expected += p.shape[0] * 4 * 4
        else:
            expected += p.numel() * 4
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["payload_bytes"] for r in records] == [expected] * 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["compressor"].endswith("embeddings=int8") and summary["final_val_loss"] < summary["initial_val_loss"]
