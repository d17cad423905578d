"""Hostile inputs for the outer loop (``gradzip/outer``: DiLoCo, Streaming DiLoCo fragments, delay,
carry, mix, outer Nesterov) and for ``LocalAdamW``: every tensor its own fragment at the largest
delay, fragments that do not divide the cycle, ``sync_every=1``; frozen parameters, gradients
missing on one rank or on some steps, zero-element and half-precision parameters, inner parameter
groups of different learning rates; a non-finite exchange in flight across a checkpoint; fp16
pseudo-gradients whose sum would overflow; bad arguments; ranks whose gradient sets differ.

Expected values are computed here without ``gradzip.outer`` or ``gradzip.optim``: a replica loop
written out with ``torch.optim.SGD`` (inner and outer), a closed form, or ``torch.optim.AdamW``
run per rank on a zero "shadow" tensor (whose step is then exactly that rank's update).
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

import gradzip
from gradzip.optim import LocalAdamW
from gradzip.testing import run_ranks

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# ----- DiLoCo: a parameter-only model, synthetic gradients, a written-out reference -------------

#: four fp32 tensors: (shape, dtype, trainable, gradient rule)
PLAIN = [((3, 4), F32, True, None), ((4,), F32, True, None), ((2, 3), F32, True, None), ((2,), F32, True, None)]

#: every awkward kind at once. Trainable tensors t0..t7 (the frozen one is not counted); with
#: three fragments, fragment 0 = {t0, t3, t6} holds only zero-element tensors.
ODD = [
    ((0,), F32, True, None),  # t0, empty
    ((3, 4), F32, True, None),  # t1
    ((3,), F32, False, None),  # frozen, its value differs per rank: it must stay the rank's own
    ((2, 3), F32, True, "rank1"),  # t2: no gradient on rank 1, ever
    ((0, 4), F16, True, None),  # t3, empty
    ((2,), F32, True, "even"),  # t4: no gradient on any rank at even steps
    ((5,), BF16, True, None),  # t5
    ((0,), BF16, True, None),  # t6, empty
    ((3,), F16, True, None),  # t7
]

SCENARIOS = {
    # F = H = number of tensors, delay H - 1: every step launches one fragment and lands another
    "every_tensor_its_fragment": {"specs": PLAIN, "steps": 11,
                                  "cfg": {"sync_every": 4, "fragments": 4, "delay": 3, "carry": True,
                                          "outer_momentum": 0.5}},
    # F does not divide H (sends after steps 1, 3, 5), delay H - 1, mixing
    "uneven_fragments_mix": {"specs": PLAIN, "steps": 12,
                             "cfg": {"sync_every": 5, "fragments": 3, "delay": 4, "mix": 0.5, "outer_lr": 0.9}},
    "sync_every_1": {"specs": PLAIN, "steps": 5, "cfg": {"sync_every": 1}},
    "odd_params_replace": {"specs": ODD, "steps": 10, "groups": True,
                           "cfg": {"sync_every": 3, "fragments": 3, "delay": 2, "bucket_cap_mb": 0.0,
                                   "outer_momentum": 0.5}},
    # rank 1 skips its inner steps 2 and 5 (skip_step); synchronize() after step 6 lands what is
    # in flight early, and the exchange must not land a second time when it falls due
    "odd_params_carry": {"specs": ODD, "steps": 9, "groups": True, "skips": {(1, 2), (1, 5)}, "sync_at": 6,
                         "cfg": {"sync_every": 4, "fragments": 2, "delay": 3, "carry": True}},
}


class ParamsOnly(nn.Module):
    """Parameters only (their gradients are set by hand); a frozen one holds ``rank`` more."""

    def __init__(self, specs, rank: int = 0) -> None:
        super().__init__()
        self.ps = nn.ParameterList()
        for i, (shape, dtype, trainable, _rule) in enumerate(specs):
            value = torch.randn(shape, generator=torch.Generator().manual_seed(100 + i)).to(dtype)
            self.ps.append(nn.Parameter(value if trainable else value + rank, requires_grad=trainable))


def inner_sgd(params, grouped: bool) -> torch.optim.Optimizer:
    """Plain SGD over every parameter (frozen ones too, as ``model.parameters()`` hands them);
    ``grouped``: the first half at lr 0.1, the rest at 0.05."""
    if not grouped:
        return torch.optim.SGD(params, lr=0.1, foreach=False)
    half = len(params) // 2
    return torch.optim.SGD([{"params": params[:half]}, {"params": params[half:], "lr": 0.05}], lr=0.1, foreach=False)


def set_grads(specs, rank: int, step: int, params) -> None:
    for i, ((shape, dtype, trainable, rule), p) in enumerate(zip(specs, params)):
        missing = not trainable or (rule == "rank1" and rank == 1) or (rule == "even" and step % 2 == 0)
        gen = torch.Generator().manual_seed(7919 * rank + 131 * step + i)
        p.grad = None if missing else (0.5 * torch.randn(shape, generator=gen)).to(dtype)


def run_scenario(rank: int, name: str, compressor: str = "none", **extra) -> dict:
    """``name``'s loop on replica ``rank``: its own gradients and frozen values."""
    scn = SCENARIOS[name]
    model = ParamsOnly(scn["specs"], rank)
    params = list(model.ps)
    opt = gradzip.DiLoCo(model, inner_sgd(params, scn.get("groups", False)), compressor, **{**scn["cfg"], **extra})
    for step in range(1, scn["steps"] + 1):
        set_grads(scn["specs"], rank, step, params)
        if (rank, step) in scn.get("skips", ()):
            opt.skip_step()
        else:
            opt.step()
        opt.zero_grad()
        if step == scn.get("sync_at"):
            opt.synchronize()
    opt.synchronize()
    return {"params": [p.detach().clone() for p in params], "global": [g.clone() for g in opt.global_params],
            "skipped": opt.skipped}


def dense_mean(tensors):
    """What an uncompressed all_reduce of the mean forms: each term divided, then summed."""
    total = tensors[0].div(len(tensors))
    for t in tensors[1:]:
        total = total + t.div(len(tensors))
    return total


@torch.no_grad()
def reference(world_size: int, name: str) -> list[list[torch.Tensor]]:
    """The replicas' final parameters (all of them, frozen included), from the papers' loop
    written out with torch.optim.SGD: the exchange of fragment p (tensors p, p + F, ...) starts
    after steps ``floor(H (p + 1) / F) mod H``, lands ``delay`` steps later (replace, mix or carry)
    and steps the global tensors with Nesterov SGD; what is in flight at the end, or at
    ``sync_at``, lands then. A replica skipping a step takes no inner step then."""
    scn = SCENARIOS[name]
    specs, cfg = scn["specs"], scn["cfg"]
    H, F, D = cfg["sync_every"], cfg.get("fragments", 1), cfg.get("delay", 0)
    mix, carry = cfg.get("mix", 0.0), cfg.get("carry", False)
    lr, momentum = cfg.get("outer_lr", 0.7), cfg.get("outer_momentum", 0.9)
    models = [ParamsOnly(specs, r) for r in range(world_size)]
    inners = [inner_sgd(list(m.ps), scn.get("groups", False)) for m in models]
    trainable = [i for i, s in enumerate(specs) if s[2]]
    local = [[m.ps[i] for i in trainable] for m in models]
    glob = [p.detach().clone() for p in local[0]]
    outer = torch.optim.SGD(glob, lr=lr, momentum=momentum, nesterov=momentum > 0, foreach=False)
    frags = [list(range(p, len(glob), F)) for p in range(F)]

    def land(entry):
        _, p, means, snaps = entry
        for i, g in enumerate(glob):
            g.grad = means.get(i)
        outer.step()
        for r in range(world_size):
            for k, i in enumerate(frags[p]):
                if carry:
                    local[r][i].copy_(glob[i] + (local[r][i] - snaps[r][k]))
                elif mix == 0:
                    local[r][i].copy_(glob[i])
                else:
                    local[r][i].lerp_(glob[i], 1 - mix)

    pending = []
    for step in range(1, scn["steps"] + 1):
        for r in range(world_size):
            set_grads(specs, r, step, list(models[r].ps))
            if (r, step) not in scn.get("skips", ()):
                inners[r].step()
            inners[r].zero_grad()
        for entry in [e for e in pending if e[0] == step]:
            pending.remove(entry)
            land(entry)
        for p in range(F):
            if step % H == (H * (p + 1) // F) % H:
                means = {i: dense_mean([glob[i] - local[r][i] for r in range(world_size)]) for i in frags[p]}
                snaps = [[local[r][i].clone() for i in frags[p]] for r in range(world_size)]
                entry = (step + D, p, means, snaps)
                if D == 0:
                    land(entry)
                else:
                    pending.append(entry)
        if step == scn.get("sync_at"):
            for entry in pending:
                land(entry)
            pending = []
    for entry in pending:
        land(entry)
    return [[p.detach().clone() for p in m.ps] for m in models]


def _tolerance(dtype):
    return {"rtol": 1e-5, "atol": 1e-6} if dtype == F32 else {"rtol": 2e-2, "atol": 1e-3}


def schedules_and_odd_parameters(rank, world_size):
    out = {name: run_scenario(rank, name) for name in SCENARIOS}
    # C6 on the outer exchange: fp16 replicas that each moved by 40000 (their sum, 80000, is past
    # fp16's 65504) and by 1e-7 (below fp16's normal range); one outer step, lr 1, no momentum
    model = ParamsOnly([((2,), F16, True, None)])
    with torch.no_grad():
        model.ps[0].zero_()
    opt = gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=1.0), "none", sync_every=1, outer_lr=1.0,
                         outer_momentum=0.0)
    model.ps[0].grad = torch.tensor([40000.0, 1e-7], dtype=F16)
    opt.step()
    out["fp16_large"] = (model.ps[0].detach().clone(), opt.global_params[0].clone())
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_edge_schedules_and_odd_parameters_follow_the_written_out_loop(world_size):
    results = run_ranks(schedules_and_odd_parameters, world_size, timeout_s=60)
    for name, scn in SCENARIOS.items():
        expected = reference(world_size, name)
        for rank, r in enumerate(results):
            got = r[name]
            assert got["skipped"] == 0, name
            # every rank holds the same global tensors, bit for bit
            assert all(torch.equal(a, b) for a, b in zip(got["global"], results[0][name]["global"])), name
            for i, (a, b) in enumerate(zip(got["params"], expected[rank])):
                assert a.dtype == b.dtype and a.shape == b.shape, (name, i)
                if world_size == 2:  # a / 2 + b / 2: one rounding whatever the order
                    assert torch.equal(a, b), (name, rank, i, a, b)
                else:  # gloo sums three terms in its own order
                    torch.testing.assert_close(a, b, **_tolerance(a.dtype), msg=f"{name} rank {rank} tensor {i}")
            for i, (shape, dtype, trainable, _) in enumerate(scn["specs"]):
                if not trainable:  # frozen: untouched, and still this rank's own value
                    initial = torch.randn(shape, generator=torch.Generator().manual_seed(100 + i)).to(dtype) + rank
                    assert torch.equal(got["params"][i], initial), (name, i)
    for r in results:
        local, glob = r["fp16_large"]
        want = -torch.tensor([40000.0, 1e-7], dtype=F16)  # -(mean pseudo-gradient); 1e-7 is subnormal
        if world_size == 2:
            assert torch.equal(glob, want) and torch.equal(local, want), (glob, local)
        else:
            torch.testing.assert_close(glob, want, rtol=1e-3, atol=1e-7)
        assert bool(torch.isfinite(glob).all()) and glob.dtype == F16


def replicas_of_two_ranks(rank, world_size):
    """Two replicas of two ranks each (the exchange shared out inside a replica: each bucket by
    one of its ranks, then broadcast), on the parameters with empty fragments and buckets."""
    replica_group, outer_group = gradzip.replica_groups(world_size, 2)
    return run_scenario(rank // 2, "odd_params_replace", group=outer_group, replica_group=replica_group)


@pytest.mark.dist
def test_replicas_sharing_the_exchange_with_zero_element_buckets_follow_the_written_out_loop():
    results = run_ranks(replicas_of_two_ranks, 4, timeout_s=60)
    expected = reference(2, "odd_params_replace")
    for rank, r in enumerate(results):
        assert r["skipped"] == 0
        for i, (a, b) in enumerate(zip(r["params"], expected[rank // 2])):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (rank, i, a, b)


def nan_in_a_complex_parameter(rank, world_size):
    """A complex and a real parameter; rank 1's complex gradient holds NaN before the exchange."""
    model = nn.Module()
    model.z = nn.Parameter(torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64))
    model.w = nn.Parameter(torch.ones(3))
    try:
        opt = gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), "none", sync_every=1)
    except ValueError as exc:
        return "refused", str(exc)
    model.z.grad = torch.tensor([complex(float("nan"), 0.0) if rank else 1j, 1.0], dtype=torch.complex64)
    model.w.grad = torch.full((3,), float(rank))
    opt.step()
    return opt.skipped, bool(torch.isfinite(torch.view_as_real(opt.global_params[0])).all())


@pytest.mark.dist
def test_a_nan_in_a_complex_pseudo_gradient_is_skipped_or_complex_is_refused():
    for r in run_ranks(nan_in_a_complex_parameter, 2, timeout_s=30):
        if r[0] == "refused":
            assert "complex" in r[1]
        else:
            assert r == (1, True)


ODD_CODECS = [
    ("topk:ratio=0.5", {"error_feedback": True}),
    ("uniform:bits=4", {"min_compress_bytes": 64}),
    ("powersgd:approx_rank=1", {}),
    ("fp16", {"collective": "allgather"}),
    ("topk:ratio=0.5", {"method": "sparseloco", "outer_lr": 1.0}),
]


def odd_parameters_through_codecs(rank, world_size):
    out = [run_scenario(rank, "odd_params_replace", spec, **kw) for spec, kw in ODD_CODECS]
    # eager updates on the same parameters, no outer momentum: replicas agree after synchronize()
    out.append(run_scenario(rank, "odd_params_replace", "uniform:bits=8", fragments=1, delay=0, eager=True,
                            outer_momentum=0.0))
    return out


@pytest.mark.dist
def test_empty_frozen_half_and_gradientless_parameters_through_lossy_codecs():
    """Not the exact values (the codecs are lossy) but what must hold whatever the codec: no
    crash or hang, every tensor keeps its dtype and shape (zero-element ones stay empty), frozen
    tensors keep this rank's value, everything finite, all ranks on the same global parameters,
    and training moved every non-empty trainable tensor."""
    results = run_ranks(odd_parameters_through_codecs, 2, timeout_s=60)
    specs = SCENARIOS["odd_params_replace"]["specs"]
    for k in range(len(ODD_CODECS) + 1):
        for rank, r in enumerate(results):
            got = r[k]
            assert got["skipped"] == 0, k
            for i, ((shape, dtype, trainable, _), p) in enumerate(zip(specs, got["params"])):
                assert p.dtype == dtype and tuple(p.shape) == shape, (k, i)
                assert bool(torch.isfinite(p.float()).all()), (k, i)
                initial = torch.randn(shape, generator=torch.Generator().manual_seed(100 + i)).to(dtype)
                if not trainable:
                    assert torch.equal(p, initial + rank), (k, i)
                elif p.numel():
                    assert not torch.equal(p, initial), (k, i)
            for a, b in zip(got["global"], results[0][k]["global"]):
                if k < len(ODD_CODECS):
                    assert torch.equal(a, b), k
                else:  # eager: each replica took its own share first, back at synchronize()
                    torch.testing.assert_close(a, b, **_tolerance(a.dtype))


# ----- a non-finite exchange in flight across a checkpoint ---------------------------------------

NAN_SPECS = PLAIN + [((5,), BF16, True, None)]
NAN_CONFIGS = {
    # fragment 0 ({t0, t2, t4}) launches after step 2 with rank 1's bf16 t4 NaN (its fp32 bucket
    # finite); lands after step 5, while fragment 1's exchange (launched after step 4) is in flight
    "carry_overlap": ({"compressor": "topk:ratio=0.5", "error_feedback": True, "sync_every": 4, "fragments": 2,
                       "delay": 3, "carry": True}, 2, 4),
    # fragment 1 ({t1, t3}) launches after step 4 with rank 1's t1 NaN; lands after step 5
    "mix": ({"compressor": "uniform:bits=4", "sync_every": 4, "fragments": 2, "delay": 1, "mix": 0.5}, 4, 1),
}
NAN_STEPS = 10


def _nan_run(rank, name, start, stop, model=None, opt=None, record=None):
    cfg, nan_step, tensor = NAN_CONFIGS[name]
    if model is None:
        model = ParamsOnly(NAN_SPECS)
        opt = gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **cfg)
    params = list(model.ps)
    for step in range(start, stop + 1):
        set_grads(NAN_SPECS, rank, step, params)
        if step == nan_step and rank == 1:
            params[tensor].grad[0] = float("nan")
        opt.step()
        opt.zero_grad()
        if record is not None:
            record[step] = [g.clone() for g in opt.global_params]
    return model, opt


def nan_in_flight_resume(rank, world_size, name):
    record = {}
    model, opt = _nan_run(rank, name, 1, NAN_STEPS, record=record)
    opt.synchronize()
    out = {"final": ([p.detach().clone() for p in model.ps], [g.clone() for g in opt.global_params], opt.skipped),
           "record": record, "resumed": {}}
    for save_at in range(1, NAN_STEPS):
        model, opt = _nan_run(rank, name, 1, save_at)
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "diloco": opt.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=False)
        model = ParamsOnly(NAN_SPECS)
        opt = gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **NAN_CONFIGS[name][0])
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["diloco"])
        model, opt = _nan_run(rank, name, save_at + 1, NAN_STEPS, model, opt)
        opt.synchronize()
        out["resumed"][save_at] = ([p.detach().clone() for p in model.ps], [g.clone() for g in opt.global_params],
                                   opt.skipped)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(NAN_CONFIGS))
def test_a_nonfinite_exchange_in_flight_is_skipped_and_resumes_bit_exact(name):
    cfg, nan_step, tensor = NAN_CONFIGS[name]
    results = run_ranks(nan_in_flight_resume, 2, name, timeout_s=60)
    fragment = tensor % cfg["fragments"]
    landed = nan_step + cfg["delay"]
    initial = [torch.randn(s, generator=torch.Generator().manual_seed(100 + i)).to(d)
               for i, (s, d, _, _) in enumerate(NAN_SPECS)]
    for r in results:
        params, glob, skipped = r["final"]
        assert skipped == 1
        assert all(bool(torch.isfinite(t.float()).all()) for t in params + glob)
        # the skipped fragment's global tensors took no outer step: still the initial ones
        for i in range(fragment, len(NAN_SPECS), cfg["fragments"]):
            assert torch.equal(r["record"][landed][i], initial[i]), i
        # training went on: by the last step both fragments took an outer step
        for p in range(cfg["fragments"]):
            assert any(not torch.equal(r["record"][NAN_STEPS][i], initial[i]) for i in range(p, len(NAN_SPECS), 2)), p
        for save_at, (p2, g2, s2) in r["resumed"].items():
            assert s2 == skipped, save_at
            assert all(torch.equal(a, b) for a, b in zip(p2, params)), save_at
            assert all(torch.equal(a, b) for a, b in zip(g2, glob)), save_at
    assert all(torch.equal(a, b) for a, b in zip(results[0]["final"][1], results[1]["final"][1]))


# ----- DiLoCo: arguments --------------------------------------------------------------------------


def _plain_model():
    return ParamsOnly(PLAIN)


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"sync_every": True}, "sync_every"),
        ({"sync_every": 2.0}, "sync_every"),
        ({"sync_every": "3"}, "sync_every"),
        ({"sync_every": -2}, "sync_every"),
        ({"sync_every": 2**70}, "sync_every"),
        ({"sync_every": 4, "fragments": True}, "fragments"),
        ({"sync_every": 4, "fragments": 2.0}, "fragments"),
        ({"sync_every": 8, "fragments": 5}, "fragments"),  # more fragments than the 4 tensors
        ({"sync_every": 4, "delay": True}, "delay"),
        ({"sync_every": 4, "delay": 1.0}, "delay"),
        ({"sync_every": 1, "delay": 1}, "delay"),
        ({"sync_every": 4, "outer_lr": True}, "outer_lr"),
        ({"sync_every": 4, "outer_lr": -0.1}, "outer_lr"),
        ({"sync_every": 4, "outer_lr": math.inf}, "outer_lr"),
        ({"sync_every": 4, "outer_lr": "0.7"}, "outer_lr"),
        ({"sync_every": 4, "outer_lr": torch.tensor(0.7)}, "outer_lr"),
        ({"sync_every": 4, "outer_momentum": -0.1}, "outer_momentum"),
        ({"sync_every": 4, "outer_momentum": 1.5}, "outer_momentum"),
        ({"sync_every": 4, "outer_momentum": True}, "outer_momentum"),
        ({"sync_every": 4, "outer_momentum": False}, "outer_momentum"),
        ({"sync_every": 4, "outer_momentum": math.nan}, "outer_momentum"),
        ({"sync_every": 4, "mix": True}, "mix"),
        ({"sync_every": 4, "mix": -0.1}, "mix"),
        ({"sync_every": 4, "bucket_cap_mb": True}, "bucket_cap_mb"),
        ({"sync_every": 4, "bucket_cap_mb": math.nan}, "bucket_cap_mb"),
        ({"sync_every": 4, "min_compress_bytes": -1}, "min_compress_bytes"),
        ({"sync_every": 4, "min_compress_bytes": True}, "min_compress_bytes"),
        ({"sync_every": 4, "min_compress_bytes": 1.5}, "min_compress_bytes"),
        ({"sync_every": 4, "compressor": None}, "compressor"),
        ({"sync_every": 4, "compressor": 3}, "compressor"),
        ({"sync_every": 4, "compressor": ""}, "compressor"),
        ({"sync_every": 4, "compressor": " AUTO "}, "compressor"),
        ({"sync_every": 4, "compressor": "topkk"}, "unknown compressor 'topkk'"),
        ({"sync_every": 4, "compressor": "topk:ratio=0"}, "ratio"),
        ({"sync_every": 4, "collective": "bogus"}, "collective"),
        ({"sync_every": 4, "collective": None}, "collective"),
        ({"sync_every": 4, "method": None}, "method"),
        ({"sync_every": 4, "method": "DiLoCo"}, "method"),
        ({"sync_every": 4, "eager": "yes"}, "eager"),
        ({"sync_every": 4, "eager": 1}, "eager"),
        ({"sync_every": 4, "delay": 1, "carry": 1}, "carry"),
        ({"sync_every": 4, "error_feedback": "yes"}, "error_feedback"),
        ({"sync_every": 4, "eager": True, "fragments": 2}, "fragments"),
        ({"sync_every": 4, "eager": True, "delay": 1}, "delay"),
    ],
)
def test_diloco_bad_arguments_raise_value_error_naming_them(kwargs, name):
    model = _plain_model()
    with pytest.raises(ValueError, match=name):
        gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


@pytest.mark.unit
def test_fragments_are_bounded_by_the_trainable_tensors_only():
    """Frozen tensors are not synchronised, so they do not count towards the fragments' bound."""
    specs = [((3,), F32, True, None), ((3,), F32, False, None), ((3,), F32, False, None), ((3,), F32, True, None)]
    model = ParamsOnly(specs)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"fragments must be an integer in \[1, 2\]"):
        gradzip.DiLoCo(model, inner, sync_every=4, fragments=3)
    opt = gradzip.DiLoCo(model, inner, sync_every=4, fragments=2)
    assert [len(f) for f in opt.fragments] == [1, 1]
    assert [tuple(g.shape) for g in opt.global_params] == [(3,), (3,)]


@pytest.mark.unit
def test_an_outer_lr_past_the_half_precision_range_is_refused_for_that_dtype():
    fp16 = ParamsOnly([((3,), F16, True, None), ((3,), F32, True, None)])
    with pytest.raises(ValueError, match=r"outer_lr must be a number in \(0, 65504\]"):
        gradzip.DiLoCo(fp16, torch.optim.SGD(fp16.parameters(), lr=0.1), sync_every=2, outer_lr=70000.0)
    bf16 = ParamsOnly([((3,), BF16, True, None)])
    opt = gradzip.DiLoCo(bf16, torch.optim.SGD(bf16.parameters(), lr=0.1), sync_every=2, outer_lr=1e38)
    assert opt.outer_lr == 1e38 and opt.global_params[0].dtype == BF16


@pytest.mark.unit
@pytest.mark.parametrize("inner", [None, "adamw"])
def test_an_inner_optimizer_that_is_not_an_optimizer_is_refused_by_name(inner):
    model = _plain_model()
    with pytest.raises((ValueError, TypeError), match="inner_optimizer"):
        gradzip.DiLoCo(model, inner, sync_every=2)


# ----- LocalAdamW: one process -------------------------------------------------------------------


def _two_params():
    return [nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(s))) for s in (1, 2)]


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"compressor": None}, "compressor"),
        ({"compressor": 5}, "compressor"),
        ({"compressor": " Auto"}, "compressor"),
        ({"compressor": "edgc:x=1"}, "compressor"),
        ({"compressor": "topk:ratio=-1"}, "ratio"),
        ({"lr": True}, "lr"),
        ({"lr": 0}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"eps": True}, "eps"),
        ({"weight_decay": -1}, "weight_decay"),
        ({"weight_decay": True}, "weight_decay"),
        ({"weight_decay": math.inf}, "weight_decay"),
        ({"betas": (0.9,)}, "betas"),
        ({"betas": (0.9, 0.9, 0.9)}, "betas"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"betas": (0.9, -0.1)}, "betas"),
        ({"betas": (0.9, math.nan)}, "betas"),
        ({"betas": None}, "betas"),
        ({"bucket_cap_mb": True}, "bucket_cap_mb"),
        ({"feedback_decay": True}, "feedback_decay"),
        ({"collective": "bogus"}, "collective"),
    ],
)
def test_local_adamw_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LocalAdamW(_two_params(), **kwargs)


@pytest.mark.unit
@pytest.mark.parametrize("betas", [(False, 0.9), (0.9, False), "00"])
def test_local_adamw_betas_that_are_not_numbers_are_refused(betas):
    with pytest.raises(ValueError, match="betas"):
        LocalAdamW(_two_params(), betas=betas)


@pytest.mark.unit
@pytest.mark.parametrize("betas", [(0.0, 0.0), (0.0, 0.999999), (0.999999, 0.0), (0.999999, 0.999999), (0.9, 0.999)])
def test_local_adamw_constant_gradient_closed_form_at_beta_edges(betas):
    """With one constant gradient ``g`` the bias-corrected moments are ``g`` and ``g**2`` at every
    step, whatever the betas: each step is ``p = p (1 - lr wd) - lr g / (|g| + eps)``."""
    lr, eps, wd = 1e-2, 1e-3, 0.1
    g = torch.tensor([1.0, -2.0, 0.25, 1e-3, 0.0])
    p = nn.Parameter(torch.tensor([0.5, -0.5, 2.0, 0.0, 1.0]))
    opt = LocalAdamW([p], compressor="topk:ratio=0.2", lr=lr, betas=betas, eps=eps, weight_decay=wd)
    expected = p.detach().clone().double()
    for _ in range(3):
        p.grad = g.clone()
        opt.step()
        expected = expected * (1 - lr * wd) - lr * g.double() / (g.double().abs() + eps)
    torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-7)


ADAMW_GROUPS = ({"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-3, "weight_decay": 0.1},
                {"lr": 3e-2, "betas": (0.0, 0.0), "eps": 1e-3, "weight_decay": 0.05})
#: (shape, dtype, group, trainable, step without a gradient on every rank)
ADAMW_SPECS = [((3, 4), F32, 0, True, None), ((4,), F32, 1, True, None), ((5,), F32, 0, True, 2),
               ((0,), F32, 0, True, None), ((2, 3), BF16, 1, True, None), ((3,), F32, 0, False, None),
               ((4,), F16, 1, True, 1)]
ADAMW_STEPS = 5


def _adamw_params():
    return [nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(50 + i)).to(d), requires_grad=t)
            for i, (s, d, _, t, _) in enumerate(ADAMW_SPECS)]


def _adamw_groups(params, **extra):
    return [{"params": [p for p, s in zip(params, ADAMW_SPECS) if s[2] == k], **ADAMW_GROUPS[k], **extra}
            for k in range(2)]


def _adamw_grads(params, rank, step):
    for i, ((shape, dtype, _, trainable, skip), p) in enumerate(zip(ADAMW_SPECS, params)):
        gen = torch.Generator().manual_seed(3001 * rank + 37 * step + i)
        p.grad = None if (not trainable or skip == step) else torch.randn(shape, generator=gen).to(dtype)


def _local_adamw_run(rank, steps, *, bucket_cap_mb=25.0, save_at=None):
    params = _adamw_params()
    opt = LocalAdamW(_adamw_groups(params), compressor="none", bucket_cap_mb=bucket_cap_mb)
    saved = None
    for step in steps:
        if step == save_at:
            saved = copy.deepcopy(([p.detach().clone() for p in params], opt.state_dict()))
        _adamw_grads(params, rank, step)
        opt.step()
        opt.zero_grad()
    return params, opt, saved


def _resumed(rank, saved, steps, *, bucket_cap_mb=25.0):
    params = _adamw_params()
    opt = LocalAdamW(_adamw_groups(params), compressor="none", bucket_cap_mb=bucket_cap_mb)
    with torch.no_grad():
        for p, v in zip(params, saved[0]):
            p.copy_(v)
    opt.load_state_dict(saved[1])
    for step in steps:
        _adamw_grads(params, rank, step)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in params]


@torch.no_grad()
def adamw_reference(world_size: int, steps: int) -> list[torch.Tensor]:
    """LocalAdamW with the identity codec, from torch.optim.AdamW alone: each rank's AdamW, without
    weight decay, steps a shadow tensor set to zero before every step, so the shadow holds that
    rank's update; the shared parameters decay (where they have a gradient) and add the mean."""
    params = _adamw_params()
    shadows = [[torch.zeros_like(p).requires_grad_(p.requires_grad) for p in params] for _ in range(world_size)]
    inner = [torch.optim.AdamW(_adamw_groups(s, weight_decay=0.0), foreach=False) for s in shadows]
    for step in range(steps):
        for rank in range(world_size):
            _adamw_grads(shadows[rank], rank, step)
            for s in shadows[rank]:
                s.zero_()
            inner[rank].step()
        for i, p in enumerate(params):
            if shadows[0][i].grad is not None:
                p.mul_(1 - ADAMW_GROUPS[ADAMW_SPECS[i][2]]["lr"] * ADAMW_GROUPS[ADAMW_SPECS[i][2]]["weight_decay"])
            p.add_(dense_mean([shadows[r][i] for r in range(world_size)]))
    return [p.detach().clone() for p in params]


@pytest.mark.unit
def test_local_adamw_none_at_world_size_1_adds_its_adamw_update_and_resumes_bit_exact():
    """Groups of other lrs and betas (0, 0), a zero-element, a bf16 and an fp16 tensor, a frozen one
    and steps without a gradient: the reference above at world size 1 (no process group), bit for
    bit; a state_dict taken mid-run resumes onto fresh objects bit for bit. (The update is added
    to the decayed parameter, as at any world size; see the half-precision test below for how
    that differs from AdamW's single rounding.)"""
    params, _opt, saved = _local_adamw_run(0, range(ADAMW_STEPS), save_at=3)
    want = adamw_reference(1, ADAMW_STEPS)
    for i, (a, b) in enumerate(zip(params, want)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b), i
    assert torch.equal(params[5].detach(), _adamw_params()[5].detach())  # frozen: untouched
    resumed = _resumed(0, saved, range(3, ADAMW_STEPS))
    assert all(torch.equal(a.detach(), b) for a, b in zip(params, resumed))


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [
    pytest.param(F32, id="fp32"),
    pytest.param(BF16, id="bf16"),
    pytest.param(F16, id="fp16"),
])
def test_local_adamw_at_world_size_1_is_torch_adamw_bit_for_bit_in_every_dtype(dtype):
    """The class docstring: at world size 1 the step is torch.optim.AdamW's (single-tensor path)
    bit for bit."""
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(256, generator=gen).to(dtype)
    ours, theirs = nn.Parameter(init.clone()), nn.Parameter(init.clone())
    opt = LocalAdamW([ours], compressor="none", lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(5):
        grad = torch.randn(256, generator=gen).to(dtype)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    assert torch.equal(ours.detach(), theirs.detach()), int((ours != theirs).sum())


# ----- LocalAdamW: ranks --------------------------------------------------------------------------


def local_adamw_ranks(rank, world_size):
    out = {}
    for cap in (25.0, 0.0):
        params, _opt, saved = _local_adamw_run(rank, range(ADAMW_STEPS), bucket_cap_mb=cap, save_at=3)
        out[cap] = ([p.detach().clone() for p in params], _resumed(rank, saved, range(3, ADAMW_STEPS), bucket_cap_mb=cap))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_local_adamw_none_is_the_mean_of_each_ranks_torch_adamw_update(world_size):
    results = run_ranks(local_adamw_ranks, world_size, timeout_s=60)
    want = adamw_reference(world_size, ADAMW_STEPS)
    for cap in (25.0, 0.0):
        for rank, r in enumerate(results):
            params, resumed = r[cap]
            assert all(torch.equal(a, b) for a, b in zip(params, results[0][cap][0])), (cap, rank)  # ranks agree
            assert all(torch.equal(a, b) for a, b in zip(params, resumed)), (cap, rank)  # exact resume
            for i, (a, b) in enumerate(zip(params, want)):
                assert a.dtype == b.dtype and a.shape == b.shape, i
                if world_size == 2:
                    assert torch.equal(a, b), (cap, rank, i, a, b)
                else:
                    torch.testing.assert_close(a, b, **_tolerance(a.dtype))


MISSING_HYPER = {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.1}


def gradient_missing_on_one_rank(rank, world_size, spec, missing_step):
    """Three parameters; rank 1 has no gradient for the second one at ``missing_step`` only."""
    ps = [nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(i))) for i in range(3)]
    opt = LocalAdamW(ps, compressor=spec, **MISSING_HYPER)
    for step in range(3):
        for i, p in enumerate(ps):
            missing = i == 1 and rank == 1 and step == missing_step
            p.grad = None if missing else torch.full((5,), float(rank + 1))
        opt.step()
    return [p.detach().clone() for p in ps]


def missing_reference(world_size, missing_step):
    """The same three steps written out: each rank's own AdamW moments where it has a gradient,
    its update there (zero where it has none), the mean of the updates, and the weight decay on a
    parameter some rank has a gradient for."""
    lr, eps, wd = MISSING_HYPER["lr"], MISSING_HYPER["eps"], MISSING_HYPER["weight_decay"]
    b1, b2 = 0.9, 0.999
    ps = [torch.randn(5, generator=torch.Generator().manual_seed(i)).double() for i in range(3)]
    moments = {(r, i): (torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64), 0)
               for r in range(world_size) for i in range(3)}
    for step in range(3):
        for i in range(3):
            total = torch.zeros(5, dtype=torch.float64)
            anyone = False
            for r in range(world_size):
                if i == 1 and r == 1 and step == missing_step:
                    continue
                anyone = True
                g = torch.full((5,), float(r + 1), dtype=torch.float64)
                m, v, t = moments[(r, i)]
                m, v, t = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, t + 1
                moments[(r, i)] = (m, v, t)
                total += -lr / (1 - b1**t) * m / ((v / (1 - b2**t)).sqrt() + eps)
            if anyone:
                ps[i] *= 1 - lr * wd
            ps[i] += total / world_size
    return ps


@pytest.mark.dist
@pytest.mark.parametrize("spec", ["none", "topk:ratio=1"])
@pytest.mark.parametrize("missing_step", [0, 1])
def test_local_adamw_a_gradient_missing_on_one_rank_gives_the_mean_with_a_zero_update(spec, missing_step):
    """At the first step (no moments anywhere yet) and at a later one: the ranks agree bit for bit
    and follow the written-out mean, the absent rank adding a zero update and the decay applied as
    some rank had a gradient (Top-K keeping every element is exact too)."""
    results = run_ranks(gradient_missing_on_one_rank, 2, spec, missing_step, timeout_s=20)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    for a, b in zip(results[0], missing_reference(2, missing_step)):
        torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=1e-7)


def _equal_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal_tree(x, y) for x, y in zip(a, b))
    return a == b


def inf_in_one_ranks_bf16_bucket(rank, world_size):
    """An fp32 and a bf16 parameter (a bucket each); at step 2 rank 1's bf16 gradient holds an inf
    while every fp32 bucket is finite. Records what the step left, then retakes it cleanly."""
    a = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))
    b = nn.Parameter(torch.randn(6, generator=torch.Generator().manual_seed(2)).to(BF16))
    opt = LocalAdamW([a, b], compressor="topk:ratio=0.5", lr=1e-2, eps=1e-3)

    def grads(step):
        gen = torch.Generator().manual_seed(97 * rank + step)
        a.grad = torch.randn(3, 4, generator=gen)
        b.grad = torch.randn(6, generator=gen).to(BF16)

    record = None
    for step in range(4):
        grads(step)
        if step == 2:
            before = (a.detach().clone(), b.detach().clone(), copy.deepcopy(opt.state_dict()))
            if rank == 1:
                b.grad[3] = float("inf")
            opt.step()
            after = opt.state_dict()
            record = {"skipped": opt.last_step_skipped, "a": torch.equal(a, before[0]), "b": torch.equal(b, before[1]),
                      "state": _equal_tree(after["state"], before[2]["state"]),
                      "residuals": _equal_tree(after["gradzip"]["exchange"], before[2]["gradzip"]["exchange"]),
                      "counts": (opt.steps_taken, opt.skipped_steps)}
            grads(step)
        opt.step()
    return record, a.detach().clone(), b.detach().clone()


@pytest.mark.dist
def test_local_adamw_an_inf_in_one_ranks_half_bucket_skips_the_step_on_every_rank():
    results = run_ranks(inf_in_one_ranks_bf16_bucket, 2, timeout_s=60)
    for record, _a, _b in results:
        assert record == {"skipped": True, "a": True, "b": True, "state": True, "residuals": True, "counts": (2, 1)}
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[0][2], results[1][2])
    assert all(bool(torch.isfinite(t.float()).all()) for t in results[0][1:])
