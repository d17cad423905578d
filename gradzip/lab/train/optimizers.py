"""The main job's optimizer: ``--optimizer adamw|onebit-adam|zeroone-adam[:key=value,...]``.

``adamw`` is ``torch.optim.AdamW`` behind the DDP hook of ``--compressor``. The other two own
their communication (:mod:`gradzip.optim`): the hook averages gradients only on the steps where
they ask for it (1-bit Adam's warm-up, 0/1 Adam's variance steps); on every other step backward
runs under ``no_sync`` and the optimizer exchanges its 1-bit payload itself, counted in the same
metrics as the hook.
"""

from __future__ import annotations

from typing import Any

import torch

from gradzip.compressors import SpecError, parse_spec
from gradzip.metrics import StepMetrics
from gradzip.optim import CompressedAdamBase, OneBitAdam, ZeroOneAdam

#: optimizer name -> the spec parameters it takes
OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "adamw": (),
    "onebit-adam": ("warmup_steps", "bucket_cap_mb"),
    "zeroone-adam": ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "bucket_cap_mb"),
}

#: Adam's betas in the main job (nanoGPT's choice for GPT-2)
BETAS = (0.9, 0.95)


def parse_optimizer(spec: str) -> tuple[str, dict[str, Any]]:
    """``(name, params)`` of an optimizer spec such as ``onebit-adam:warmup_steps=60``.

    Raises:
        ValueError: for an unknown optimizer or parameter, naming the known ones.
    """
    parts = parse_spec(spec)
    if len(parts) != 1 or parts[0][0] not in OPTIMIZERS:
        raise SpecError(f"--optimizer must be one of {', '.join(OPTIMIZERS)} (with key=value options); got {spec!r}")
    name, params = parts[0]
    unknown = sorted(set(params) - set(OPTIMIZERS[name]))
    if unknown:
        takes = ", ".join(OPTIMIZERS[name]) or "no parameters"
        raise SpecError(f"--optimizer {name} has no parameter {unknown[0]!r}; it takes {takes}")
    return name, params


def names_optimizer(spec: str) -> bool:
    """Whether ``spec`` names an optimizer (``onebit-adam:warmup_steps=20``) rather than a codec;
    ``gradzip compare`` runs such an entry as ``--optimizer SPEC --compressor none``."""
    try:
        parts = parse_spec(spec)
    except SpecError:
        return False
    return len(parts) == 1 and parts[0][0] in OPTIMIZERS


def default_warmup_steps(cfg) -> int:
    """Full-precision steps before the variance freezes: 20% of training (1-bit Adam's 15-25%),
    and not before the learning-rate warm-up has ended (0/1 Adam's rule: the variance moves most
    while the learning rate climbs); at least 1."""
    return max(1, cfg.warmup_steps, round(0.2 * cfg.steps))


def build_optimizer(cfg, model: torch.nn.Module, *, metrics: StepMetrics | None = None) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optimizer`` names, over ``model``'s parameters, with ``cfg.lr``,
    ``cfg.weight_decay`` and betas (0.9, 0.95).

    Args:
        cfg: a :class:`~gradzip.lab.train.config.TrainConfig`.
        model: the module (not its DDP wrapper); its gradients are averaged by DDP's hook
            whenever the optimizer asks for averaged gradients (``average_grads=False``).
        metrics: where the optimizer's own collectives are counted (the hook's).

    Raises:
        ValueError: for a bad spec or parameter.
    """
    name, params = parse_optimizer(cfg.optimizer)
    common = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": BETAS}
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), **common)
    shared = {"average_grads": False, "metrics": metrics, **common}
    if name == "onebit-adam":
        params.setdefault("warmup_steps", default_warmup_steps(cfg))
        return OneBitAdam(model.parameters(), **params, **shared)
    params.setdefault("var_freeze_step", default_warmup_steps(cfg))
    return ZeroOneAdam(model.parameters(), **params, **shared)


def check_optimizer(cfg) -> None:
    """Build ``cfg.optimizer`` over a throwaway parameter, so a bad spec or value fails before
    any worker starts.

    Raises:
        ValueError: for a bad spec or parameter.
    """
    build_optimizer(cfg, torch.nn.Linear(1, 1))


def owns_communication(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` exchanges its own payload (its state differs per rank)."""
    return isinstance(optimizer, CompressedAdamBase)
