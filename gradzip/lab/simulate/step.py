"""The step model: compute, bucketed communication overlapped with backward, codec work, optimizer.

DDP (``strategy="ddp"``): buckets form as PyTorch's DDP forms them (parameters in reverse
registration order, a first bucket capped at 1 MiB, then ``bucket_cap_mb``; a bucket closes once
it reaches its cap). Backward time is spread over parameters by their matmul FLOPs, so a bucket is
ready when the backward of its parameters is done. Two resources run side by side:

- the compute stream: forward, then per bucket its share of backward and its encoding, then,
  after backward, each bucket's decoding once its collectives are done;
- the network: each bucket's collectives, one bucket after the other, starting when the bucket
  is encoded and the previous bucket's collectives are done.

The step ends with the optimizer step (Adam reads parameter, gradient and two moments and writes
three back: 28 bytes per parameter at the GPU's memory bandwidth). Exposed communication is the
step time minus the work of the compute stream; the communication share is that over the step.

FSDP (``strategy="fsdp"``, FSDP2 ``fully_shard`` per transformer block plus the root): parameters
(bf16) are all_gathered before each block's forward and again before its backward (prefetched
one block ahead), gradients go to their shard owners after each block's backward, and the
optimizer step works on ``1 / p`` of the parameters.

``onebit-adam``: a warm-up fraction of dense DDP steps; then backward exchanges nothing and the
optimizer runs the two-phase 1-bit exchange of the momenta (one per parameter tensor, as
:class:`gradzip.optim.OneBitAdam` does, or one fused buffer), not overlapped with compute. The
reported step time is the mean over a run.

DiLoCo (``diloco:sync_every=H[,fragments=F,delay=D]+CODEC``): every step is forward, backward and
the inner AdamW with no exchange; every ``H`` steps each of the ``F`` fragments (parameter tensors
strided, as :mod:`gradzip.outer.schedule` cuts them) sends its fp32 pseudo-gradient through the
codec, in buckets of ``bucket_cap_mb``, then takes the outer step (counted as one more optimizer
pass over the fragment). Encoding, decoding and the outer step run on the compute stream; the
collectives of a fragment overlap the next ``D`` steps' compute, so only what outlasts them is
exposed, and fragments in flight together share the link: a cycle exposes at least what its
collectives take beyond ``H`` steps' compute. The reported step time is the mean over a cycle;
bytes are per step (per ``H`` steps over ``H``).

Assumptions the model makes (stated in the README with the projection): compute is
``6 N + 12 L d T`` FLOPs per token at a fixed model FLOPs utilisation, forward is a third of it;
collectives do not slow the compute they overlap with; codec work runs on the compute stream at
a fixed throughput in bytes of dense gradient per second; no pipeline or tensor parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from gradzip.compressors.kernels import wire
from gradzip.lab.simulate.collectives import Fabric
from gradzip.lab.simulate.exchange import Exchange, Method, dense_exchange
from gradzip.lab.simulate.presets import ModelShapes

STRATEGIES = ("ddp", "fsdp")
MIB = 1 << 20
#: bytes of memory traffic per parameter for an fp32 Adam step (read p, g, m, v; write p, m, v)
ADAM_BYTES_PER_PARAM = 28
#: bytes per parameter held per GPU by mixed-precision Adam: fp32 weights, gradients, two moments
MODEL_STATE_BYTES_PER_PARAM = 16


@dataclass(frozen=True)
class CodecSpeed:
    """Codec throughput, bytes of dense gradient per second.

    Attributes:
        encode_bytes_per_s: dense bytes compressed per second.
        decode_bytes_per_s: dense bytes decompressed per second.
        source: ``assumed``, ``given`` or ``measured ...``.
    """

    encode_bytes_per_s: float
    decode_bytes_per_s: float
    source: str = "given"

    def __post_init__(self) -> None:
        for name in ("encode_bytes_per_s", "decode_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0; got {value}")

    def seconds(self, exchange: Exchange) -> tuple[float, float]:
        """Encode and decode seconds of ``exchange``."""
        return exchange.encode_bytes / self.encode_bytes_per_s, exchange.decode_bytes / self.decode_bytes_per_s


@dataclass(frozen=True)
class Workload:
    """What one GPU computes per step.

    Attributes:
        model: parameter shapes.
        tokens_per_gpu: tokens each GPU processes per step (>= 1).
        peak_flops: the GPU's dense peak, FLOP/s.
        mfu: model FLOPs utilisation in (0, 1].
        hbm_bytes_per_s: GPU memory bandwidth, for the optimizer step.
        compute_s: forward + backward seconds per step; None derives it from FLOPs and ``mfu``.
        optimizer_s: optimizer seconds per step (unsharded); None derives it from the bandwidth.
        grad_dtype: dtype of the gradients DDP reduces.
        bucket_cap_mb: DDP's bucket cap, MiB.
        first_bucket_mb: DDP's first bucket cap, MiB (PyTorch: 1).
        param_gather_bytes: bytes per parameter FSDP all_gathers (bf16: 2).
    """

    model: ModelShapes
    tokens_per_gpu: int
    peak_flops: float
    mfu: float = 0.4
    hbm_bytes_per_s: float = 3.35e12
    compute_s: float | None = None
    optimizer_s: float | None = None
    grad_dtype: torch.dtype = torch.float32
    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0
    param_gather_bytes: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.tokens_per_gpu, bool) or not isinstance(self.tokens_per_gpu, int) or self.tokens_per_gpu < 1:
            raise ValueError(f"tokens_per_gpu must be an integer >= 1; got {self.tokens_per_gpu!r}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1]; got {self.mfu}")
        if self.compute_s is not None and not self.compute_s >= 0:
            raise ValueError(f"compute_s must be >= 0; got {self.compute_s}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0; got {self.bucket_cap_mb}")

    def fwd_bwd_s(self) -> float:
        """Forward + backward seconds per step."""
        if self.compute_s is not None:
            return self.compute_s
        return self.model.flops_per_token() * self.tokens_per_gpu / (self.peak_flops * self.mfu)

    def optimizer_step_s(self, shards: int = 1) -> float:
        """Optimizer seconds per step when each GPU updates ``1 / shards`` of the parameters."""
        if self.optimizer_s is not None:
            return self.optimizer_s / shards
        return self.model.numel * ADAM_BYTES_PER_PARAM / self.hbm_bytes_per_s / shards


@dataclass
class StepResult:
    """One method's predicted step at one world size.

    Attributes are seconds per step unless named otherwise; ``comm_share`` is
    ``exposed_comm_s / step_s``; bytes are per GPU per step.
    """

    method: str
    strategy: str
    world_size: int
    step_s: float
    compute_s: float
    optimizer_s: float
    codec_s: float
    comm_s: float
    exposed_comm_s: float
    payload_bytes: float
    sent_bytes: float
    collectives: str
    detail: dict = field(default_factory=dict)

    @property
    def comm_share(self) -> float:
        """Fraction of the step in which compute waits for the network."""
        return self.exposed_comm_s / self.step_s if self.step_s > 0 else 0.0

    def as_dict(self) -> dict:
        """Plain fields plus ``comm_share``, for JSON."""
        out = asdict(self)
        out["comm_share"] = self.comm_share
        return out


# Grouping ---------------------------------------------------------------------------------------


def ddp_buckets(model: ModelShapes, dtype: torch.dtype, bucket_cap_mb: float, first_bucket_mb: float = 1.0) -> list[list[tuple[str, tuple[int, ...]]]]:
    """DDP's buckets in the order their gradients become ready (last parameters first).

    A bucket takes parameters in reverse registration order until its bytes reach the cap: the
    first cap is ``first_bucket_mb``, every later one ``bucket_cap_mb`` (MiB).
    """
    item = wire.dtype_nbytes(dtype)
    buckets: list[list[tuple[str, tuple[int, ...]]]] = []
    current: list[tuple[str, tuple[int, ...]]] = []
    size = 0
    for name, shape in reversed(model.params):
        current.append((name, shape))
        size += math.prod(shape) * item
        cap = (first_bucket_mb if not buckets else bucket_cap_mb) * MIB
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def compute_weight(model: ModelShapes, name: str, shape: tuple[int, ...]) -> int:
    """Share of compute a parameter stands for: its size, or 0 for a pure embedding lookup."""
    return 0 if name in model.lookup_params else math.prod(shape)


def fsdp_units(model: ModelShapes) -> tuple[list[tuple[str, tuple[int, ...]]], list[list[tuple[str, tuple[int, ...]]]]]:
    """The root unit (embeddings, final norm, head) and one unit per transformer block, in forward order."""
    root: list[tuple[str, tuple[int, ...]]] = []
    blocks: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in model.params:
        index = model.block_of(name)
        if index is None:
            root.append((name, shape))
        else:
            blocks.setdefault(index, []).append((name, shape))
    return root, [blocks[i] for i in sorted(blocks)]


# The models -------------------------------------------------------------------------------------


def simulate_step(
    method: Method,
    workload: Workload,
    fabric: Fabric,
    world_size: int,
    codec_speed: CodecSpeed,
    *,
    strategy: str = "ddp",
    algorithm: str = "auto",
    collective: str = "auto",
) -> StepResult:
    """Predict one training step of ``method`` on ``world_size`` GPUs.

    Args:
        method: the codec (or ``onebit-adam``).
        workload: model, tokens and compute per GPU.
        fabric: the network.
        world_size: GPUs, >= 1.
        codec_speed: encode and decode throughput.
        strategy: ``ddp`` or ``fsdp``.
        algorithm: all_reduce algorithm (see :meth:`Fabric.all_reduce_s`).
        collective: for non-aggregatable codecs, ``allgather``, ``twophase`` or ``auto`` (the
            faster per bucket).

    Raises:
        ValueError: for an unknown strategy, or ``onebit-adam`` or DiLoCo with FSDP.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1; got {world_size!r}")
    if strategy == "fsdp" and method.outer is not None:
        raise ValueError(f"{method.spec}: DiLoCo replicates the model; it is modelled with strategy ddp only")
    if strategy == "fsdp":
        return _fsdp_step(method, workload, fabric, world_size, codec_speed, algorithm)
    if method.outer is not None:
        return _diloco_step(method, workload, fabric, world_size, codec_speed, algorithm, collective)
    if method.onebit_adam:
        return _onebit_adam_step(method, workload, fabric, world_size, codec_speed, algorithm)
    return _ddp_step(method, workload, fabric, world_size, codec_speed, algorithm, collective)


def _pick(candidates: Sequence[Exchange], fabric: Fabric, p: int, speed: CodecSpeed, algorithm: str) -> Exchange:
    def total_s(ex: Exchange) -> float:
        return ex.comm_s(fabric, p, algorithm) + sum(speed.seconds(ex))

    return min(candidates, key=total_s)


def _summary(exchanges: Sequence[Exchange]) -> str:
    names = []
    for ex in exchanges:
        if ex.method not in names and ex.method != "none":
            names.append(ex.method)
    return "+".join(names) if names else "none"


def overlapped_step(
    fwd_s: float,
    bwd_shares_s: Sequence[float],
    encode_s: Sequence[float],
    comm_s: Sequence[float],
    decode_s: Sequence[float],
    optimizer_s: float,
) -> tuple[float, float]:
    """The DDP timeline: returns ``(step_s, network busy seconds)``.

    Bucket ``i`` is encoded right after its share of backward on the compute stream; its
    collectives start when it is encoded and the network is free; its decode runs on the compute
    stream after backward and after its collectives. The optimizer follows the last decode.
    """
    t = fwd_s
    network_free = 0.0
    comm_end = []
    for share, enc, comm in zip(bwd_shares_s, encode_s, comm_s):
        t += share + enc
        network_free = max(t, network_free) + comm
        comm_end.append(network_free)
    done = t
    for end, dec in zip(comm_end, decode_s):
        done = max(done, end) + dec
    return done + optimizer_s, sum(comm_s)


def _ddp_step(method, workload, fabric, p, speed, algorithm, collective) -> StepResult:
    buckets = ddp_buckets(workload.model, workload.grad_dtype, workload.bucket_cap_mb, workload.first_bucket_mb)
    exchanges = [
        _pick(method.ddp_candidates([s for _, s in b], workload.grad_dtype, p, collective), fabric, p, speed, algorithm)
        for b in buckets
    ]
    return _ddp_result(method.spec, workload, fabric, p, speed, algorithm, buckets, exchanges)


def _ddp_result(spec, workload, fabric, p, speed, algorithm, buckets, exchanges) -> StepResult:
    model = workload.model
    total_weight = sum(compute_weight(model, n, s) for b in buckets for n, s in b) or 1
    fwd_bwd = workload.fwd_bwd_s()
    fwd, bwd = fwd_bwd / 3, fwd_bwd * 2 / 3
    shares = [bwd * sum(compute_weight(model, n, s) for n, s in b) / total_weight for b in buckets]
    codec = [speed.seconds(ex) for ex in exchanges]
    comm = [ex.comm_s(fabric, p, algorithm) for ex in exchanges]
    opt = workload.optimizer_step_s()
    step, busy = overlapped_step(fwd, shares, [c[0] for c in codec], comm, [c[1] for c in codec], opt)
    codec_s = sum(e + d for e, d in codec)
    return StepResult(
        method=spec,
        strategy="ddp",
        world_size=p,
        step_s=step,
        compute_s=fwd_bwd,
        optimizer_s=opt,
        codec_s=codec_s,
        comm_s=busy,
        exposed_comm_s=max(step - fwd_bwd - opt - codec_s, 0.0),
        payload_bytes=sum(ex.payload_bytes for ex in exchanges),
        sent_bytes=sum(ex.sent_bytes(p) for ex in exchanges),
        collectives=_summary(exchanges),
        detail={"buckets": len(buckets)},
    )


def _onebit_adam_step(method, workload, fabric, p, speed, algorithm) -> StepResult:
    model = workload.model
    buckets = ddp_buckets(model, workload.grad_dtype, workload.bucket_cap_mb, workload.first_bucket_mb)
    dense = [dense_exchange(sum(math.prod(s) for _, s in b), workload.grad_dtype) for b in buckets]
    warm = _ddp_result("none", workload, fabric, p, speed, algorithm, buckets, dense)
    # Compressed phase: backward without communication, then the momenta's two-phase exchanges,
    # all launched at once and carried one after the other by the network.
    exchanges = method.onebit_momentum_exchanges([s for _, s in model.params], p)
    enc = sum(speed.seconds(ex)[0] for ex in exchanges)
    dec = sum(speed.seconds(ex)[1] for ex in exchanges)
    comm = sum(ex.comm_s(fabric, p, algorithm) for ex in exchanges)
    sent = sum(ex.sent_bytes(p) for ex in exchanges)
    payload = sum(ex.payload_bytes for ex in exchanges)
    fwd_bwd, opt = workload.fwd_bwd_s(), workload.optimizer_step_s()
    compressed_step = fwd_bwd + enc + comm + dec + opt
    w = method.warmup_fraction
    return StepResult(
        method=method.spec,
        strategy="ddp",
        world_size=p,
        step_s=w * warm.step_s + (1 - w) * compressed_step,
        compute_s=fwd_bwd,
        optimizer_s=opt,
        codec_s=(1 - w) * (enc + dec),
        comm_s=w * warm.comm_s + (1 - w) * comm,
        exposed_comm_s=w * warm.exposed_comm_s + (1 - w) * comm,
        payload_bytes=w * warm.payload_bytes + (1 - w) * payload,
        sent_bytes=w * warm.sent_bytes + (1 - w) * sent,
        collectives=f"{w:.0%} dense, then twophase" + (" (fused)" if method.fused else f" x{len(exchanges)}"),
        detail={
            "warmup_fraction": w,
            "warmup_step_s": warm.step_s,
            "compressed_step_s": compressed_step,
            "compressed_sent_bytes": sent,
            "compressed_comm_s": comm,
        },
    )


def fragment_buckets(params: Sequence[tuple[str, tuple[int, ...]]], cap_bytes: float) -> list[list[tuple[int, ...]]]:
    """Shapes of consecutive fp32 tensors in buckets of at most ``cap_bytes`` (a larger tensor
    alone), as :func:`gradzip.outer.exchange.make_buckets` lays out one fragment."""
    buckets: list[list[tuple[int, ...]]] = []
    current: list[tuple[int, ...]] = []
    size = 0
    for _, shape in params:
        nbytes = math.prod(shape) * 4
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(shape)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _diloco_step(method, workload, fabric, p, speed, algorithm, collective) -> StepResult:
    schedule = method.outer
    h, f, d = schedule.sync_every, schedule.fragments, schedule.delay
    model = workload.model
    fwd_bwd, opt = workload.fwd_bwd_s(), workload.optimizer_step_s()
    inner_step = fwd_bwd + opt
    exposed = codec_s = comm_s = payload = sent = late = 0.0
    for fragment in range(f):
        params = model.params[fragment::f]
        exchanges = [
            _pick(method.ddp_candidates(shapes, torch.float32, p, collective), fabric, p, speed, algorithm)
            for shapes in fragment_buckets(params, workload.bucket_cap_mb * MIB)
        ]
        work = sum(sum(speed.seconds(ex)) for ex in exchanges)
        comm = sum(ex.comm_s(fabric, p, algorithm) for ex in exchanges)
        outer = opt * sum(math.prod(s) for _, s in params) / model.numel
        exposed += work + outer
        late += max(0.0, comm - d * inner_step)
        codec_s += work
        comm_s += comm
        payload += sum(ex.payload_bytes for ex in exchanges)
        sent += sum(ex.sent_bytes(p) for ex in exchanges)
    # Each fragment's collectives overlap the d inner steps after its launch; fragments in
    # flight together share the link, which cannot carry more than h inner steps' worth per cycle.
    exposed += max(late, comm_s - h * inner_step)
    return StepResult(
        method=method.spec,
        strategy="ddp",
        world_size=p,
        step_s=inner_step + exposed / h,
        compute_s=fwd_bwd,
        optimizer_s=opt,
        codec_s=codec_s / h,
        comm_s=comm_s / h,
        exposed_comm_s=(exposed - codec_s - opt) / h,
        payload_bytes=payload / h,
        sent_bytes=sent / h,
        collectives=f"DiLoCo H={h}" + (f", {f} fragments" if f > 1 else "") + (f", delay {d}" if d else ""),
        detail={"sync_every": h, "fragments": f, "delay": d, "outer_payload_bytes": payload,
                "outer_comm_s": comm_s},
    )


def _fsdp_step(method, workload, fabric, p, speed, algorithm) -> StepResult:
    model = workload.model
    dtype = workload.grad_dtype
    root, blocks = fsdp_units(model)
    units = [root, *blocks]
    weights = [sum(compute_weight(model, n, s) for n, s in u) for u in units]
    total = sum(weights) or 1
    fwd_bwd = workload.fwd_bwd_s()
    fwd = [fwd_bwd / 3 * w / total for w in weights]
    bwd = [fwd_bwd * 2 / 3 * w / total for w in weights]
    gather_bytes = [sum(math.prod(s) for _, s in u) * workload.param_gather_bytes for u in units]
    gather_s = [fabric.all_gather_s(nbytes, p) for nbytes in gather_bytes]
    grads = [method.fsdp_gradient_exchange([s for _, s in u], dtype, p) for u in units]
    comm = [g.comm_s(fabric, p, algorithm) for g in grads]
    codec = [speed.seconds(g) for g in grads]

    network_free = 0.0

    def issue(at: float, seconds: float) -> float:
        nonlocal network_free
        network_free = max(network_free, at) + seconds
        return network_free

    # Forward: the root's parameters, then block 0, each next block prefetched as one starts.
    root_ready = issue(0.0, gather_s[0])
    ready = {1: issue(0.0, gather_s[1])} if blocks else {}
    # The embedding lookup costs no matmul; the root's compute (the head) follows the blocks.
    t = root_ready
    for i in range(1, len(units)):
        start = max(t, ready[i])
        if i + 1 < len(units):
            ready[i + 1] = issue(start, gather_s[i + 1])
        t = start + fwd[i]
    t += fwd[0]
    # Backward: head first, blocks in reverse (each re-gathered, one ahead), the root's gradients last.
    grad_done: list[tuple[float, float]] = []
    back_ready = {len(units) - 1: issue(t, gather_s[-1])} if blocks else {}
    t += bwd[0]
    for i in range(len(units) - 1, 0, -1):
        start = max(t, back_ready[i])
        if i - 1 >= 1:
            back_ready[i - 1] = issue(start, gather_s[i - 1])
        t = start + bwd[i] + codec[i][0]
        grad_done.append((issue(t, comm[i]), codec[i][1]))
    t += codec[0][0]
    grad_done.append((issue(t, comm[0]), codec[0][1]))
    done = t
    for end, dec in grad_done:
        done = max(done, end) + dec
    opt = workload.optimizer_step_s(shards=p)
    step = done + opt
    codec_s = sum(e + d for e, d in codec)
    # Every unit is gathered for forward; the blocks again for backward (the root stays gathered).
    busy = sum(gather_s) + sum(gather_s[1:]) + sum(comm)
    gather_sent = (p - 1) / p * (sum(gather_bytes) + sum(gather_bytes[1:]))
    return StepResult(
        method=method.spec,
        strategy="fsdp",
        world_size=p,
        step_s=step,
        compute_s=fwd_bwd,
        optimizer_s=opt,
        codec_s=codec_s,
        comm_s=busy,
        exposed_comm_s=max(step - fwd_bwd - opt - codec_s, 0.0),
        payload_bytes=sum(g.payload_bytes for g in grads),
        sent_bytes=sum(g.sent_bytes(p) for g in grads) + gather_sent,
        collectives=_summary(grads),
        detail={"units": len(units)},
    )


def limit_step(workload: Workload, world_size: int, strategy: str = "ddp") -> StepResult:
    """Compute alone, no exchange: the step time no codec can beat."""
    fwd_bwd = workload.fwd_bwd_s()
    opt = workload.optimizer_step_s(shards=world_size if strategy == "fsdp" else 1)
    return StepResult("limit", strategy, world_size, fwd_bwd + opt, fwd_bwd, opt, 0.0, 0.0, 0.0, 0, 0, "none")


def model_state_bytes(workload: Workload, world_size: int, strategy: str) -> float:
    """Bytes of weights, gradients and Adam moments each GPU holds (activations not counted)."""
    total = workload.model.numel * MODEL_STATE_BYTES_PER_PARAM
    return total / world_size if strategy == "fsdp" else total
