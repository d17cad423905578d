"""Which DDP communication hook a spec asks for: gradzip's, or PyTorch's own as an anchor."""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook checks that the hook's
# ``bucket`` annotation *is* dist.GradBucket, and a string annotation fails that check.
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from gradzip.choice import Choice, TorchHookChoice
from gradzip.comm.routes import check_collective
from gradzip.comm.traffic import allreduce_bytes
from gradzip.compressors import check_int
from gradzip.compressors.kernels import fused
from gradzip.ddp import CompressionState, compression_hook
from gradzip.metrics import StepMetrics


class TorchHookState:
    """Wraps one of PyTorch's hooks so its dense bytes are counted like gradzip's.

    Payload bytes are counted for the hooks whose payload is known exactly (allreduce, fp16,
    bf16); PyTorch's PowerSGD does not expose what it sends, so its payload is left unknown.
    """

    def __init__(self, choice: TorchHookChoice, group: dist.ProcessGroup | None = None) -> None:
        self.kind = choice.name
        self.group = group
        self.metrics = StepMetrics()
        self.step = 0
        if self.kind == "powersgd":
            rank, start = check_torch_powersgd(choice.params)
            self.inner = torch_powersgd.PowerSGDState(
                process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=start
            )
            self.hook = torch_powersgd.powerSGD_hook
        else:
            self.inner = group  # the default hooks take their process group as state
            self.hook = {
                "allreduce": default_hooks.allreduce_hook,
                "fp16": default_hooks.fp16_compress_hook,
                "bf16": _bf16_compress_hook,
            }[self.kind]

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
    sent = allreduce_bytes(payload, dist.get_world_size(state.group))
    state.metrics.add_bucket(
        bucket.index(), payload_bytes=payload, dense_bytes=dense, collective="allreduce",
        sent_bytes=sent, received_bytes=sent,
    )
    if bucket.is_last():
        state.step += 1
    return state.hook(state.inner, bucket)


def check_torch_powersgd(params: dict[str, Any]) -> tuple[int, int]:
    """``(approx_rank, start_step)`` of ``torch:powersgd``, checked (PyTorch's own rules).

    Raises:
        ValueError: naming the parameter and its range.
    """
    rank = params.get("approx_rank", 4)
    start = params.get("start_step", 2)
    check_int(rank, name="approx_rank", low=1)
    if isinstance(start, bool) or not isinstance(start, int) or start < 2:
        raise ValueError(f"start_step of torch:powersgd must be an integer >= 2 (PyTorch's rule); got {start!r}")
    return rank, start


def check_hook(cfg) -> None:
    """Check that ``cfg``'s compressor can run with its hook options, without building a hook.

    Raises:
        ValueError: for a PyTorch hook with gradzip's collective options or a bad parameter, a
            collective the codec cannot take, or a bad ``auto`` setting.
    """
    choice = cfg.choice
    if choice.kind == "torch":
        if cfg.collective != "auto" or cfg.min_compress_bytes:
            raise ValueError("--collective and --min-compress-bytes apply to gradzip codecs, not torch: hooks")
        if choice.name == "powersgd":
            check_torch_powersgd(choice.params)
    elif choice.kind == "auto":
        cfg.auto_config().validate()
    elif choice.codec.multi_round:
        if cfg.collective != "auto":
            raise ValueError(f"--collective must be auto for {choice.codec.name}, which brings its own rounds")
        if cfg.min_compress_bytes:
            raise ValueError(f"--min-compress-bytes applies to single-round codecs, not {choice.codec.name}")
    else:
        check_collective(cfg.collective, choice.codec)


def make_hook(cfg, group: dist.ProcessGroup | None = None):
    """``(state, hook)`` for ``cfg.choice`` on ``group`` (None: the default group): PyTorch's hook
    for ``torch:NAME``, else gradzip's :func:`~gradzip.ddp.compression_hook` with ``cfg``'s
    options. PyTorch's hooks report bytes only.

    Raises:
        ValueError: as :func:`check_hook`.
    """
    choice = cfg.choice
    if choice.kind == "torch":
        return TorchHookState(choice, group), torch_hook
    options: dict[str, Any] = {
        "collective": cfg.collective, "min_compress_bytes": cfg.min_compress_bytes,
        "monitor_every": cfg.monitor_every, "verify_every": cfg.verify_every,
    }
    if choice.kind == "auto":
        options["auto"] = cfg.auto_config()
        options["total_steps"] = cfg.steps  # legacy's phases and edgc's warm-up slice the run
    return CompressionState(choice, process_group=group, **options), compression_hook


def warm_up_kernels(choice: Choice) -> float:
    """Compile the fused kernels of ``choice``'s codec (:mod:`gradzip.compressors.kernels.fused`), and
    build the native loops (:mod:`gradzip.compressors.kernels.native`) unless cached, before the first
    step, on a small tensor: either takes seconds, and inside a step it would count in step
    times and time to target while the other ranks wait in a collective.

    Returns:
        the seconds it took; 0.0 for PyTorch's hooks, ``auto`` (pass its candidates one by
        one), multi-round codecs, and with compilation off (``GRADZIP_COMPILE=0``).
    """
    if choice.kind != "codec" or choice.codec.multi_round:
        return 0.0
    return fused.warm_up(choice.codec)


def is_torch_hook(state: Any) -> bool:
    return isinstance(state, TorchHookState)
