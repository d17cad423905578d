"""Projection: step time, communication share, speedup and cost of each method on one cluster."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gradzip.lab.simulate.exchange import Method
from gradzip.lab.simulate.presets import GBYTE, ClusterPreset, model_shapes
from gradzip.lab.simulate.step import CodecSpeed, StepResult, Workload, limit_step, model_state_bytes, simulate_step

TOKENS_PER_BILLION = 1e9


@dataclass(frozen=True)
class Scenario:
    """Everything a projection depends on besides the methods.

    Attributes:
        model: a preset name of :data:`gradzip.lab.simulate.presets.MODELS`.
        cluster: the cluster preset.
        tokens_per_gpu: tokens per GPU per step (the global batch grows with the GPUs).
        mfu: model FLOPs utilisation of forward + backward.
        strategy: ``ddp`` or ``fsdp``.
        algorithm: all_reduce algorithm, see :meth:`gradzip.lab.simulate.collectives.Fabric.all_reduce_s`.
        collective: for non-aggregatable codecs: ``auto``, ``allgather`` or ``twophase``.
        grad_dtype: gradient dtype reduced by DDP / FSDP.
        bucket_cap_mb: DDP bucket cap, MiB.
        compute_s: forward + backward seconds per step; None derives it from FLOPs.
        price_per_gpu_hour: USD per GPU-hour, for the cost column.
    """

    model: str
    cluster: ClusterPreset
    tokens_per_gpu: int
    mfu: float = 0.4
    strategy: str = "ddp"
    algorithm: str = "auto"
    collective: str = "auto"
    grad_dtype: torch.dtype = torch.float32
    bucket_cap_mb: float = 25.0
    compute_s: float | None = None
    price_per_gpu_hour: float = 3.5

    def workload(self) -> Workload:
        """The per-GPU workload."""
        gpu = self.cluster.gpu
        return Workload(
            model=model_shapes(self.model),
            tokens_per_gpu=self.tokens_per_gpu,
            peak_flops=gpu.peak_flops,
            mfu=self.mfu,
            hbm_bytes_per_s=gpu.hbm_bytes_per_s,
            compute_s=self.compute_s,
            grad_dtype=self.grad_dtype,
            bucket_cap_mb=self.bucket_cap_mb,
        )

    def default_codec_speed(self) -> CodecSpeed:
        """The cluster preset's assumed codec throughput."""
        rate = self.cluster.codec_gbyte_per_s * GBYTE
        return CodecSpeed(rate, rate, f"assumed {self.cluster.codec_gbyte_per_s:g} GB/s ({self.cluster.name} preset)")


@dataclass
class ProjectionRow:
    """One method at one world size, with the derived columns."""

    result: StepResult
    speedup: float
    limit_speedup: float
    gpu_hours_per_btok: float
    usd_per_btok: float
    codec_speed: str

    @property
    def fraction_of_limit(self) -> float:
        """Speedup over the largest speedup possible (dense step / compute alone)."""
        return self.speedup / self.limit_speedup if self.limit_speedup > 0 else 0.0

    def as_dict(self) -> dict:
        """Flat fields for JSON."""
        out = self.result.as_dict()
        out.update(
            speedup=self.speedup,
            limit_speedup=self.limit_speedup,
            fraction_of_limit=self.fraction_of_limit,
            gpu_hours_per_btok=self.gpu_hours_per_btok,
            usd_per_btok=self.usd_per_btok,
            codec_speed=self.codec_speed,
        )
        return out


def project(
    scenario: Scenario,
    methods: Sequence[Method],
    world_size: int,
    codec_speeds: Mapping[str, CodecSpeed] | None = None,
) -> list[ProjectionRow]:
    """Predict every method at ``world_size`` GPUs; the first row is the ``limit`` (compute alone).

    Args:
        scenario: model, cluster and training settings.
        methods: the methods to compare (``none`` is always computed as the baseline).
        world_size: GPUs.
        codec_speeds: per ``method.spec``; missing ones use the cluster's assumed throughput.

    Returns:
        the ``limit`` row, then one row per method, in order.
    """
    workload = scenario.workload()
    fabric = scenario.cluster.fabric()
    default = scenario.default_codec_speed()
    speeds = dict(codec_speeds or {})

    def run(method: Method) -> StepResult:
        return simulate_step(
            method, workload, fabric, world_size, speeds.get(method.spec, default),
            strategy=scenario.strategy, algorithm=scenario.algorithm, collective=scenario.collective,
        )

    dense = run(Method("none"))
    limit = limit_step(workload, world_size, scenario.strategy)
    limit_speedup = dense.step_s / limit.step_s

    def row(result: StepResult, speed: str) -> ProjectionRow:
        gpu_hours = result.step_s / 3600 * TOKENS_PER_BILLION / scenario.tokens_per_gpu
        return ProjectionRow(
            result=result,
            speedup=dense.step_s / result.step_s,
            limit_speedup=limit_speedup,
            gpu_hours_per_btok=gpu_hours,
            usd_per_btok=gpu_hours * scenario.price_per_gpu_hour,
            codec_speed=speed,
        )

    rows = [row(limit, "-")]
    for method in methods:
        result = dense if method.is_identity and method.spec == "none" else run(method)
        speed = "-" if method.is_identity else _describe_speed(method.spec, speeds.get(method.spec, default))
        rows.append(row(result, speed))
    return rows


def _describe_speed(spec: str, speed: CodecSpeed) -> str:
    if speed.source.startswith("measured"):
        return (
            f"{spec} encode {speed.encode_bytes_per_s / GBYTE:.3g}, decode {speed.decode_bytes_per_s / GBYTE:.3g} "
            f"({speed.source})"
        )
    return speed.source


def state_note(scenario: Scenario, world_size: int) -> str | None:
    """A warning when weights, gradients and Adam moments alone exceed the GPU's memory."""
    need = model_state_bytes(scenario.workload(), world_size, scenario.strategy)
    have = scenario.cluster.gpu.memory_bytes
    if need <= have:
        return None
    hint = " (--strategy fsdp shards them)" if scenario.strategy == "ddp" else ""
    return (
        f"note: weights, gradients and Adam moments take {need / 1e9:.0f} GB per GPU with {scenario.strategy}, "
        f"more than the {have / 1e9:.0f} GB of one {scenario.cluster.gpu.name}{hint}; the times assume they fit."
    )
