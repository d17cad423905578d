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
    python benchmarks/countsketch_decode.py --tagc-ladder         # TAGC's code's threshold rule

``--tagc-ladder`` keeps what TAGC's reference code keeps instead of the top ``ratio``: every
entry at or above the largest value of its fixed ladder (1e-20 to 0.5) that drops less than
``1 - ratio`` of the entries.

Needs the demo job's token ids in the tokenizer cache (any ``gradzip train`` run puts them there).
"""

from __future__ import annotations

import argparse

import torch

from gradzip.compressors import build
from gradzip.compressors.countsketch import Located, sketch

#: the thresholds TAGC's reference code (``tagc/tagc.py``) bisects over
TAGC_LADDER = (1e-20, 1e-15, 1e-10, 1e-8, 1e-7, 2e-7, 5e-7, 1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5,
               1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 1e-1, 2e-1, 5e-1)


def ladder_mask(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """TAGC's kept set: entries at or above the largest ladder value dropping less than ``1 - ratio``."""
    magnitude = x.abs()
    below = [t for t in TAGC_LADDER if (magnitude < t).float().mean().item() < 1 - ratio]
    return magnitude >= below[-1] if below else torch.ones_like(magnitude, dtype=torch.bool)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="countsketch", help="a countsketch spec (default: its defaults)")
    parser.add_argument("--ranks", type=int, default=3, help="simulated ranks, one batch each (default 3)")
    parser.add_argument("--tagc-ladder", action="store_true", help="keep by TAGC's threshold ladder, not the top ratio")
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
    masks = [ladder_mask(g, codec.ratio) if args.tagc_ladder else codec.keep(g) for g in grads]
    union = torch.stack(masks).any(0)
    table = sum(sketch(g[m] / args.ranks, Located.of(m.nonzero().reshape(-1), hashes)) for g, m in zip(grads, masks))
    decoded = codec.decode(union, table, step=0, key=0, like=grads[0])
    truth = sum(torch.where(m, g, torch.zeros_like(g)) for g, m in zip(grads, masks)) / args.ranks
    exact = (decoded - truth).abs() <= 1e-6 * truth.abs().max()
    rule = "TAGC's threshold ladder" if args.tagc_ladder else "the top ratio"
    print(f"{codec.spec} on {numel:,} coordinates, {args.ranks} ranks, kept by {rule}")
    print(f"kept per rank     {', '.join(f'{m.float().mean().item():.3f}' for m in masks)}")
    print(f"union             {union.float().mean().item():.3f}")
    print(f"cells/coordinate  {codec.rows * codec.cols(numel) / numel:.3f}")
    print(f"union exact       {exact[union].float().mean().item():.4f}")
    print(f"relative error    {((decoded - truth).norm() / truth.norm()).item():.4f}")


if __name__ == "__main__":
    main()
