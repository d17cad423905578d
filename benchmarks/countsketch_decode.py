"""How much of the count sketch's support decodes exactly on the demo job's gradient.

Every rank's gradient of the demo model (the default ``gradzip train`` configuration, freshly
initialised, one batch of its corpus per rank, as :mod:`benchmarks.aggregatable_bytes` takes it)
is sparsified by a codec and sketched; the sketches are summed and decoded on the union of the
kept sets, as :class:`gradzip.comm.countsketch.CountSketchReducer` does across ranks. Printed:
the share of coordinates each rank keeps, the union's share, the sketch's cells per coordinate,
the share of the union decoded exactly (to 1e-6 of the largest value) and the decode's relative
error against the mean of the sparsified gradients.

    python benchmarks/countsketch_decode.py                      # TAGC's defaults, 3 ranks
    python benchmarks/countsketch_decode.py --spec countsketch:ratio=0.01,width=2 --ranks 4

Needs the demo job's token ids in the tokenizer cache (any ``gradzip train`` run puts them there).
"""

from __future__ import annotations

import argparse

import torch

from gradzip.compressors import build
from gradzip.compressors.countsketch import sketch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="countsketch", help="a countsketch spec (default: its defaults)")
    parser.add_argument("--ranks", type=int, default=3, help="simulated ranks, one batch each (default 3)")
    args = parser.parse_args()

    from gradzip.lab.bench_input import model_gradient
    from gradzip.lab.train.config import TrainConfig
    from gradzip.lab.train.model import build_model

    cfg = TrainConfig()
    numel = sum(p.numel() for p in build_model(cfg, cfg.vocab_size).parameters())
    codec = build(args.spec)
    grads = []
    for rank in range(args.ranks):
        found = model_gradient(numel, seed=rank)
        if found is None:
            raise SystemExit("the demo job's token ids are not cached: run `gradzip train --steps 1` once")
        grads.append(found[0])
    hashes = codec.hashes(numel, step=0, key=0)
    masks = [codec.keep(g) for g in grads]
    union = torch.stack(masks).any(0)
    table = sum(sketch(g[m] / args.ranks, m.nonzero().reshape(-1), hashes) for g, m in zip(grads, masks))
    decoded = codec.decode(union, table, step=0, key=0, like=grads[0])
    truth = sum(torch.where(m, g, torch.zeros_like(g)) for g, m in zip(grads, masks)) / args.ranks
    exact = (decoded - truth).abs() <= 1e-6 * truth.abs().max()
    print(f"{codec.spec} on {numel:,} coordinates, {args.ranks} ranks")
    print(f"kept per rank     {', '.join(f'{m.float().mean().item():.3f}' for m in masks)}")
    print(f"union             {union.float().mean().item():.3f}")
    print(f"cells/coordinate  {codec.rows * codec.cols(numel) / numel:.3f}")
    print(f"union exact       {exact[union].float().mean().item():.4f}")
    print(f"relative error    {((decoded - truth).norm() / truth.norm()).item():.4f}")


if __name__ == "__main__":
    main()
