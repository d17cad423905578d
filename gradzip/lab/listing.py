"""``gradzip list``: every codec with its properties and payload for a 1 M element fp32 tensor.

The rows come from :func:`gradzip.compressors.catalog.codec_rows`, which the docs' codec page
reads too.
"""

from __future__ import annotations

import argparse
import json

from gradzip.compressors.catalog import EXAMPLE_MATRIX, EXAMPLE_NUMEL, codec_rows


def run(args: argparse.Namespace) -> int:
    rows = codec_rows()
    assert EXAMPLE_MATRIX[0] * EXAMPLE_MATRIX[1] == EXAMPLE_NUMEL
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    names = [r["codec"].split(":")[0] for r in rows]
    defaults = [_shown(r["defaults"]) for r in rows]
    wn, wd = max(5, *map(len, names)), max(8, *map(len, defaults))
    header = (
        f"{'codec':<{wn}} {'defaults':<{wd}} {'aggr':>4} {'unb':>4} {'seed':>4} {'ef':>3} {'bytes@1M':>10} {'ratio':>7}"
    )
    print(header)
    print("-" * len(header))
    yes = {True: "yes", False: "-"}
    for r, name, shown in zip(rows, names, defaults):
        mark = "*" if "matrix" in r["example"] else ""
        print(
            f"{name:<{wn}} {shown:<{wd}} {yes[r['aggregatable']]:>4} {yes[r['unbiased']]:>4} "
            f"{yes[r['shared_seed']]:>4} {yes[r['error_feedback']]:>3} {r['payload_bytes_1m']:>10,}"
            f"{mark:1}{r['compression_ratio']:>6.1f}x"
        )
    print(
        f"\nbytes@1M: payload for a {EXAMPLE_NUMEL:,} element fp32 tensor ({EXAMPLE_NUMEL * 4:,} bytes dense); "
        f"* for a {EXAMPLE_MATRIX[0]} x {EXAMPLE_MATRIX[1]} fp32 matrix (PowerSGD compresses matrices; "
        "flat tensors travel uncompressed). aggr: aggregatable (all_reduce); unb: unbiased; seed: needs a "
        "seed shared by all ranks; ef: error feedback by default. Every codec also takes start_step=N "
        "(default 0): the first N steps are exchanged dense, e.g. topk:ratio=0.01,start_step=20. Under DDP "
        "every codec also takes embeddings=none|fp16|bf16|int8: the embedding tables sent by that codec apart, "
        "e.g. separate:embeddings=int8 (docs/ddp.md)."
        "\n\nAlso taken by --compressor: schedules that pick a codec per bucket or per layer as training runs "
        "(auto, kimad, legacy, edgc; see docs/auto-and-monitoring.md), PyTorch's own hooks as anchors "
        "(torch:allreduce, torch:fp16, torch:bf16, torch:powersgd[:approx_rank=R]), and a sparsifier "
        "followed by a quantizer of its values (topk:ratio=0.01+uniform:bits=8)."
    )
    return 0


def _shown(defaults: str) -> str:
    """A codec's defaults without ``start_step=0``, which every codec takes (said below the table)."""
    return ",".join(part for part in defaults.split(",") if part and part != "start_step=0")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "list", help="list the codecs with their properties and payload sizes",
        description="Every registered codec with its defaults, whether its payloads add up (all_reduce sums them), "
        "whether it is unbiased, needs a shared seed or keeps error feedback, and its payload bytes and ratio "
        "for a 1 M-element fp32 tensor, counted by its formula (nothing is trained or timed).",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
