"""The main job's optimizer:
``--optimizer adamw|onebit-adam|zeroone-adam|tsr-adam|demo|local-adamw[:key=value,...]``.

``adamw`` is ``torch.optim.AdamW`` behind the DDP hook of ``--compressor``. The others own
their communication (:mod:`gradzip.optim`): the hook averages gradients only on the steps where
they ask for it (1-bit Adam's warm-up, 0/1 Adam's variance steps; never for TSR-Adam and DeMo);
on every other step backward runs under ``no_sync`` and the optimizer exchanges its payload
itself, counted in the same metrics as the hook.

``tsr-adam`` groups the GPT-2 weights as the paper's pre-training script groups LLaMA's: the
attention and MLP matrices with ``approx_rank`` and ``update_gap``, the token and position
embeddings with ``approx_rank_emb`` (each table at most its smaller side), ``update_gap_emb`` and
``scale_emb`` (``scale`` unless given), everything else (norms, biases) dense. ``dense_emb=true``
moves the embeddings to the dense parameters: the paper's scripts train the output layer dense,
and here the token embedding is the output layer (tied); ``dense_int8=true`` sends the dense
parameters' gradients as int8 codes with error feedback and ``wire_bits=16`` the cores and
sketches as bfloat16 (:class:`~gradzip.optim.TSRAdam`), which together bring it back within the
bytes of the paper's 13x.
Defaults, measured on the 300-step demo job
(``benchmarks/results/optimizers_subspace``): ``approx_rank`` n_embd / 4 (the paper's scripts:
n_embd / 2 up to 350 M, n_embd / 4 at 1 B); ``approx_rank_emb`` n_embd / 2 (at most ``--seq-len``
and ``--vocab-size``, the tables' rows) and ``update_gap_emb`` 10 (the paper's n_embd / 8 every
2 steps sends as many bytes here, where the token embedding is also the output layer, and trained
worse); ``update_gap`` 10% of ``--steps``, at most the paper's 100 (bases from the first gradient
serving a third of a short run stalled it); ``scale`` 7.5, the paper's 0.75 at its lr of 10x AdamW's, since the job has one ``--lr``
and the dense parameters keep AdamW's. ``demo`` takes DeMo's paper defaults
(``compression_decay`` 0.999, ``compression_topk`` 32, ``compression_chunk`` 64) with the job's
``--lr`` and ``--weight-decay``. Under ``tsr-adam`` and ``demo`` DDP's hook never runs, so
``--compressor`` defaults to ``none`` there and any other codec is refused. ``local-adamw``
(:class:`~gradzip.optim.LocalAdamW`) sends its AdamW update through ``--compressor``'s codec
instead of DDP's hook (which never runs), on ``--collective``'s route.
"""

from __future__ import annotations

from typing import Any

import torch

from gradzip.compressors import SpecError, check_int, parse_spec
from gradzip.compressors.values import check_flag
from gradzip.metrics import StepMetrics
from gradzip.optim import CompressedAdamBase, DeMo, LocalAdamW, OneBitAdam, TSRAdam, ZeroOneAdam
from gradzip.optim.base import check_nonnegative

#: optimizer name -> the spec parameters it takes
OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "adamw": (),
    "onebit-adam": ("warmup_steps", "bucket_cap_mb"),
    "zeroone-adam": ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "bucket_cap_mb"),
    "tsr-adam": ("approx_rank", "update_gap", "approx_rank_emb", "update_gap_emb", "scale", "scale_emb", "oversampling",
                 "power_iters", "moment_transfer", "wire_bits", "dense_int8", "dense_emb"),
    "demo": ("compression_decay", "compression_topk", "compression_chunk", "compact", "value_bits"),
    "local-adamw": ("feedback_decay", "bucket_cap_mb"),
}

#: optimizers that send everything themselves on every step, so DDP's hook (``--compressor``) never runs
HOOKLESS = ("tsr-adam", "demo")

#: optimizers that send their update through ``--compressor``'s codec themselves, so DDP's hook never runs
UPDATE_CODEC = ("local-adamw",)

#: TSR-Adam's settings in the main job unless given (see the module docstring)
TSR_DEFAULTS = {"update_gap_emb": 10, "scale": 7.5}

#: Adam's betas in the main job (nanoGPT's choice for GPT-2)
BETAS = (0.9, 0.95)


def parse_optimizer(spec: str) -> tuple[str, dict[str, Any]]:
    """``(name, params)`` of an optimizer spec such as ``onebit-adam:warmup_steps=60``.

    Raises:
        ValueError: for an unknown optimizer or parameter, naming the known ones.
    """
    parts = parse_spec(spec) if isinstance(spec, str) and spec.strip() else []
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
    ``gradzip compare`` runs such an entry as ``--optimizer SPEC --compressor none``, or, for an
    optimizer that sends its update through a codec, ``local-adamw+topk:ratio=0.01`` as
    ``--optimizer local-adamw --compressor topk:ratio=0.01`` (:func:`split_optimizer_entry`)."""
    try:
        # The optimizer's spec alone: what follows its "+" is the codec's, which may be no codec
        # spec at all (``torch:fp16``) and is then named as a codec when the entry is checked.
        head = parse_spec(spec.partition("+")[0])
    except SpecError:
        return False
    if head and head[0][0] in UPDATE_CODEC:
        return True
    try:
        parts = parse_spec(spec)
    except SpecError:
        return False
    return len(parts) == 1 and parts[0][0] in OPTIMIZERS


def split_optimizer_entry(spec: str) -> tuple[str, str]:
    """``(--optimizer, --compressor)`` of a ``gradzip compare`` entry that names an optimizer: the
    optimizer's spec, then after the first ``+`` the codec of ``local-adamw`` (``none`` when
    absent): ``local-adamw+topk:ratio=0.01`` gives ``("local-adamw", "topk:ratio=0.01")``."""
    optimizer, _, codec = spec.partition("+")
    return optimizer.strip(), codec.strip() or "none"


def is_adamw(spec: str) -> bool:
    """Whether ``spec`` names plain AdamW (read leniently: a bad spec is named by
    :func:`parse_optimizer` when it is checked)."""
    return spec.split(":")[0].strip().lower() == "adamw"


def uses_hook(spec: str) -> bool:
    """Whether optimizer ``spec`` ever asks DDP's hook (``--compressor``) for averaged gradients."""
    return parse_optimizer(spec)[0] not in HOOKLESS + UPDATE_CODEC


def ignores_compressor(spec: str) -> bool:
    """Whether ``--compressor`` plays no part under optimizer ``spec`` (it sends its own payload)."""
    return parse_optimizer(spec)[0] in HOOKLESS


def takes_codec(spec: str) -> bool:
    """Whether optimizer ``spec`` sends its update through ``--compressor``'s codec."""
    return parse_optimizer(spec)[0] in UPDATE_CODEC


def label(optimizer: str, exchange: str) -> str:
    """What a run exchanges, for its progress bar and summary: ``exchange`` (the hook's codec) with
    AdamW, else the optimizer, and the hook's codec when it is not ``none``."""
    if is_adamw(optimizer):
        return exchange
    return optimizer if exchange == "none" else f"{optimizer} + {exchange}"


def default_warmup_steps(cfg) -> int:
    """Full-precision steps before the variance freezes: 20% of training (1-bit Adam's 15-25%),
    and not before the learning-rate warm-up has ended (0/1 Adam's rule: the variance moves most
    while the learning rate climbs); at least 1."""
    return max(1, cfg.warmup_steps, round(0.2 * cfg.steps))


def dense_steps_note(cfg) -> str | None:
    """One line when 1-bit Adam's or 0/1 Adam's full-precision steps cover the whole run (it would
    never send a 1-bit momentum); None otherwise."""
    name, params = parse_optimizer(cfg.optimizer)
    key = {"onebit-adam": "warmup_steps", "zeroone-adam": "var_freeze_step"}.get(name)
    if key is None:
        return None
    dense = params.get(key, default_warmup_steps(cfg))
    if not isinstance(dense, int) or dense < cfg.steps:
        return None
    given = "" if key in params else "; the default: 20% of --steps, at least --warmup-steps"
    return (f"--optimizer {name}: its {dense} full-precision steps ({key}{given}) cover all {cfg.steps} steps, "
            f"so it never sends a 1-bit momentum; give {key}=N below --steps")


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
    if name == "demo":
        return DeMo(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, metrics=metrics, **params)
    if name == "local-adamw":
        return LocalAdamW(model.parameters(), compressor=update_codec(cfg), collective=cfg.collective, metrics=metrics,
                          **common, **params)
    if name == "tsr-adam":
        return TSRAdam(tsr_groups(cfg, model, params), seed=cfg.seed, metrics=metrics, **common,
                       **{k: v for k, v in params.items() if k in ("oversampling", "power_iters", "moment_transfer", "wire_bits", "dense_int8")})
    shared = {"average_grads": False, "metrics": metrics, **common}
    if name == "onebit-adam":
        params.setdefault("warmup_steps", default_warmup_steps(cfg))
        return OneBitAdam(model.parameters(), **params, **shared)
    params.setdefault("var_freeze_step", default_warmup_steps(cfg))
    return ZeroOneAdam(model.parameters(), **params, **shared)


def update_codec(cfg):
    """The codec ``local-adamw`` sends its update through: ``--compressor``'s.

    Raises:
        ValueError: naming ``--compressor`` when it is not a plain codec spec.
    """
    choice = cfg.choice
    if choice.kind != "codec" or choice.hook_options:
        raise ValueError(f"--optimizer local-adamw sends its update through a codec; --compressor {cfg.compressor} "
                         "is not a plain codec spec (not auto, a schedule, a torch: hook, DGC's warm-up options or "
                         "embeddings=)")
    return choice.codec


def tsr_settings(cfg, params: dict[str, Any]) -> dict[str, Any]:
    """TSR-Adam's group settings: ``params`` over the defaults of the module docstring.

    Raises:
        ValueError: for a rank larger than the weights it applies to allow, naming it.
    """
    width = model_width(cfg)
    what_width = f"the width of --model {cfg.model}" if cfg.model else "--n-embd"
    out = {"approx_rank": max(1, width // 4), "approx_rank_emb": max(1, width // 2),
           "update_gap": min(100, max(1, cfg.steps // 10)), **TSR_DEFAULTS}
    out.update({k: v for k, v in params.items() if k in out})
    # named here, scale first: the groups' checks would say scale for either
    check_nonnegative(out["scale"], name="scale", strict=True)
    out["scale_emb"] = check_nonnegative(params.get("scale_emb", out["scale"]), name="scale_emb", strict=True)
    out["dense_emb"] = check_flag(params.get("dense_emb", False), name="dense_emb")
    # both bounded by the width: each embedding table takes min(approx_rank_emb, its smaller
    # side) (tsr_groups)
    for name in ("approx_rank", "approx_rank_emb"):
        value = check_int(out[name], name=name, low=1)  # named here: the group's check says approx_rank
        if value > width:
            raise ValueError(f"--optimizer tsr-adam: {name} must be at most {width} ({what_width}); got {value}")
    for name in ("update_gap", "update_gap_emb"):
        check_int(out[name], name=name, low=1)
    return out


def model_width(cfg) -> int:
    """The hidden width of ``cfg``'s model: ``--n-embd``, or that of ``--model``."""
    if cfg.model is None:
        return cfg.n_embd
    from gradzip.lab.train.pretrained import hidden_width

    return hidden_width(cfg.model)


def tsr_groups(cfg, model: torch.nn.Module, params: dict[str, Any]) -> list[dict[str, Any]]:
    """TSR-Adam's parameter groups for ``model``: attention and MLP matrices, embeddings, the rest
    dense (see the module docstring)."""
    settings = tsr_settings(cfg, params)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    matrices, embedded, dense = [], [], []
    for name, p in model.named_parameters():
        if id(p) in embeddings:
            embedded.append(p)
        elif p.dim() == 2 and any(part in name.split(".") for part in ("attn", "self_attn", "mlp")):
            matrices.append(p)
        else:
            dense.append(p)
    if settings["dense_emb"]:
        dense, embedded = dense + embedded, []
    # one group per table: the position table has --seq-len rows, the token table (also the
    # output layer when tied) --vocab-size, and each takes the rank its shape allows
    tables = [
        {"params": [p], "approx_rank": min(settings["approx_rank_emb"], *p.shape), "update_gap": settings["update_gap_emb"],
         "scale": settings["scale_emb"]}
        for p in embedded
    ]
    return [
        {"params": matrices, "approx_rank": settings["approx_rank"], "update_gap": settings["update_gap"],
         "scale": settings["scale"]},
        *tables,
        {"params": dense, "approx_rank": None},
    ]


def check_optimizer(cfg) -> None:
    """Build ``cfg.optimizer`` over a throwaway parameter, so a bad spec or value fails before
    any worker starts.

    Raises:
        ValueError: for a bad spec or parameter.
    """
    build_optimizer(cfg, torch.nn.Linear(1, 1))


def params_differ(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ranks' parameters may differ between steps of ``optimizer`` (0/1 Adam's local
    steps, until its next synchronisation), so that a checkpoint keeps every rank's own model."""
    return isinstance(optimizer, ZeroOneAdam)


def owns_communication(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` exchanges its own payload (its state may differ per rank)."""
    return isinstance(optimizer, (CompressedAdamBase, DeMo))
