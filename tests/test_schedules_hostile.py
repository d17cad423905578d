"""The adaptive schedules as a DDP hook (``auto``, ``kimad``, ``legacy``, ``edgc``) on odd but
legal models and settings, on 2 and 3 gloo ranks.

The model has a matrix, 1-D parameters (buckets of only 1-D tensors under a tiny
``bucket_cap_mb``), a zero-element parameter, a complex parameter and a branch one rank skips
(``find_unused_parameters=True``). Where a schedule's plan is dense, or the ``fp16`` floor, the
result must equal the mean computed here from every rank's own gradient (a shadow copy of the
model runs each rank's batch outside DDP); everywhere the ranks must take the same plan for every
layer at every step and end with the same parameters, bit for bit. Also: bf16 and fp16 models,
a NaN gradient on one rank (every rank skips alike, and later steps go on as a twin that never
ran the step), a checkpoint loaded into a fresh DDP mid-run, LEGACY's phases past
``total_steps``, Kimad's budget at 1 ps, 1 ms and 1e9 ms, EDGC on very short runs, and bad
spec values (a ``ValueError`` naming the parameter, before any collective).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.control.auto import AutoConfig
from gradzip.keys import is_bucket_key
from gradzip.testing import run_ranks

TIMEOUT = 150
TINY_MB = 1e-6  # every parameter a bucket of its own (DDP's rebuilt first bucket aside)
HUGE_MB = 1000.0  # one bucket


# -- the model and the training loop ----------------------------------------------------------


class Odd(nn.Module):
    """A matrix, 1-D parameters, a zero-element one, a complex one, a branch some ranks skip.

    Parameter numbers (``module.parameters()`` order: own parameters first, then children's):
    0 scale (12,), 1 shift (12,), 2 empty (0,), 3 cplx (3, 3) complex, 4 w1.weight (12, 6),
    5 w1.bias (12,), 6 side.weight (12, 12), 7 side.bias (12,), 8 head.weight (3, 12), 9 head.bias (3,).
    """

    def __init__(self, with_complex: bool = True) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 12))
        self.shift = nn.Parameter(torch.linspace(-0.2, 0.2, 12))
        self.empty = nn.Parameter(torch.zeros(0))
        self.with_complex = with_complex
        if with_complex:
            self.cplx = nn.Parameter(torch.randn(3, 3, dtype=torch.complex64) * 0.3)
        self.w1 = nn.Linear(6, 12)
        self.side = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = torch.tanh(self.w1(x)) * self.scale + self.shift + self.empty.sum()
        if use_side:
            h = h + torch.tanh(self.side(h))
        out = self.head(h)
        if self.with_complex:
            c = torch.view_as_real(self.cplx)
            out = out + x[:, :3] @ c[..., 0] + x[:, 3:6] @ c[..., 1]
        return out


class Vectors(nn.Module):
    """Only 1-D parameters (an elementwise affine map and a bias): no matrix for PowerSGD."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.b = nn.Parameter(torch.linspace(-1.0, 1.0, 16))
        self.c = nn.Parameter(torch.zeros(5))

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        return torch.cat([torch.tanh(x * self.a + self.b), self.c.expand(x.shape[0], 5)], dim=1)


def _model(kind: str, dtype: torch.dtype) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = {"odd": lambda: Odd(), "real": lambda: Odd(with_complex=False), "vectors": Vectors}[kind]()
    return model.to(dtype) if dtype != torch.float32 else model


def _batch(kind: str, rank: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    width = 16 if kind == "vectors" else 6
    return torch.randn(5, width, generator=gen).to(dtype)


def _loss(out: torch.Tensor, step: int, decay: bool) -> torch.Tensor:
    loss = out.float().square().mean()
    # decaying gradients let EDGC's warm-up error test pass within a short run
    return loss * 0.5**step if decay else loss


def _use_side(cfg: dict, rank: int, world_size: int, step: int) -> bool:
    return not (cfg.get("unused") and rank == world_size - 1 and step % 2 == 1)


def _state(cfg: dict) -> gradzip.CompressionState:
    return gradzip.CompressionState(cfg["spec"], total_steps=cfg.get("total_steps"), auto=cfg.get("auto"))


def _ddp(cfg: dict, model: nn.Module) -> DDP:
    return DDP(model, bucket_cap_mb=cfg.get("cap_mb", TINY_MB), find_unused_parameters=bool(cfg.get("unused")))


def _plans(record: dict) -> dict[int, str]:
    """Parameter number -> the codec its gradient took this step (per layer, or its bucket's)."""
    out = {}
    for key, entry in record["buckets"].items():
        assert is_bucket_key(key), key
        layers = entry.get("layers")
        for i, number in enumerate(key[1]):
            out[number] = layers[i]["codec"] if layers else f"{entry.get('collective')}/{entry.get('codec')}"
    return out


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _train(rank: int, world_size: int, cfg: dict) -> dict:
    """``cfg["steps"]`` SGD steps of a DDP model through ``cfg["spec"]``'s hook; per step each
    rank's own gradient (a shadow copy outside DDP), DDP's averaged one, the plan, and whether
    the step was skipped; the final parameters.

    ``cfg``: ``spec``, ``steps``, ``kind`` (odd, real, vectors), ``dtype``, ``cap_mb``, ``unused``
    (the last rank skips ``side`` on odd steps), ``total_steps``, ``auto``, ``decay``, ``nan``
    ((rank, step): a NaN in one element of the gradient of ``nan_param``, ``w1.weight`` unless
    given), ``skip`` (a step this twin never runs; its hook's step counter moves on as if it
    had), ``resume_at`` (a checkpoint there, loaded into a fresh model, DDP and state),
    ``prepass`` (one backward pass through DDP before the hook is registered, as the trainer
    does, so that every run sees the rebuilt buckets).
    """
    kind, dtype = cfg.get("kind", "odd"), cfg.get("dtype", torch.float32)
    decay = cfg.get("decay", False)

    def build():
        model = _model(kind, dtype)
        ddp = _ddp(cfg, model)
        if cfg.get("prepass"):
            _loss(ddp(_batch(kind, rank, -1, dtype)), 0, False).backward()
            ddp.zero_grad(set_to_none=True)
        state = _state(cfg).bind(model)
        ddp.register_comm_hook(state, gradzip.compression_hook)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.05))
        return model, ddp, state, opt

    model, ddp, state, opt = build()
    shadow = copy.deepcopy(model)
    out = {"local": [], "avg": [], "plans": [], "skipped": [], "steps": [], "events": []}
    for step in range(cfg["steps"]):
        if step == cfg.get("resume_at"):
            saved = _saved({"model": model.state_dict(), "opt": opt.state_dict(), "state": state.state_dict()})
            del ddp
            model, ddp, state, opt = build()
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            state.load_state_dict(saved["state"])
        if step == cfg.get("skip"):
            state.step += 1  # the twin: this step never ran
            continue
        x = _batch(kind, rank, step, dtype)
        side = _use_side(cfg, rank, world_size, step)
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad(set_to_none=True)
        _loss(shadow(x, side), step, decay).backward()
        out["local"].append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in shadow.parameters()])
        opt.zero_grad(set_to_none=True)
        handle = None
        if cfg.get("nan") == (rank, step):
            def poison(g):
                g = g.clone()
                g.view(-1)[0] = float("nan")
                return g

            handle = model.get_parameter(cfg.get("nan_param", "w1.weight")).register_hook(poison)
        _loss(ddp(x, side), step, decay).backward()
        if handle is not None:
            handle.remove()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        out["avg"].append(grads)
        record = state.metrics.pop()
        out["plans"].append(_plans(record))
        out["events"].extend(e for e in record["events"] if e.get("kind") in ("auto", "plan", "switch"))
        skipped = not all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
        out["skipped"].append(skipped)
        out["steps"].append(step)
        if not skipped:
            opt.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["hook_step"] = state.step
    dist.barrier()
    return out


def _run(world_size: int, cfgs: list[dict]) -> list[list[dict]]:
    """Every config in one spawn: per config, the per-rank results."""
    by_rank = run_ranks(_train_all, world_size, cfgs, timeout_s=TIMEOUT)
    return [[by_rank[r][i] for r in range(world_size)] for i in range(len(cfgs))]


def _train_all(rank: int, world_size: int, cfgs: list[dict]) -> list[dict]:
    return [_train(rank, world_size, cfg) for cfg in cfgs]


# -- what every run must satisfy ---------------------------------------------------------------


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _same_bits(a, b) -> bool:
    """Bit for bit (NaN equal to the same NaN; -0.0 apart from 0.0)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ra, rb = _real(a).reshape(-1), _real(b).reshape(-1)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ra.element_size()]
    return torch.equal(ra.view(view), rb.view(view))


def _check_agreement(results: list[dict], name: str) -> None:
    """Every rank: the same plan for every parameter at every step, the same averaged gradient
    and the same final parameters, bit for bit, each in its parameter's dtype."""
    first = results[0]
    for r in results[1:]:
        assert r["plans"] == first["plans"], name
        assert r["skipped"] == first["skipped"], name
        assert r["hook_step"] == first["hook_step"], name
        for step, (mine, theirs) in enumerate(zip(r["avg"], first["avg"])):
            for i, (a, b) in enumerate(zip(mine, theirs)):
                assert _same_bits(a, b), f"{name}: step {step}, parameter {i} differs across ranks"
        for i, (a, b) in enumerate(zip(r["params"], first["params"])):
            assert _same_bits(a, b), f"{name}: final parameter {i} differs across ranks"
    for step, grads in enumerate(first["avg"]):
        for i, (g, p) in enumerate(zip(grads, first["params"])):
            if g is not None:
                assert g.dtype == p.dtype and g.shape == p.shape, (name, step, i)
    assert all(bool(torch.isfinite(_real(p)).all()) for p in first["params"]), name


def _mean(results: list[dict], step: int, i: int) -> torch.Tensor:
    """The mean over ranks of parameter ``i``'s own gradients at ``step``, each divided by the world
    size first and summed in rank order, in the gradient's dtype (PyTorch's allreduce_hook)."""
    world_size = len(results)
    parts = [_real(r["local"][step][i]) / world_size for r in results]
    total = parts[0].clone()
    for part in parts[1:]:
        total = total + part
    return total


def _fp16_mean(results: list[dict], step: int, i: int) -> torch.Tensor:
    """The fp16 wire's mean: each rank's gradient rounded to fp16, divided, summed in fp16."""
    world_size = len(results)
    parts = [_real(r["local"][step][i]).half() / world_size for r in results]
    total = parts[0].clone()
    for part in parts[1:]:
        total = total + part
    return total.float()  # an fp32 model: the decoded mean comes back in fp32


def _check_mean(results: list[dict], name: str, mean=_mean, rtol: float = 1e-5) -> None:
    """DDP's averaged gradient is ``mean``: bit for bit at 2 ranks (a/2 + b/2 has one order);
    beyond, gloo sums in an order of its own (within ``rtol``: 1e-5 in fp32, 2e-3 in fp16)."""
    exact = len(results) == 2
    for step in range(len(results[0]["avg"])):
        for i, g in enumerate(results[0]["avg"][step]):
            expected = mean(results, step, i)
            if g is None:
                assert not expected.any(), (name, step, i)
                continue
            got = _real(g)
            if exact:
                assert torch.equal(got, expected), f"{name}: step {step}, parameter {i}: {got} != {expected}"
            else:
                assert torch.allclose(got, expected, rtol=rtol, atol=rtol / 10), f"{name}: step {step}, parameter {i}"


# -- dense plans and the fp16 floor: the exact mean ------------------------------------------

EXACT = {
    # LEGACY at ratio 1 in both size groups: Top-K would send more than the raw layer, so dense
    "legacy dense": {"spec": "legacy:policy=1.0/1.0"},
    # Kimad with nothing lighter than dense and a budget no link can exhaust
    "kimad dense": {"spec": "kimad:floor=none,light=none,target_ms=1e9"},
    # EDGC's first window (steps 1 to 5) and step 0 stay dense, whatever it probes later
    "edgc short": {"spec": "edgc:window=3,sample_every=1", "total_steps": 6},
    # accordion between dense and Top-K at ratio 1 (sent dense): a change of codec per bucket
    "auto accordion": {"spec": "auto", "auto": AutoConfig(schedule="accordion", adapt_every=4,
                                                        candidates=("none", "topk:ratio=1.0"))},
}


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_dense_plans_are_the_exact_mean_on_an_odd_model(world_size):
    cfgs = [{**cfg, "steps": 6, "unused": True} for cfg in EXACT.values()]
    cfgs.append({"spec": "kimad:target_ms=1e9", "steps": 6, "unused": True, "cap_mb": HUGE_MB})
    cfgs.append({"spec": "edgc:window=3,sample_every=1,max_rank=4,warmup_steps=0", "steps": 14, "kind": "vectors",
                 "decay": True})
    runs = _run(world_size, cfgs)
    for name, results in zip(EXACT, runs):
        _check_agreement(results, name)
        _check_mean(results, name)
        codecs = {c for plan in results[0]["plans"] for c in plan.values()}
        assert codecs <= {"none", "dense/topk:ratio=1.0", "dense/none", "allreduce/none"}, (name, codecs)
        assert not any(results[0]["skipped"])
    # the fp16 floor of a huge budget: every layer fp16, the mean of the fp16-rounded gradients
    floor = runs[len(EXACT)]
    _check_agreement(floor, "kimad floor")
    assert {c for plan in floor[0]["plans"] for c in plan.values()} == {"fp16"}
    _check_mean(floor, "kimad floor", mean=_fp16_mean, rtol=2e-3)
    # EDGC on a model without a matrix: nothing for PowerSGD, dense to the end
    vectors = runs[-1]
    _check_agreement(vectors, "edgc vectors")
    assert {c for plan in vectors[0]["plans"] for c in plan.values()} == {"none"}
    _check_mean(vectors, "edgc vectors")
    # accordion changed codec (to Top-K at 1.0, sent dense) and every rank took it at the same step
    auto = runs[list(EXACT).index("auto accordion")][0]
    assert any(c == "dense/topk:ratio=1.0" for plan in auto["plans"] for c in plan.values())
    assert any(e["kind"] == "switch" for e in auto["events"])


# -- half-precision models --------------------------------------------------------------------


def _topk_spec(ratio: float, numel: int, itemsize: int) -> str:
    """LEGACY's cell for a layer, by hand: Top-K keeps ``k = clamp(round(ratio * n), 1, n)`` values
    and a 1-byte index each (n <= 256); a layer it would not shrink travels dense."""
    k = min(max(round(ratio * numel), 1), numel)
    return f"topk:ratio={ratio}" if k * (itemsize + 1) < numel * itemsize else "none"


REAL_NUMELS = [12, 12, 0, 72, 12, 144, 12, 36, 3]  # Odd(with_complex=False), by parameter number


@pytest.mark.dist
def test_bf16_and_fp16_models_keep_their_dtype_and_every_rank_agrees():
    accordion = AutoConfig(schedule="accordion", adapt_every=4, candidates=("none", "int8", "powersgd:approx_rank=1"))
    base = [
        {"spec": "legacy:splits=20,policy=0.5/0.25|0.3/0.1", "total_steps": 12},
        {"spec": "kimad:target_ms=1"},
        {"spec": "kimad:target_ms=1e-9,error_every=2"},
        {"spec": "edgc:window=3,sample_every=1,probe_steps=3"},
        {"spec": "auto", "auto": accordion},
    ]
    cfgs = [{**cfg, "steps": 12, "unused": True, "kind": "real", "dtype": dtype}
            for dtype in (torch.bfloat16, torch.float16) for cfg in base]
    dense = [{"spec": "legacy:policy=1.0/1.0", "steps": 4, "kind": "real", "dtype": dtype, "cap_mb": HUGE_MB}
             for dtype in (torch.bfloat16, torch.float16)]
    runs = _run(2, cfgs + dense)
    for cfg, results in zip(cfgs, runs):
        name = f"{cfg['spec']} {cfg['dtype']}"
        _check_agreement(results, name)
        assert not any(results[0]["skipped"]), name
        for grads in results[0]["avg"]:
            assert all(g is None or g.dtype == cfg["dtype"] for g in grads), name
        plans = results[0]["plans"]
        if cfg["spec"].startswith("legacy"):
            # by hand: phase 1 (steps 0-5) and 2 (6-11) of 12; 1-byte indices; the empty layer dense
            for step, plan in enumerate(plans):
                row = (0.5, 0.25) if step < 6 else (0.3, 0.1)
                expected = {i: _topk_spec(row[0] if n < 20 else row[1], n, 2) if n else "none"
                            for i, n in enumerate(REAL_NUMELS)}
                assert plan == expected, (name, step)
            assert plans[0][8] == "none" and plans[11][8] == "topk:ratio=0.3"  # 2 of 3 kept: 6 bytes, not fewer
        if "1e-9" in cfg["spec"]:
            # a half gradient has floor none; nothing fits a budget of 1 ps, so every layer ends at
            # the fewest bytes: Top-K at 0.001 keeps one value and its index (3 bytes)
            assert plans[-1] == {i: "topk:ratio=0.001" if n else "none" for i, n in enumerate(REAL_NUMELS)}, name
        if cfg["spec"] == "auto":
            assert {c.split("/")[1] for c in plans[-1].values()} <= {"int8", "powersgd:approx_rank=1"}, name
    # dense in half precision: divided by the world size, summed in the gradient's dtype
    for results in runs[len(cfgs):]:
        _check_agreement(results, "legacy dense half")
        _check_mean(results, "legacy dense half")


# -- Kimad's budget at its extremes -------------------------------------------------------------

ODD_NUMELS = [12, 12, 0, 18, 72, 12, 144, 12, 36, 3]  # Odd(), by parameter number (complex: its real view)


def _strongest_fp32(numel: int, world_size: int) -> str:
    """By hand, the candidate sending the fewest bytes for an fp32 layer under Kimad's defaults
    (floor fp16, light int8 in groups of 256, Top-K at 0.1, 0.01, 0.001 with 1-byte indices),
    ties to the stronger: fp16 and int8 by ring all_reduce, 2 (W-1) B // W bytes (int8: its scales
    and its codes, each), Top-K by all_gather, (W-1) B."""
    if numel == 0:
        return "fp16"  # nothing to shrink: every level falls back to the floor
    ring = lambda nbytes: 2 * (world_size - 1) * nbytes // world_size  # noqa: E731
    sizes = {"fp16": ring(2 * numel), "int8": ring(4 * -(-numel // 256)) + ring(numel)}
    for ratio in (0.1, 0.01, 0.001):
        k = min(max(round(ratio * numel), 1), numel)
        spec = "topk" if ratio == 0.01 else f"topk:ratio={ratio}"
        if k * 5 < 4 * numel:
            sizes[spec] = (world_size - 1) * k * 5
    order = list(sizes)
    return min(order, key=lambda s: (sizes[s], -order.index(s)))


def _check_low_rank_plan(plan: dict[int, str], name: str) -> None:
    """By hand: under ``codec=powersgd`` at a budget nothing fits, every matrix that compresses at
    rank 1 ((n + m) r < n m on its (shape[0], rest) view) takes rank 1, every other layer dense."""
    matrices = {3: (3, 6), 4: (12, 6), 6: (12, 12), 8: (3, 12)}  # the complex (3, 3) as (3, 3, 2)
    for i in range(len(ODD_NUMELS)):
        rows, cols = matrices.get(i, (0, 0))
        compresses = rows and (rows + cols) * 1 < rows * cols
        assert plan[i] == ("powersgd:approx_rank=1" if compresses else "none"), (name, i, plan[i])


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_kimad_at_a_budget_nothing_fits_sends_every_layer_at_its_fewest_bytes(world_size):
    cfgs = [
        {"spec": "kimad:target_ms=1e-9,error_every=2", "steps": 9, "unused": True},
        {"spec": "kimad:target_ms=1e-9,layerwise=false", "steps": 9, "unused": True, "cap_mb": HUGE_MB},
        {"spec": "kimad:target_ms=1", "steps": 9, "unused": True},
        {"spec": "kimad:codec=powersgd,target_ms=1e-9", "steps": 9, "unused": True, "cap_mb": HUGE_MB},
    ]
    runs = _run(world_size, cfgs)
    for cfg, results in zip(cfgs, runs):
        _check_agreement(results, cfg["spec"])
        assert not any(results[0]["skipped"]), cfg["spec"]
        # until the first decision (step 2), the floor
        assert set(results[0]["plans"][0].values()) <= {"fp16", "none"}, cfg["spec"]
    expected = {i: _strongest_fp32(n, world_size) for i, n in enumerate(ODD_NUMELS)}
    if world_size == 3:
        assert expected[9] == "fp16"  # 3 elements: 8 bytes at fp16 against 9 at int8 and 10 at Top-K
    for results in runs[:2]:
        assert results[0]["plans"][-1] == expected
    _check_low_rank_plan(runs[3][0]["plans"][-1], "kimad powersgd, one bucket")


@pytest.mark.dist
def test_kimad_powersgd_with_a_bucket_of_only_1d_tensors_still_compresses_the_matrices():
    results = _run(2, [{"spec": "kimad:codec=powersgd,target_ms=1e-9", "steps": 9}])[0]
    _check_agreement(results, "kimad powersgd, tiny buckets")
    _check_low_rank_plan(results[0]["plans"][-1], "kimad powersgd, tiny buckets")


# -- a NaN gradient on one rank ------------------------------------------------------------------

NAN_STEP = 7


def _check_twin(run: list[dict], twin: list[dict], skipped: int, name: str) -> None:
    """Per rank: every step but ``skipped`` gave the twin's plan and averaged gradient, and the
    final parameters are the twin's, bit for bit."""
    for a, b in zip(run, twin):
        kept = [j for j, step in enumerate(a["steps"]) if step != skipped]
        assert [a["steps"][j] for j in kept] == b["steps"], name
        for j_a, j_b in zip(kept, range(len(b["steps"]))):
            step = b["steps"][j_b]
            assert a["plans"][j_a] == b["plans"][j_b], f"{name}: step {step}: plan differs from the twin's"
            for i, (x, y) in enumerate(zip(a["avg"][j_a], b["avg"][j_b])):
                assert _same_bits(x, y), f"{name}: step {step}, parameter {i} differs from the twin's"
        for i, (x, y) in enumerate(zip(a["params"], b["params"])):
            assert _same_bits(x, y), f"{name}: final parameter {i} differs from the twin's"


def _check_skip(run: list[dict], step: int, name: str, param: int = 4) -> None:
    """The poisoned parameter's averaged gradient is all NaN on every rank at ``step`` (every rank
    skips it), and no other step is skipped."""
    for r in run:
        assert r["skipped"] == [s == step for s in r["steps"]], name
        assert bool(torch.isnan(r["avg"][r["steps"].index(step)][param]).all()), name


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_nan_on_one_rank_is_skipped_by_every_rank_and_leaves_no_trace(world_size):
    bad = world_size - 1
    base = [
        {"spec": "legacy:splits=20,policy=0.5/0.25|0.3/0.1", "steps": 11, "total_steps": 10, "unused": True},
        {"spec": "legacy:codec=randomk,splits=20,policy=0.5/0.25", "steps": 11, "cap_mb": HUGE_MB},
        {"spec": "kimad:target_ms=1e-9,error_every=2", "steps": 11, "unused": True},
    ]
    cfgs = []
    for cfg in base:
        cfgs += [{**cfg, "nan": (bad, NAN_STEP)}, {**cfg, "skip": NAN_STEP}]
    runs = _run(world_size, cfgs)
    for cfg, run, twin in zip(base, runs[::2], runs[1::2]):
        _check_skip(run, NAN_STEP, cfg["spec"])
        _check_agreement(run, cfg["spec"])
        _check_agreement(twin, cfg["spec"] + " twin")
        assert all(bool(torch.isfinite(_real(g)).all()) for g in run[0]["avg"][-1] if g is not None)
        _check_twin(run, twin, NAN_STEP, cfg["spec"])


@pytest.mark.dist
def test_accordion_decides_after_a_skipped_step_as_if_it_never_ran():
    accordion = AutoConfig(schedule="accordion", adapt_every=4, candidates=("none", "topk:ratio=0.3", "powersgd:approx_rank=1"))
    cfg = {"spec": "auto", "auto": accordion, "steps": 12}  # windows [1, 5), [5, 9), [9, 13): the NaN inside one
    run, twin = _run(2, [{**cfg, "nan": (1, NAN_STEP)}, {**cfg, "skip": NAN_STEP}])
    _check_skip(run, NAN_STEP, "accordion")
    _check_agreement(run, "accordion")
    _check_twin(run, twin, NAN_STEP, "accordion")


@pytest.mark.dist
def test_edgc_warmup_does_not_price_a_skipped_step():
    cfg = {"spec": "edgc:window=3,sample_every=1,max_rank=4,warmup_steps=0", "steps": 18, "decay": True}
    step = 5  # the first window's last step, where the rank-4 error is measured
    run, twin = _run(2, [{**cfg, "nan": (1, step), "nan_param": "side.weight"}, {**cfg, "skip": step}])
    _check_skip(run, step, "edgc", param=6)
    _check_agreement(run, "edgc")
    _check_twin(run, twin, step, "edgc")


# -- a checkpoint loaded into a fresh DDP mid-run ------------------------------------------------

ACCORDION = AutoConfig(schedule="accordion", adapt_every=4, candidates=("none", "topk:ratio=0.3", "powersgd:approx_rank=1"))
RESUMED = {
    # per-layer codecs do not depend on DDP's layout: exact even where the fresh DDP starts from
    # its first layout (no pass before the hook)
    "legacy": {"spec": "legacy:splits=20,policy=0.5/0.25|0.3/0.1", "steps": 10, "total_steps": 10,
               "unused": True, "resume_at": 4},
    "legacy one bucket": {"spec": "legacy:splits=20,policy=0.5/0.25|0.3/0.1", "steps": 10, "total_steps": 10,
                          "cap_mb": HUGE_MB, "resume_at": 6},
    # resumed in its compressing phase (warm-up passed at step 12)
    "edgc": {"spec": "edgc:window=3,sample_every=1,max_rank=4,warmup_steps=0", "steps": 18, "decay": True,
             "resume_at": 14},
    # a codec per bucket: the trainer's pass before the hook gives the fresh DDP the same buckets
    "accordion": {"spec": "auto", "auto": ACCORDION, "steps": 12, "resume_at": 7, "prepass": True},
}


@pytest.mark.dist
def test_a_checkpoint_loaded_into_a_fresh_ddp_goes_on_exactly():
    cfgs = []
    for cfg in RESUMED.values():
        cfgs += [cfg, {k: v for k, v in cfg.items() if k != "resume_at"}]
    # Kimad plans from timing: a resumed run must agree across ranks and stay finite
    cfgs.append({"spec": "kimad:target_ms=1", "steps": 9, "resume_at": 5, "prepass": True, "unused": True})
    runs = _run(2, cfgs)
    for i, name in enumerate(RESUMED):
        resumed, straight = runs[2 * i], runs[2 * i + 1]
        _check_agreement(resumed, name)
        _check_twin(resumed, straight, -1, name)
        assert resumed[0]["hook_step"] == straight[0]["hook_step"] == RESUMED[name]["steps"]
    # EDGC was compressing across the checkpoint
    edgc = runs[2 * list(RESUMED).index("edgc")][0]["plans"]
    assert edgc[13][6].startswith("powersgd") and edgc[14][6].startswith("powersgd")
    _check_agreement(runs[-1], "kimad resumed")


@pytest.mark.dist
def test_legacy_resumed_on_3_ranks_agrees_and_stays_close():
    cfg = RESUMED["legacy"]
    resumed, straight = _run(3, [cfg, {k: v for k, v in cfg.items() if k != "resume_at"}])
    _check_agreement(resumed, "legacy 3 ranks")
    assert resumed[0]["plans"] == straight[0]["plans"]
    for a, b in zip(resumed[0]["params"], straight[0]["params"]):
        assert torch.allclose(_real(a), _real(b), rtol=1e-5, atol=1e-6)


@pytest.mark.dist
def test_kimad_checkpoint_loaded_into_a_fresh_ddp_without_a_prepass():
    try:
        resumed = _run(2, [{"spec": "kimad:target_ms=1e-9", "steps": 8, "resume_at": 4}])[0]
    except RuntimeError as exc:
        assert "not enough values to unpack" not in str(exc), "the resumed run crashed reading a late decision"
        raise
    _check_agreement(resumed, "kimad resumed")


# -- LEGACY's phases past total_steps, EDGC on short runs ---------------------------------------


def _legacy_phase(step: int, total: int, phases: int) -> int:
    """By hand: the first phase ``i`` with ``step < (i + 1) * total / phases``, else the last."""
    return next((i for i in range(phases) if step * phases < (i + 1) * total), phases - 1)


@pytest.mark.dist
def test_legacy_phases_when_the_run_outlasts_total_steps():
    policy = ((0.5, 0.25), (0.3, 0.1), (0.2, 0.05))
    text = "|".join("/".join(map(str, row)) for row in policy)
    cfgs = [
        # from CompressionState(total_steps=...): 3 phases over 5 steps, 9 run
        {"spec": f"legacy:splits=20,policy={text}", "total_steps": 5, "steps": 9, "unused": True},
        # the spec's total_steps wins over the state's; fewer steps than phases
        {"spec": f"legacy:splits=20,policy={text},total_steps=2", "total_steps": 100, "steps": 6},
    ]
    runs = _run(2, cfgs)
    for cfg, total, results in zip(cfgs, (5, 2), runs):
        _check_agreement(results, cfg["spec"])
        for step, plan in enumerate(results[0]["plans"]):
            row = policy[_legacy_phase(step, total, 3)]
            expected = {i: _topk_spec(row[0] if n < 20 else row[1], n, 4) if n else "none"
                        for i, n in enumerate(ODD_NUMELS)}
            assert plan == expected, (cfg["spec"], step)
    # by hand: 5 steps in 3 phases are steps 0-1, 2-3, 4 on; 2 steps: 0, 1, 2 on
    assert [_legacy_phase(s, 5, 3) for s in range(7)] == [0, 0, 1, 1, 2, 2, 2]
    assert runs[0][0]["plans"][8][6] == "topk:ratio=0.05" and runs[1][0]["plans"][1][6] == "topk:ratio=0.1"


@pytest.mark.dist
def test_edgc_runs_shorter_than_its_windows_stay_dense_and_exact():
    cfgs = [
        # the paper's window of 1000 steps and a warm-up of 10% of a 4-step run
        {"spec": "edgc", "total_steps": 4, "steps": 4, "unused": True},
        # probing from step 6 at rank 2; a run of 6 steps ends first
        {"spec": "edgc:window=3,sample_every=1,probe_steps=3", "steps": 6, "cap_mb": HUGE_MB},
    ]
    for cfg, results in zip(cfgs, _run(2, cfgs)):
        _check_agreement(results, cfg["spec"])
        assert {c for plan in results[0]["plans"] for c in plan.values()} == {"none"}
        _check_mean(results, cfg["spec"])


@pytest.mark.dist
def test_edgc_window_of_2_decides_every_2_steps_or_is_refused():
    spec = "edgc:window=2,sample_every=1,max_rank=4,warmup_steps=0"
    try:
        gradzip.CompressionState(spec)
    except ValueError as exc:
        assert "window" in str(exc)
        return
    results = _run(2, [{"spec": spec, "steps": 13, "decay": True}])[0]
    decided = sorted({e["step"] for e in results[0]["events"] if e["kind"] == "auto"})
    assert decided[0] == 6  # the first window, steps 1 to 5
    assert all(b - a == 2 for a, b in zip(decided, decided[1:])), decided


# -- bad spec values: ValueError naming the parameter, before any collective ----------------------

BAD_SPECS = [
    ("kimad:target_ms=0", "target_ms"), ("kimad:target_ms=-5", "target_ms"), ("kimad:target_ms=fast", "target_ms"),
    ("kimad:target_ms=nan", "target_ms"), ("kimad:target_ms=inf", "target_ms"),
    ("kimad:hysteresis=-0.1", "hysteresis"), ("kimad:hysteresis=nan", "hysteresis"),
    ("kimad:half_life=0", "half_life"), ("kimad:half_life=inf", "half_life"),
    ("kimad:error_every=0", "error_every"), ("kimad:error_every=1.5", "error_every"),
    ("kimad:error_every=true", "error_every"), ("kimad:units=9", "units"), ("kimad:units=100001", "units"),
    ("kimad:link_every=0", "link_every"), ("kimad:link_every=1001", "link_every"),
    ("kimad:layerwise=1", "layerwise"), ("kimad:light_floor=maybe", "light_floor"),
    ("kimad:floor=int8", "floor"), ("kimad:light=topk", "light"), ("kimad:light=bogus", "light"),
    ("kimad:light=separate", "light"), ("kimad:levels=", "levels"), ("kimad:levels=a/b", "levels"),
    ("kimad:levels=0", "ratio"), ("kimad:levels=2", "ratio"), ("kimad:levels=0.1/nan", "ratio"),
    ("kimad:codec=separate", "codec"), ("kimad:codec=bogus", "codec"), ("kimad:codec=fp16", "codec"),
    ("kimad:codec=powersgd,floor=fp16", "floor"), ("kimad:codec=powersgd,light=int8", "light"),
    ("kimad:codec=powersgd,levels=0", "approx_rank"), ("kimad:codec=powersgd,levels=1.5", "levels"),
    ("kimad:bogus=1", "bogus"),
    ("legacy:splits=0", "splits"), ("legacy:splits=-3", "splits"), ("legacy:splits=10.5", "splits"),
    ("legacy:splits=abc", "splits"), ("legacy:splits=100/50,policy=0.1/0.01/0.001", "splits"),
    ("legacy:policy=0.1", "policy"), ("legacy:policy=0.1/0.01|0.1", "policy"), ("legacy:policy=x/y", "policy"),
    ("legacy:policy=2/0.1", "ratio"), ("legacy:policy=0/0.1", "ratio"), ("legacy:policy=0.1/nan", "ratio"),
    ("legacy:policy=0.1/0.01|0.05/0.005,total_steps=0", "total_steps"),
    ("legacy:policy=0.1/0.01|0.05/0.005,total_steps=2.5", "total_steps"),
    ("legacy:codec=powersgd,policy=0/1", "approx_rank"), ("legacy:codec=powersgd,policy=1.5/2", "policy"),
    ("legacy:codec=bogus", "codec"), ("legacy:codec=fp16", "codec"), ("legacy:bogus=1", "bogus"),
    ("edgc:max_rank=2", "max_rank"), ("edgc:max_rank=-1", "max_rank"), ("edgc:max_rank=true", "max_rank"),
    ("edgc:window=1", "window"), ("edgc:window=2.5", "window"), ("edgc:window=4,sample_every=3", "window"),
    ("edgc:sample_every=0", "sample_every"), ("edgc:stride=0", "stride"), ("edgc:bins=1", "bins"),
    ("edgc:rank_step=1", "rank_step"), ("edgc:probe_steps=2", "probe_steps"), ("edgc:warmup_steps=-1", "warmup_steps"),
    ("edgc:warmup_fraction=1.5", "warmup_fraction"), ("edgc:warmup_fraction=nan", "warmup_fraction"),
    ("edgc:total_steps=-3", "total_steps"), ("edgc:bogus=1", "bogus"),
    pytest.param("legacy:total_steps=-1", "total_steps"),
]


def _refused(make, name: str) -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError) as info:
        make()
    assert name in str(info.value), str(info.value)
    assert "process group" not in str(info.value)  # refused before it needed one


@pytest.mark.unit
@pytest.mark.parametrize(("spec", "name"), BAD_SPECS)
def test_a_bad_spec_value_is_refused_naming_it_before_any_collective(spec, name):
    _refused(lambda: gradzip.CompressionState(spec), name)


@pytest.mark.unit
@pytest.mark.parametrize(("spec", "total_steps"), [
    ("legacy:policy=0.1/0.01|0.05/0.005", None),  # several phases need the run's length
    ("legacy:policy=0.1/0.01|0.05/0.005", 0),
    ("legacy:policy=0.1/0.01|0.05/0.005", -2),
    ("edgc", -1),
    ("edgc", 2.5),
    ("edgc", True),
    pytest.param("legacy:policy=0.1/0.01|0.05/0.005", True),
])
def test_a_bad_total_steps_is_refused_naming_it(spec, total_steps):
    _refused(lambda: gradzip.CompressionState(spec, total_steps=total_steps), "total_steps")


@pytest.mark.unit
@pytest.mark.parametrize(("config", "name"), [
    (AutoConfig(adapt_every=3), "adapt_every"), (AutoConfig(schedule="kimad"), "schedule"),
    (AutoConfig(max_error=float("nan")), "max_error"), (AutoConfig(trial_steps=2), "trial_steps"),
    (AutoConfig(min_gain=1.0), "min_gain"), (AutoConfig(candidates=("none",)), "candidates"),
    (AutoConfig(candidates=("fp16", "radius")), "candidates"), (AutoConfig(candidates=("topk:ratio=0",)), "ratio"),
])
def test_a_bad_auto_setting_is_refused_naming_it_before_any_collective(config, name):
    _refused(lambda: gradzip.CompressionState("auto", auto=config), name)
