"""How much of the gradient Top-K keeps when its ratio is taken per FSDP chunk instead of over
the whole gradient.

One process trains the main job's model (AdamW, no exchange) and at a few steps measures, for
its gradient ``g``, the squared norm the largest ``ratio`` of entries keep, as a fraction of
``|g|^2``: over all of ``g`` at once (about what DDP's Top-K sees with one large bucket) and per
destination chunk of each ``fully_shard`` module (each transformer block and the root, each
parameter split along dim 0 into ``world_size`` parts), which is how ``gradzip.fsdp`` applies it.

    PYTHONPATH=$PWD python benchmarks/fsdp_topk_energy.py --n-layer 2 --n-embd 128 --n-head 4 --seq-len 64
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor

from gradzip.compressors.base import kept_count
from gradzip.lab.train.config import TrainConfig
from gradzip.lab.train.data import Corpus, batch_generator, sample_batch
from gradzip.lab.train.model import build_model


def kept_energy(v: Tensor, ratio: float) -> Tensor:
    """Squared norm of the ``kept_count(numel, ratio)`` largest-magnitude entries of ``v``."""
    return v.abs().topk(kept_count(v.numel(), ratio)).values.square().sum()


def chunk_energy(modules: list[list[torch.nn.Parameter]], world_size: int, ratio: float) -> Tensor:
    """Kept squared norm with Top-K applied to every destination chunk of every module."""
    total = torch.zeros(())
    for params in modules:
        chunks: list[list[Tensor]] = [[] for _ in range(world_size)]
        for p in params:
            rows = -(-p.grad.shape[0] // world_size)  # FSDP pads dim 0 to a multiple of world_size
            for r in range(world_size):
                chunks[r].append(p.grad[r * rows : (r + 1) * rows].reshape(-1))
        for chunk in chunks:
            total += kept_energy(torch.cat(chunk), ratio)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 25, 100], help="steps at which to measure")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    cfg = TrainConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, seq_len=args.seq_len,
                      batch_size=args.batch_size)
    corpus = Corpus.load(None, cfg.vocab_size)
    model = build_model(cfg, corpus.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    generator = batch_generator(cfg.seed, 0)
    blocks = [list(block.parameters()) for block in model.transformer.h]
    in_blocks = {id(p) for params in blocks for p in params}
    modules = blocks + [[p for p in model.parameters() if id(p) not in in_blocks]]

    print(f"| step | global top {args.ratio:g} | " + " | ".join(f"per chunk, {w} ranks" for w in args.world_sizes) + " |")
    print("|---|---|" + "---|" * len(args.world_sizes))
    for step in range(max(args.steps) + 1):
        x, y = sample_batch(corpus.train, cfg.batch_size, cfg.seq_len, generator)
        model(input_ids=x, labels=y).loss.backward()
        if step in args.steps:
            g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            total = g.square().sum()
            cells = [float(kept_energy(g, args.ratio) / total)]
            cells += [float(chunk_energy(modules, w, args.ratio) / total) for w in args.world_sizes]
            print(f"| {step} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
