"""Which DDP communication hook a spec asks for: gradzip's, or PyTorch's own as an anchor."""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook checks that the hook's
# ``bucket`` annotation *is* dist.GradBucket, and a string annotation fails that check.
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from gradzip.comm.traffic import allreduce_bytes
from gradzip.compressors import SpecError, build, parse_spec
from gradzip.compressors.kernels import fused
from gradzip.compressors.spec import split_training_options
from gradzip.ddp import CompressionState, WarmupState, compression_hook
from gradzip.metrics import StepMetrics

TORCH_HOOKS = ("allreduce", "fp16", "bf16", "powersgd")


class TorchHookState:
    """Wraps one of PyTorch's hooks so its dense bytes are counted like gradzip's.

    Payload bytes are counted for the hooks whose payload is known exactly (allreduce, fp16,
    bf16); PyTorch's PowerSGD does not expose what it sends, so its payload is left unknown.
    """

    def __init__(self, kind: str, params: dict[str, Any]) -> None:
        self.kind = kind
        self.metrics = StepMetrics()
        self.step = 0
        if kind == "powersgd":
            unknown = set(params) - {"approx_rank", "start_step"}
            if unknown:
                raise SpecError(f"torch:powersgd takes approx_rank and start_step; got {', '.join(sorted(unknown))}")
            rank = params.get("approx_rank", 4)
            start = params.get("start_step", 2)
            if not isinstance(rank, int) or rank < 1:
                raise ValueError(f"approx_rank must be an integer >= 1; got {rank!r}")
            if not isinstance(start, int) or start < 2:
                raise ValueError(f"start_step of torch:powersgd must be an integer >= 2 (PyTorch's rule); got {start!r}")
            self.inner = torch_powersgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start
            )
            self.hook = torch_powersgd.powerSGD_hook
        else:
            if params:
                raise SpecError(f"torch:{kind} takes no parameters")
            self.inner = None
            self.hook = {
                "allreduce": default_hooks.allreduce_hook,
                "fp16": default_hooks.fp16_compress_hook,
                "bf16": _bf16_compress_hook,
            }[kind]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def _bf16_compress_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # DDP refuses PyTorch's bf16_compress_hook by name unless CUDA and NCCL are present; the hook
    # itself runs on gloo, so it is called through this wrapper.
    return default_hooks.bf16_compress_hook(state, bucket)


def torch_hook(state: TorchHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Count the bucket's bytes, then run PyTorch's hook on it."""
    buffer = bucket.buffer()
    dense = buffer.numel() * buffer.element_size()
    payload = {"allreduce": dense, "fp16": buffer.numel() * 2, "bf16": buffer.numel() * 2}.get(state.kind, 0)
    sent = allreduce_bytes(payload, dist.get_world_size())
    state.metrics.add_bucket(
        bucket.index(), payload_bytes=payload, dense_bytes=dense, collective="allreduce",
        sent_bytes=sent, received_bytes=sent,
    )
    if bucket.is_last():
        state.step += 1
    return state.hook(state.inner, bucket)


def make_hook(spec: str, **options: Any):
    """``(state, hook)`` for ``spec``: ``torch:NAME[:params]`` picks PyTorch's hook, anything else
    (``auto`` too) gradzip's :func:`~gradzip.ddp.compression_hook`, built with ``options``
    (``collective``, ``min_compress_bytes``, ``monitor_every``, ``verify_every``, ``auto``; see
    :class:`~gradzip.ddp.CompressionState`). PyTorch's hooks report bytes only.

    Raises:
        ValueError: for an unknown codec or hook, a bad parameter, or a collective or threshold
            that the codec or hook cannot take.
    """
    if spec.strip().lower().startswith("torch:"):
        if options.get("collective", "auto") != "auto" or options.get("min_compress_bytes", 0):
            raise ValueError("--collective and --min-compress-bytes apply to gradzip codecs, not torch: hooks")
        rest = spec.strip()[len("torch:") :]
        parts = parse_spec(rest)
        if len(parts) != 1 or parts[0][0] not in TORCH_HOOKS:
            raise SpecError(f"unknown PyTorch hook {rest!r}; known: {', '.join('torch:' + h for h in TORCH_HOOKS)}")
        name, params = parts[0]
        return TorchHookState(name, params), torch_hook
    codec_spec, warmup = split_training_options(spec)  # DGC's warm-up and clipping, if asked for
    if warmup:
        return WarmupState(codec_spec, **warmup, **options), compression_hook
    return CompressionState(spec, **options), compression_hook


def warm_up_kernels(spec: str) -> float:
    """Compile the fused kernels of ``spec``'s codec (:mod:`gradzip.compressors.kernels.fused`), and
    build the native loops (:mod:`gradzip.compressors.kernels.native`) unless cached, before the first
    step, on a small tensor: either takes seconds, and inside a step it would count in step
    times and time to target while the other ranks wait in a collective.

    Returns:
        the seconds it took; 0.0 for PyTorch's hooks, ``auto`` (pass its candidates one by
        one), multi-round codecs, and with compilation off (``GRADZIP_COMPILE=0``).
    """
    name = spec.strip().lower()
    if name.startswith("torch:") or name == "auto":
        return 0.0
    codec = build(split_training_options(spec)[0])
    return 0.0 if codec.multi_round else fused.warm_up(codec)


def is_torch_hook(state: Any) -> bool:
    return isinstance(state, TorchHookState)


def hook_options(cfg) -> dict[str, Any]:
    """The :class:`~gradzip.ddp.CompressionState` options of a :class:`~gradzip.lab.train.config.TrainConfig`."""
    options: dict[str, Any] = {
        "collective": cfg.collective, "min_compress_bytes": cfg.min_compress_bytes,
        "monitor_every": cfg.monitor_every, "verify_every": cfg.verify_every,
    }
    if cfg.compressor.strip().lower() == "auto":
        options["auto"] = cfg.auto_config()
    return options
