"""Compressed reduce-scatter for FSDP2 on spawned gloo ranks (2 and 3, and 1).

The exchange on hand-made buffers against every rank's own decodes summed in rank order (the
arithmetic of the single-process reference) and PowerSGD's error-feedback invariant; then on ``fully_shard`` models: the identity codec against
FSDP's own reduce-scatter bit for bit (fp32, bf16 and fp16 reduce dtypes, forced SUM), bf16
within bf16 rounding, PREMUL_SUM, micro-steps without sync, a module with no gradient, a few
training steps per codec, exact resume of the compressor state, and world size 1.
"""

import io
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.tiny_run import load, same, tiny_config, without_plots, write_corpus
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gradzip.comm.nonfinite import with_marker_slot
from gradzip.compressors import build, list_compressors
from gradzip.feedback import ErrorFeedback
from gradzip.fsdp import CompressedReduceScatter, compress_reduce_scatter
from gradzip.lab.train.loop import train_worker
from gradzip.metrics import StepMetrics
from gradzip.testing import run_ranks

# Shapes of the parameters within one chunk of a hand-made buffer: two that PowerSGD compresses
# (as stacked matrices), two it sends as they are.
SHARD_SHAPES = [torch.Size(s) for s in [(3, 5), (7,), (2, 3, 2), (4,)]]
CHUNK = sum(s.numel() for s in SHARD_SHAPES)
STEPS = 3
EXTRA_SPECS = ["topk:ratio=0.2", "powersgd:approx_rank=1", "powersgd:approx_rank=2,warm_start=false"]


def _specs() -> list[str]:
    return [name for name in list_compressors() if not build(name).multi_round] + EXTRA_SPECS


def _buffer(rank: int, step: int, world_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(world_size * CHUNK, generator=gen) * (1 + rank)


OPS_CHECKED = ["none", "bf16", "topk:ratio=0.2", "powersgd:approx_rank=1"]


def exchange_on_buffers(rank, world_size, specs):
    """Each spec: STEPS calls with AVG; returns outputs, bytes, exchange and final residuals.
    For a few, also the SUM and PREMUL_SUM(0.25) outputs of fresh instances fed the same buffers."""
    out = {}
    for spec in specs:
        results = {}
        ops = [("avg", dist.ReduceOp.AVG), ("sum", dist.ReduceOp.SUM), ("premul", dist.ReduceOp.PREMUL_SUM(0.25))]
        for label, op in ops if spec in OPS_CHECKED else ops[:1]:
            comm = CompressedReduceScatter(build(spec), name="m", shard_shapes=SHARD_SHAPES, metrics=StepMetrics())
            outputs, payload = [], []
            for step in range(STEPS):
                inp = _buffer(rank, step, world_size)
                before = inp.clone()
                output = torch.empty(CHUNK)
                comm(output, inp, dist.group.WORLD, op)
                assert torch.equal(inp, before), "the input buffer was modified"
                outputs.append(output)
                payload.append(comm.metrics.pop())
            results[label] = outputs
            if label == "avg":
                if not comm.compressor.multi_round:
                    results["local_decodes"] = _local_decodes(spec, rank, world_size)
                results["payload_bytes"] = [m["payload_bytes"] for m in payload]
                results["metrics"] = payload
                results["exchange"] = comm.last_exchange
                results["state"] = comm.state_dict()
        out[spec] = results
    return out


def _local_decodes(spec: str, rank: int, world_size: int) -> list[list[torch.Tensor]]:
    """What this rank's payload for each destination chunk decodes to, per step: the codec and
    error feedback called as ``simulate_ranks`` calls them for one rank, in this process (codecs
    that dither mix the process rank into their seed)."""
    codec = build(spec)
    feedback = ErrorFeedback() if codec.error_feedback else None
    decodes = []
    for step in range(STEPS):
        grid = _buffer(rank, step, world_size).view(world_size, CHUNK)
        row = []
        for j in range(world_size):
            compensated = grid[j] if feedback is None else feedback.compensate(j, grid[j], step=step)
            decoded = codec.decompress(codec.compress(compensated, step=step, key=("m", j)), like=compensated)
            if feedback is not None:
                feedback.update(j, compensated, decoded, step=step)
            row.append(decoded)
        decodes.append(row)
    return decodes


def _powersgd_payload_bytes(spec: str, world_size: int) -> int:
    codec = build(spec)
    total, dense = 0, 0
    for s in SHARD_SHAPES:
        if len(s) >= 2:
            n, m = world_size * s[0], s[1:].numel()
            r = min(codec.approx_rank, n, m)
            if (n + m) * r < n * m:
                total += (n + m) * r * 4
                continue
        dense += world_size * s.numel() * 4
    return total + dense


@pytest.mark.dist
def test_exchange_equals_reference_for_every_codec(ranks):
    world_size, results = ranks[0], [r["exchange"] for r in ranks[1]]
    for spec in _specs():
        codec = build(spec)
        per_rank = [r[spec] for r in results]
        full = [torch.cat([per_rank[r]["avg"][t] for r in range(world_size)]) for t in range(STEPS)]
        true_means = [sum(_buffer(r, t, world_size) for r in range(world_size)) / world_size for t in range(STEPS)]
        for t in range(STEPS):
            assert torch.isfinite(full[t]).all(), spec
            # The op scales the same decoded sum (a bf16 wire divides in bf16 for AVG).
            tol = {"rtol": 2**-7, "atol": 1e-2} if spec == "bf16" else {}
            for r in range(world_size if spec in OPS_CHECKED else 0):
                avg = per_rank[r]["avg"][t]
                torch.testing.assert_close(per_rank[r]["sum"][t], avg * world_size, msg=spec, **tol)
                torch.testing.assert_close(per_rank[r]["premul"][t], avg * world_size * 0.25, msg=spec, **tol)
        if codec.multi_round:
            assert per_rank[0]["exchange"] == "powersgd"
            assert per_rank[0]["payload_bytes"] == [_powersgd_payload_bytes(spec, world_size)] * STEPS, spec
            _check_powersgd_feedback_invariant(spec, per_rank, full, true_means, world_size)
            continue
        if per_rank[0]["exchange"] == "dense":  # compressing would send more than the raw buffer
            assert per_rank[0]["payload_bytes"] == [world_size * CHUNK * 4] * STEPS, spec
            for t in range(STEPS):
                torch.testing.assert_close(full[t], true_means[t], msg=spec)
            continue
        for t in range(STEPS):
            if per_rank[0]["exchange"] == "all_to_all":
                # Every rank's decode of chunk j, summed in rank order: what rank j must hold.
                for j in range(world_size):
                    total = per_rank[0]["local_decodes"][t][j].clone()
                    for r in range(1, world_size):
                        total += per_rank[r]["local_decodes"][t][j]
                    assert torch.equal(per_rank[j]["avg"][t], total.div_(world_size)), spec
            else:  # the identity, summed on the wire by gloo in its own order
                torch.testing.assert_close(full[t], true_means[t], rtol=1e-6, atol=1e-6, msg=spec)
        # A codec whose payload has no floating tensor sends the 2-byte NaN marker slot beside it.
        wire_codec = with_marker_slot(codec)
        assert per_rank[0]["payload_bytes"] == [world_size * wire_codec.payload_nbytes(CHUNK, torch.float32)] * STEPS, spec
        # gloo's reduce-scatter sends twice the all_to_all's bytes: only the identity takes it.
        assert per_rank[0]["exchange"] == ("reduce_scatter" if spec == "none" else "all_to_all"), spec
        sent = [r["sent_bytes"] for r in per_rank[0]["metrics"]]
        if spec == "none":
            assert sent == [2 * (world_size - 1) * CHUNK * 4] * STEPS
        else:
            assert sent == [(world_size - 1) * wire_codec.payload_nbytes(CHUNK, torch.float32)] * STEPS, spec


def _check_powersgd_feedback_invariant(spec, per_rank, full, true_means, world_size):
    """Summed over steps, decoded + mean residual == mean gradient (matrices); the parameters
    PowerSGD does not compress arrive as the exact mean every step."""
    offsets = [0]
    for s in SHARD_SHAPES[:-1]:
        offsets.append(offsets[-1] + s.numel())
    compressed = 0
    for i, s in enumerate(SHARD_SHAPES):
        def matrix(flat, i=i, s=s):
            return flat.view(world_size, CHUNK)[:, offsets[i] : offsets[i] + s.numel()].reshape(world_size * s[0], -1)

        if len(s) < 2:
            for t in range(STEPS):
                torch.testing.assert_close(matrix(full[t]), matrix(true_means[t]), msg=spec)
            continue
        residuals = [per_rank[r]["state"]["own"]["feedback"]["residuals"][("m", compressed)] for r in range(world_size)]
        compressed += 1
        decoded = sum(matrix(full[t]) for t in range(STEPS))
        truth = sum(matrix(true_means[t]) for t in range(STEPS))
        torch.testing.assert_close(decoded + sum(residuals) / world_size, truth, rtol=1e-4, atol=1e-4, msg=spec)


# -- fully_shard models -----------------------------------------------------------------------


class Net(nn.Module):
    """Odd widths (padding at 2 and 3 ranks), a nested sharded block and a skippable one."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Sequential(nn.Linear(5, 9), nn.LayerNorm(9))
        self.skip = nn.Linear(5, 5)
        self.head = nn.Linear(9, 3)

    def forward(self, x, use_skip=True):
        h = torch.relu(self.a(x))
        if use_skip:
            h = h + self.skip(h)
        return self.head(self.b(h))


def _net(mp_policy=None) -> Net:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = Net()
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    fully_shard(net.b, **kwargs)
    fully_shard(net.skip, **kwargs)
    fully_shard(net, **kwargs)
    return net


def _grads(net):
    return [p.grad.to_local().clone() for p in net.parameters()]


def _data(rank, step=0):
    gen = torch.Generator().manual_seed(10 * rank + step)
    return torch.randn(6, 7, generator=gen), torch.randn(6, 3, generator=gen)


def _loss(net, rank, step=0, use_skip=True):
    x, y = _data(rank, step)
    return (net(x, use_skip=use_skip) - y).square().mean()


def _residual_norm(comm, world_size):
    return sum(comm.feedback.residual_norm(j) ** 2 for j in range(world_size)) ** 0.5


def identity_and_ops(rank, world_size):
    """Identity vs FSDP's default per reduce dtype; bf16 codec; PREMUL_SUM; micro-steps; a
    module with no gradient."""
    res = {}
    policies = {
        "fp32": None,
        "bf16": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
        "fp16": MixedPrecisionPolicy(reduce_dtype=torch.float16),
    }
    for label, policy in policies.items():
        for force_sum in (False, True):
            default, ours = _net(policy), _net(policy)
            state = compress_reduce_scatter(ours, "none")
            for net in (default, ours):
                net.set_force_sum_reduction_for_comms(force_sum)
                _loss(net, rank).backward()
            res[f"identity_{label}_sum{force_sum}"] = all(torch.equal(a, b) for a, b in zip(_grads(default), _grads(ours)))
            res[f"identity_{label}_calls"] = sorted(c.calls for c in state.comms.values())

    default, cast = _net(), _net()
    compress_reduce_scatter(cast, "bf16")
    for net in (default, cast):
        _loss(net, rank).backward()
    res["bf16_err"] = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(_grads(default), _grads(cast)))

    # PREMUL_SUM: gloo cannot do it, FSDP's own reduce-scatter fails; ours is the sum / factor.
    default, ours = _net(), _net()
    compress_reduce_scatter(ours, "none")
    for module in (ours, ours.b, ours.skip):
        module.set_gradient_divide_factor(4.0)
    for net in (default, ours):
        _loss(net, rank).backward()
    res["premul_err"] = max(float((a * world_size / 4 - b).abs().max()) for a, b in zip(_grads(default), _grads(ours)))

    # Two micro-steps, the first without gradient sync: one reduce-scatter per module.
    default, ours, sparse = _net(), _net(), _net()
    compress_reduce_scatter(ours, "none")
    sparse_state = compress_reduce_scatter(sparse, "topk:ratio=0.3")
    for net in (default, ours, sparse):
        net.set_requires_gradient_sync(False)
        _loss(net, rank, 0).backward()
        net.set_requires_gradient_sync(True)
        _loss(net, rank, 1).backward()
    res["microsteps_equal"] = all(torch.equal(a, b) for a, b in zip(_grads(default), _grads(ours)))
    res["microsteps_calls"] = sorted(c.calls for c in sparse_state.comms.values())

    # A module with no gradient this step: its residual still goes out, so the whole buffer
    # layout stays and no residual restarts.
    import warnings

    net = _net()
    state = compress_reduce_scatter(net, "topk:ratio=0.3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loss(net, rank, 0).backward()
        residual_norms = [_residual_norm(state.comms["skip"], world_size)]
        net.zero_grad()
        _loss(net, rank, 1, use_skip=False).backward()
        residual_norms.append(_residual_norm(state.comms["skip"], world_size))
    res["skip_calls"] = state.comms["skip"].calls
    res["skip_grad"] = [p.grad.to_local().clone() for p in net.skip.parameters()]
    res["skip_residual_norms"] = residual_norms

    # A codec per module: Top-K for block b, the identity elsewhere.
    default, mixed = _net(), _net()
    state = compress_reduce_scatter(mixed, lambda name, module: "topk:ratio=0.3" if name == "b" else "none")
    for net in (default, mixed):
        _loss(net, rank).backward()
    res["mixed_specs"] = state.state_dict()["compressor"]
    res["mixed_codecs"] = {name: type(comm.compressor).__name__ for name, comm in state.comms.items()}
    res["mixed_equal"] = {
        name: all(torch.equal(a.grad.to_local(), b.grad.to_local())
                  for a, b in zip(getattr(default, name).parameters(), getattr(mixed, name).parameters()))
        for name in ("a", "b", "skip", "head")
    }
    res["mixed_bytes"] = {name: entry["payload_bytes"] for name, entry in state.metrics.pop()["buckets"].items()}
    default, refused = _net(), _net()
    try:
        compress_reduce_scatter(refused, lambda name, module: "topk:ratio=2" if name == "b" else "topk:ratio=0.3")
    except ValueError as exc:
        res["mixed_bad"] = str(exc)
    for net in (default, refused):  # refused: FSDP's own reduce-scatter everywhere, untouched
        _loss(net, rank).backward()
    res["refused_equal"] = all(torch.equal(a, b) for a, b in zip(_grads(default), _grads(refused)))
    return res


@pytest.mark.dist
def test_identity_bit_for_bit_and_ops_microsteps_unused_module(ranks):
    for res in [r["fsdp"] for r in ranks[1]]:
        for label in ("fp32", "bf16", "fp16"):
            assert res[f"identity_{label}_sumFalse"] and res[f"identity_{label}_sumTrue"], label
            assert res[f"identity_{label}_calls"] == [1, 1, 1]  # root, b, skip: one each
        assert res["bf16_err"] <= 2**-7  # bf16 keeps 8 bits of mantissa
        assert res["premul_err"] < 1e-6
        assert res["microsteps_equal"]
        assert res["microsteps_calls"] == [1, 1, 1]
        assert res["skip_calls"] == 2
        # Zeros were sent for it, plus what error feedback released: a finite gradient, not
        # zero, and the residual shrinks.
        assert all(torch.isfinite(g).all() for g in res["skip_grad"])
        assert any(g.abs().sum() > 0 for g in res["skip_grad"])
        first, second = res["skip_residual_norms"]
        assert 0 < second < first


# Trained a few steps each; the codecs after the first four join where they are registered.
SPECS_TRAINED = ["none", "fp16", "topk:ratio=0.1", "powersgd:approx_rank=2"]
SPECS_TRAINED_IF_REGISTERED = ["uniform:bits=8", "qsgd", "efsignsgd", "randomk:ratio=0.3"]


def _specs_trained() -> list[str]:
    return SPECS_TRAINED + [s for s in SPECS_TRAINED_IF_REGISTERED if s.split(":")[0] in list_compressors()]


@torch.no_grad()
def _eval_loss(net, rank) -> float:
    """Mean loss over this rank's two training batches."""
    return sum(float(_loss(net, rank, step)) for step in (0, 1)) / 2


def _train(net, rank, steps, state=None, start=0, opt_state=None):
    opt = torch.optim.AdamW(net.parameters(), lr=0.02)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    losses = []
    for step in range(start, steps):
        loss = _loss(net, rank, step % 2)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if state is not None:
            state.metrics.pop()
    return opt, losses


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def train_and_resume(rank, world_size, specs):
    """A few AdamW steps per codec; then resume from a checkpoint at step 3 of 6."""
    res = {}
    for spec in specs:
        net = _net()
        state = compress_reduce_scatter(net, spec)
        before = _eval_loss(net, rank)
        _train(net, rank, 12, state)
        res[spec] = (before, _eval_loss(net, rank))
    for spec in ("topk:ratio=0.1", "powersgd:approx_rank=1"):
        full = _net()
        full_state = compress_reduce_scatter(full, spec)
        opt, _ = _train(full, rank, 3, full_state)
        checkpoint = _saved(
            {"model": full.state_dict(), "optimizer": opt.state_dict(), "compression": full_state.state_dict()}
        )
        opt = torch.optim.AdamW(full.parameters(), lr=0.02)
        opt.load_state_dict(_saved(checkpoint["optimizer"]))  # loading shares tensors: copy first
        _continue(full, rank, opt)
        resumed_exactly = []
        for load_compression in (True, False):
            net = _net()
            state = compress_reduce_scatter(net, spec)
            net.load_state_dict(checkpoint["model"])
            if load_compression:
                state.load_state_dict(_saved(checkpoint["compression"]))
            opt = torch.optim.AdamW(net.parameters(), lr=0.02)
            opt.load_state_dict(_saved(checkpoint["optimizer"]))
            _continue(net, rank, opt)
            resumed_exactly.append(
                all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(full.parameters(), net.parameters()))
            )
        res[f"resume_{spec}"] = resumed_exactly
    return res


def _continue(net, rank, opt):
    for step in range(3, 6):
        _loss(net, rank, step % 2).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.dist
def test_training_steps_per_codec_and_exact_resume(ranks):
    results = [r["train"] for r in ranks[1]]

    def mean_over_ranks(spec):
        return [sum(r[spec][i] for r in results) / len(results) for i in (0, 1)]

    baseline = mean_over_ranks("none")[1]
    for spec in _specs_trained():
        before, after = mean_over_ranks(spec)
        assert after == after and after < 0.8 * before, (spec, before, after)  # finite, learning
        assert after < 1.25 * baseline, (spec, after, baseline)
    for res in results:
        # Exact with the compressor state; not without it (the state matters).
        assert res["resume_topk:ratio=0.1"] == [True, False]
    # World size 3 included: uneven shards give odd matrix shapes, where CPU matmul can round
    # by an operand's alignment (a resumed run holds fresh copies of the warm-start factors).
    powersgd_resumes = [res["resume_powersgd:approx_rank=1"] for res in results]
    assert all(r == [True, False] for r in powersgd_resumes), powersgd_resumes


def all_checks(rank, world_size, specs):
    """Everything one world size checks, in one spawn (spawning costs seconds)."""
    return {
        "exchange": exchange_on_buffers(rank, world_size, specs),
        "fsdp": identity_and_ops(rank, world_size),
        "train": train_and_resume(rank, world_size, _specs_trained()),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["world_size=2", "world_size=3"])
def ranks(request):
    """(world_size, per-rank results of :func:`all_checks`)."""
    return request.param, run_ranks(all_checks, request.param, _specs(), timeout_s=240)


def world_size_one(rank, world_size):
    default, ours = _net(), _net()
    state = compress_reduce_scatter(ours, "topk:ratio=0.1")
    for net in (default, ours):
        _loss(net, rank).backward()
    equal = all(torch.equal(a, b) for a, b in zip(_grads(default), _grads(ours)))
    return equal, [c.calls for c in state.comms.values()], state.metrics.pop()["payload_bytes"]


@pytest.mark.dist
def test_world_size_one_sends_nothing_and_equals_plain_fsdp():
    [(equal, calls, payload_bytes)] = run_ranks(world_size_one, 1)
    assert equal and calls == [0, 0, 0] and payload_bytes == 0


def test_model_without_fully_shard_is_refused():
    with pytest.raises(ValueError, match="fully_shard"):
        compress_reduce_scatter(nn.Linear(3, 3), "none")


def _fsdp_resume_worker(rank: int, world_size: int, base: str, data: str) -> dict:
    """``gradzip train --fsdp``: 4 steps with checkpoints at 2 and 4; then a copy whose step-4
    checkpoint was cut short, resumed from step 2."""
    without_plots()
    uninterrupted, resumed = Path(base) / "a", Path(base) / "b"
    settings = dict(compressor="powersgd:approx_rank=2", fsdp=True, world_size=world_size, steps=4)
    summary = train_worker(tiny_config(data, str(uninterrupted), checkpoint_every=2, keep_checkpoints=0, **settings))
    if rank == 0:
        shutil.copytree(uninterrupted, resumed)
        cut = resumed / "checkpoints" / "step-000004" / "rank-1.pt"
        cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    dist.barrier()
    train_worker(tiny_config(data, str(resumed), resume=str(resumed), **settings))
    final_a, final_b = (folder / "checkpoints" / "step-000004" for folder in (uninterrupted, resumed))
    mine_a, mine_b = load(final_a, f"rank-{rank}.pt"), load(final_b, f"rank-{rank}.pt")
    out = {"hook_state": same(mine_a["hook"], mine_b["hook"]), "modules": sorted(mine_a["hook"]["modules"])}
    if rank == 0:
        shared_a, shared_b = load(final_a, "shared.pt"), load(final_b, "shared.pt")
        out.update({part: same(shared_a[part], shared_b[part]) for part in ("model", "optimizer", "scheduler")})
        out["summary"] = summary
        out["model_state"] = shared_a["model"]
    return out


@pytest.mark.dist
def test_train_fsdp_resumes_bit_identical(tmp_path, monkeypatch):
    """``gradzip train --fsdp`` (PowerSGD on a tiny GPT, 2 ranks): bytes below the raw buffer, a
    checkpoint whose model loads into the unsharded model, and a run resumed from step 2 that
    ends bit-identical to the uninterrupted one (model, optimizer, every rank's compressor state)."""
    from gradzip.lab.train.model import build_model

    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus.txt")
    results = run_ranks(_fsdp_resume_worker, 2, str(tmp_path), data, timeout_s=240)
    for res in results:
        assert res["hook_state"] and res["modules"] == ["", "transformer.h.0"]
    main = results[0]
    assert main["model"] and main["optimizer"] and main["scheduler"]
    summary = main["summary"]
    assert summary["parallel"] == "fsdp" and 0 < summary["payload_bytes_per_step"] < summary["dense_bytes_per_step"]
    cfg = tiny_config(data, str(tmp_path / "unused"))
    build_model(cfg, cfg.vocab_size).load_state_dict(main["model_state"], strict=True)


@pytest.mark.dist
def test_a_codec_per_module_from_a_function_of_its_name(ranks):
    world_size, results = ranks
    for res in [r["fsdp"] for r in results]:
        assert res["mixed_specs"] == {"": "none", "b": "topk:ratio=0.3", "skip": "none"}
        assert res["mixed_codecs"] == {"": "Identity", "b": "TopK", "skip": "Identity"}
        # the root's and skip's reduce-scatters are FSDP's to the bit; b's is Top-K's
        assert res["mixed_equal"] == {"a": True, "b": False, "skip": True, "head": True}
        # b's chunk per rank: each parameter's rows split over the ranks (FSDP pads dim 0)
        chunk = sum(-(-p.shape[0] // world_size) * p[0].numel() for p in Net().b.parameters())
        topk = with_marker_slot(build("topk:ratio=0.3"))
        assert res["mixed_bytes"]["b"] == world_size * topk.payload_nbytes(chunk, torch.float32)
        assert res["mixed_bad"] == "compressor for module 'b': ratio must be in (0, 1]; got 2"
        assert res["refused_equal"]

