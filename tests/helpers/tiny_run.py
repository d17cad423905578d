"""A tiny main-job configuration and corpus, so a spawned training run takes seconds."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from gradzip.lab.train.config import TrainConfig

WORDS = (
    "the king queen sword crown night day love death honour speak swear gentle noble lord lady "
    "what where when shall will would thou thee thy mine heart blood fair foul storm sea land"
).split()


def write_corpus(path: Path, n_lines: int = 1200) -> str:
    """A deterministic made-up text of about 40 KB; returns its path."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) for _ in range(n_lines)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def tiny_config(data: str, out: str, **overrides) -> TrainConfig:
    """About 23 k parameters, 2 x 32 tokens per worker and step, one thread per worker."""
    values = dict(
        n_layer=1, n_embd=32, n_head=2, seq_len=32, batch_size=2, vocab_size=300, data=data, out=out,
        threads=1, eval_every=1000, eval_batches=1, warmup_steps=2, progress=False,
    )
    values.update(overrides)
    return TrainConfig(**values).validate()


def same(a, b) -> bool:
    """Bit-for-bit equality of nested state (tensors compared with torch.equal, dtype included)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def without_plots() -> None:
    """Skip loss.png and layer_ratios.png in this process: drawing them costs more than a tiny run
    (not under test here)."""
    from gradzip.lab.train import layer_ratios, report

    report.plot_losses = lambda *args, **kwargs: None
    layer_ratios.plot = lambda *args, **kwargs: False


def load(folder: Path, name: str) -> dict:
    return torch.load(folder / name, map_location="cpu", weights_only=True)
