"""Validation loss and payload bytes of ``gradzip train --fsdp`` per codec, against
``--fsdp --compressor none`` (FSDP's own reduce-scatter), on 2 and 3 ranks.

    PYTHONPATH=$PWD python benchmarks/fsdp_validation.py --steps 100 --out runs/fsdp-validation

Runs one training at a time (each spawns its ranks), writes every run under ``OUT/ws{N}/{spec}``
and prints a Markdown table: final validation loss, its gap to ``none`` in percent, payload
bytes per step (all modules, one rank), the bytes one rank sends per step by the collectives'
formulas (:mod:`gradzip.comm.traffic`), the compression ratio and the median step time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gradzip.lab.train.config import TrainConfig
from gradzip.lab.train.launch import launch

DEFAULT_SPECS = ["none", "uniform:bits=8", "powersgd:approx_rank=4", "topk:ratio=0.01"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", nargs="+", default=DEFAULT_SPECS, help="codec specs; 'none' first is the baseline")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 3])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--out", default="runs/fsdp-validation")
    args = parser.parse_args()

    rows = []
    for world_size in args.world_sizes:
        baseline = None
        for spec in args.specs:
            out = Path(args.out) / f"ws{world_size}" / spec.replace(":", "_").replace(",", "_")
            summary_path = out / "summary.json"
            if not summary_path.exists():  # finished runs are kept, so a rerun only adds what is missing
                cfg = TrainConfig(
                    compressor=spec, fsdp=True, world_size=world_size, steps=args.steps,
                    eval_every=args.eval_every, out=str(out), progress=False,
                )
                launch(cfg)
            summary = json.loads(summary_path.read_text())
            if spec == "none":
                baseline = summary["final_val_loss"]
            rows.append((world_size, spec, summary, baseline))

    print("| ranks | compressor | final val loss | vs none | payload / step | sent / rank / step | ratio | step time |")
    print("|---|---|---|---|---|---|---|---|")
    for world_size, spec, s, baseline in rows:
        gap = f"{100 * (s['final_val_loss'] / baseline - 1):+.2f}%" if baseline else "-"
        print(
            f"| {world_size} | `{spec}` | {s['final_val_loss']:.3f} | {gap} | "
            f"{s['payload_bytes_per_step'] / 1e6:.3f} MB | {s['sent_bytes_per_step'] / 1e6:.3f} MB | "
            f"{s['compression_ratio']:.1f}x | {s['step_s_median']:.2f} s |"
        )


if __name__ == "__main__":
    main()
