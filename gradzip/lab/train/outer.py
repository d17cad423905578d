"""The main job's outer loop: ``--outer diloco:sync_every=H[,...]`` with ``--outer-compressor SPEC``
and ``--replica-size N``.

Each replica (``--replica-size`` consecutive ranks) trains its own copy of the model with the
inner AdamW; inside a replica gradients are averaged every step by DDP on the replica's group
(plain all_reduce, or the ``--compressor`` hook), and every ``H`` inner steps the replicas
exchange their pseudo-gradients through ``--outer-compressor`` on the outer group
(:class:`gradzip.DiLoCo`, :func:`gradzip.replica_groups`). With one rank per replica there is no
DDP at all: a rank is a replica.

Bytes: the step records count the outer exchange (between replicas) as ``payload_bytes``, and
the dense gradient every step as ``dense_bytes`` (what DDP between the replicas would send), so
the summary's bytes per step are the outer payload over ``H`` and its ratio is ``H`` times the
codec's. The exchange inside a replica is recorded apart, as ``replica_payload_bytes``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from gradzip.compressors import SpecError, parse_spec
from gradzip.lab.train.optimizers import is_adamw

#: what ``--outer diloco:...`` takes (DiLoCo's keyword arguments)
OUTER_KEYS = ("sync_every", "outer_lr", "outer_momentum", "fragments", "delay", "mix", "method", "eager", "carry")


def parse_outer(spec: str) -> dict[str, Any]:
    """DiLoCo's keyword arguments from an ``--outer`` spec such as ``diloco:sync_every=20,delay=1``.

    Raises:
        ValueError: for another name, an unknown key or a missing ``sync_every``.
    """
    parts = parse_spec(spec) if spec.strip() else []
    if len(parts) != 1 or parts[0][0] != "diloco":
        raise SpecError(f"--outer must be diloco:sync_every=H[,{',' .join(k + '=..' for k in OUTER_KEYS[1:])}]; "
                        f"got {spec!r} (the outer codec goes in --outer-compressor)")
    params = dict(parts[0][1])
    unknown = sorted(set(params) - set(OUTER_KEYS))
    if unknown:
        raise SpecError(f"--outer diloco has no parameter {unknown[0]!r}; it takes {', '.join(OUTER_KEYS)} "
                        "(the outer codec goes in --outer-compressor)")
    if "sync_every" not in params:
        raise SpecError("--outer diloco needs sync_every=H, the inner steps per outer step (an integer >= 1)")
    return params


def names_outer(spec: str) -> bool:
    """Whether a ``gradzip compare`` entry names DiLoCo (``diloco:sync_every=20+uniform:bits=8``)
    rather than a codec or an optimizer; see :func:`split_entry`."""
    try:
        parts = parse_spec(spec)
    except SpecError:
        return False
    return bool(parts) and parts[0][0] == "diloco"


def split_entry(spec: str) -> tuple[str, str]:
    """``(--outer, --outer-compressor)`` of a ``gradzip compare`` entry: the DiLoCo spec, then
    after the first ``+`` the outer codec (``none`` when absent):
    ``diloco:sync_every=20+uniform:bits=8`` gives ``("diloco:sync_every=20", "uniform:bits=8")``."""
    outer, _, codec = spec.partition("+")
    return outer.strip(), codec.strip() or "none"


def n_tensors(cfg) -> int:
    """Trainable parameter tensors of ``cfg``'s model (built on the meta device: no memory)."""
    from gradzip.lab.train.model import model_skeleton

    return sum(1 for p in model_skeleton(cfg, cfg.vocab_size).parameters() if p.requires_grad)


def check_outer(cfg) -> None:
    """Check ``--outer``, ``--outer-compressor`` and ``--replica-size`` together, building a
    throwaway DiLoCo over stand-in tensors (as many as the model has), before any worker starts.

    Raises:
        ValueError: one line naming the option and its allowed range.
    """
    from gradzip.lab.train.config import named_parse

    if cfg.outer is None:
        if cfg.outer_compressor != "none":
            raise ValueError("--outer-compressor is the codec of --outer; give --outer diloco:sync_every=H too")
        if cfg.replica_size != 1:
            raise ValueError("--replica-size groups ranks into replicas for --outer; give --outer diloco:sync_every=H too")
        return
    params = parse_outer(cfg.outer)
    from gradzip.lab.train.launch import under_torchrun

    if under_torchrun():  # torchrun's world size, not --world-size (which it ignores)
        world_size, source = int(os.environ["WORLD_SIZE"]), "the world size (WORLD_SIZE)"
    else:
        world_size, source = cfg.world_size, "--world-size"
    if world_size % cfg.replica_size:
        raise ValueError(f"--replica-size must divide {source}={world_size}; got {cfg.replica_size}")
    if cfg.fsdp:
        raise ValueError("--outer replicates the model per replica; it does not run with --fsdp")
    if not is_adamw(cfg.optimizer):
        raise ValueError(f"--outer wraps the inner adamw; --optimizer {cfg.optimizer} exchanges its own momenta")
    if cfg.no_exchange:
        raise ValueError("--no-exchange measures compute alone; it does not run with --outer")
    choice = named_parse("--outer-compressor", cfg.outer_compressor)
    if choice.kind != "codec":
        raise ValueError(f"--outer-compressor must be a gradzip codec spec (none, uniform:bits=8, topk:ratio=0.01, ...); "
                         f"{cfg.outer_compressor!r} cannot run on the outer exchange")
    if choice.hook_options:  # DGC's warm-up and the embeddings' codec act on DDP buckets; the outer exchange has none
        raise ValueError(f"--outer-compressor takes a codec alone; {', '.join(choice.hook_options)} belong to "
                         f"--compressor (options of the per-step gradient exchange's DDP hook)")
    if cfg.replica_size == 1 and cfg.compressor not in (type(cfg).compressor, "none"):
        raise ValueError("--compressor is the codec inside a replica; with --replica-size 1 there is no exchange "
                         "inside a replica (leave it out or give --replica-size N)")
    sync_every, fragments = params["sync_every"], params.get("fragments", 1)
    # the settings but fragments (bounded by the model's tensor count) check without the model,
    # whose skeleton takes seconds to build: a bad value is refused before that
    _try_diloco(cfg, choice, {**params, "fragments": 1}, 1)
    tensors = n_tensors(cfg)
    if isinstance(sync_every, int) and sync_every >= 1 and isinstance(fragments, int) and fragments >= 1 and (
            sync_every % fragments):
        # the library spreads uneven fragments too; the job keeps the exchanges evenly spaced
        fits = [f for f in range(1, min(sync_every, tensors) + 1) if sync_every % f == 0]
        raise ValueError(f"--outer: fragments must divide sync_every={sync_every} so exchanges are evenly spaced: "
                         f"one of {', '.join(map(str, fits))}; got {fragments}")
    _try_diloco(cfg, choice, params, tensors)


def _try_diloco(cfg, choice, params: dict[str, Any], tensors: int) -> None:
    """Build a throwaway DiLoCo over ``tensors`` stand-in tensors with the run's settings.

    Raises:
        ValueError: DiLoCo's own message, after ``--outer: ``.
    """
    from gradzip.outer import DiLoCo

    stand_in = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(1)) for _ in range(tensors))
    inner = torch.optim.SGD(stand_in.parameters(), lr=0.1)
    try:
        DiLoCo(stand_in, inner, choice.codec, **params, collective=cfg.collective,
               min_compress_bytes=cfg.min_compress_bytes, bucket_cap_mb=cfg.bucket_cap_mb)
    except ValueError as exc:
        raise ValueError(f"--outer: {exc}") from None


def build_outer(cfg, model: torch.nn.Module, inner: torch.optim.Optimizer, *, outer_group, replica_group,
                metrics):
    """The :class:`gradzip.DiLoCo` of ``cfg`` around ``inner``, exchanging on ``outer_group``
    (``replica_group`` None: one rank per replica)."""
    from gradzip.choice import parse_compressor
    from gradzip.outer import DiLoCo

    return DiLoCo(
        model, inner, parse_compressor(cfg.outer_compressor).codec, **parse_outer(cfg.outer),
        group=outer_group, replica_group=replica_group, metrics=metrics,
        collective=cfg.collective, min_compress_bytes=cfg.min_compress_bytes, bucket_cap_mb=cfg.bucket_cap_mb,
    )


def dense_bytes(model: torch.nn.Module) -> int:
    """Bytes of the trainable parameters: what a dense gradient exchange sends per step."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def describe(cfg) -> str:
    """``DiLoCo H=20, outer codec uniform:bits=8, 2 replicas of 2 ranks`` for the summary."""
    params = parse_outer(cfg.outer)
    extras = "".join(f", {k}={params[k]}" for k in OUTER_KEYS[1:] if k in params)
    return f"DiLoCo H={params['sync_every']}{extras}, outer codec {cfg.outer_compressor}"
