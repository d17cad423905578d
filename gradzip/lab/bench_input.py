"""The tensor ``gradzip bench`` times codecs on: a real gradient of the main job's model if it can
be had without downloading or tokenizing anything, else a heavy-tailed synthetic one.

A DDP bucket is the gradients of consecutive parameters concatenated; the real input is built
the same way: the main job's model (``gradzip train``'s default configuration, or the weights
and configuration of a main-job checkpoint) takes one backward pass on a batch of its corpus,
and the flattened gradients of its parameters are concatenated, over as many batches as the
requested size needs (a 25 MB bucket is larger than the default model's 15 MB of gradients).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch
from torch import Tensor

from gradzip.lab import missing_lab_module


def heavy_tailed_gradient(numel: int, *, seed: int = 0, dof: int = 3, scale: float = 1e-3) -> Tensor:
    """A synthetic gradient: Student-t with ``dof`` degrees of freedom times ``scale``, fp32.

    Built from normals only (``z / sqrt(chi2_dof / dof)``, the chi-squared as a sum of squared
    normals) with a seeded generator, so it is the same on every run.
    """
    gen = torch.Generator().manual_seed(seed)
    chi2 = torch.zeros(numel)
    for _ in range(dof):
        chi2.addcmul_(z := torch.randn(numel, generator=gen), z)
    return torch.randn(numel, generator=gen).div_(chi2.div_(dof).sqrt_()).mul_(scale)


def _cached_ids(vocab_size: int, data: str | None) -> Tensor | None:
    """The main job's token ids if its tokenizer cache holds them (never builds them)."""
    from gradzip.lab.train.data import cache_dir, load_text

    text, _name = load_text(data)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    path = cache_dir() / f"ids-{digest}-{vocab_size}.pt"
    if not path.is_file():
        return None
    try:
        return torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - an unreadable cache entry means no real data here
        return None


def model_gradient(numel: int, *, checkpoint: str | None = None, seed: int = 0) -> tuple[Tensor, str] | None:
    """``numel`` fp32 gradient elements of the main job's model on its own data, or None.

    Args:
        numel: elements wanted.
        checkpoint: a main-job run folder or checkpoint folder: its model weights (trained) and
            configuration; None for a freshly initialised model of the default configuration.
        seed: seeds the batches.

    Returns:
        the flat gradient (shape ``(numel,)``, fp32) and a description of it, or None when the
        corpus's token ids are not in the tokenizer cache (``gradzip train`` puts them there).

    Raises:
        ValueError: if ``checkpoint`` holds no usable checkpoint.
    """
    from gradzip.lab.train.config import TrainConfig
    from gradzip.lab.train.data import batch_generator, sample_batch
    from gradzip.lab.train.model import build_model, next_token_loss

    state = None
    if checkpoint is None:
        cfg = TrainConfig()
        origin = "freshly initialised"
    else:
        from gradzip.lab.train.checkpoint import find_checkpoint

        folder, _notes = find_checkpoint(checkpoint, option="--checkpoint")
        shared = torch.load(Path(folder) / "shared.pt", map_location="cpu", weights_only=True)
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        cfg = TrainConfig(**{k: v for k, v in shared["config"].items() if k in known})
        state = shared["model"]
        origin = f"trained ({folder})"
    if cfg.model is None:
        ids = _cached_ids(cfg.vocab_size, cfg.data)
    else:  # a fine-tuning run's checkpoint: the text through its model's tokenizer
        from gradzip.lab.train.data import Corpus

        ids = Corpus.load(cfg.data, cfg.vocab_size, model=cfg.model).train
    if ids is None:
        return None
    model = build_model(cfg, cfg.vocab_size)
    if state is not None:
        model.load_state_dict(state)
    model.train()
    gen = batch_generator(seed, 0)
    parts, have, batches = [], 0, 0
    while have < numel:
        model.zero_grad(set_to_none=True)
        x, y = sample_batch(ids, cfg.batch_size, cfg.seq_len, gen)
        next_token_loss(model, x, y).backward()
        for p in model.parameters():
            if p.grad is not None and have < numel:
                flat = p.grad.detach().reshape(-1).float()[: numel - have]
                parts.append(flat)
                have += flat.numel()
        batches += 1
    params = sum(p.numel() for p in model.parameters())
    shape = f"--model {cfg.model}" if cfg.model else f"n_layer={cfg.n_layer}, n_embd={cfg.n_embd}"
    what = (
        f"gradient of the main job's model ({origin}, {params:,} parameters, {shape}) on {batches} batch(es) of {cfg.batch_size}x{cfg.seq_len} tokens of its corpus, "
        "parameters' gradients concatenated as in a DDP bucket"
    )
    return torch.cat(parts).contiguous(), what


def bench_input(numel: int, *, source: str = "auto", checkpoint: str | None = None) -> tuple[Tensor, str]:
    """The tensor to time codecs on and what it is.

    Args:
        numel: elements.
        source: ``model`` (the main job's gradient; error if unavailable), ``synthetic``, or
            ``auto`` (the model's gradient when the tokenizer cache has the corpus and the lab
            extra is installed, else synthetic).
        checkpoint: see :func:`model_gradient`.

    Raises:
        ValueError: for an unknown ``source``, or ``source="model"`` without cached token ids.
    """
    if source not in ("auto", "model", "synthetic"):
        raise ValueError(f"--input must be auto, model or synthetic; got {source!r}")
    if source != "synthetic":
        try:
            found = model_gradient(numel, checkpoint=checkpoint)
        except ModuleNotFoundError as exc:
            # without the lab extra there is no corpus or model to take a gradient of
            if source == "model" or not missing_lab_module(exc):
                raise
            found = None
        if found is not None:
            return found
        if source == "model":
            raise ValueError("--input model: the corpus's token ids are not cached; run gradzip train once first")
    return heavy_tailed_gradient(numel), "synthetic heavy-tailed gradient (Student-t, 3 degrees of freedom)"
