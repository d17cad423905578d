"""``gradzip list``: every codec with its properties and payload for a 1 M element fp32 tensor.

PowerSGD compresses matrices, not flat tensors: its row gives the payload for a 1024 x 1024
fp32 matrix (the same 1 M elements) at its default rank, and says so.
"""

from __future__ import annotations

import argparse
import json

from gradzip.compressors import REGISTRY, build

EXAMPLE_NUMEL = 1 << 20
#: the matrix shape of the example tensor for codecs that compress matrices
EXAMPLE_MATRIX = (1024, 1024)


def codec_rows(numel: int = EXAMPLE_NUMEL) -> list[dict]:
    """One row per registered codec, built with its default parameters."""
    rows = []
    for name in sorted(REGISTRY):
        codec = build(name)
        matrix = hasattr(codec, "matrix_payload_nbytes")
        payload = codec.matrix_payload_nbytes(EXAMPLE_MATRIX) if matrix else codec.payload_nbytes(numel)
        rows.append(
            {
                "codec": codec.spec,
                "defaults": ",".join(f"{k}={_text(v)}" for k, v in codec.params.items()),
                "aggregatable": codec.aggregatable,
                "unbiased": codec.unbiased,
                "shared_seed": codec.needs_shared_seed,
                "error_feedback": codec.error_feedback,
                "payload_bytes_1m": payload,
                "compression_ratio": numel * 4 / payload,
                "example": f"{EXAMPLE_MATRIX[0]}x{EXAMPLE_MATRIX[1]} matrix" if matrix else f"{numel} elements",
                "summary": (type(codec).__doc__ or "").strip().splitlines()[0],
            }
        )
    return rows


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def run(args: argparse.Namespace) -> int:
    rows = codec_rows()
    assert EXAMPLE_MATRIX[0] * EXAMPLE_MATRIX[1] == EXAMPLE_NUMEL
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = (
        f"{'codec':<10} {'defaults':<50} {'aggr':>4} {'unb':>4} {'seed':>4} {'ef':>3} {'bytes@1M':>10} {'ratio':>7}"
    )
    print(header)
    print("-" * len(header))
    yes = {True: "yes", False: "-"}
    for r in rows:
        mark = "*" if "matrix" in r["example"] else ""
        print(
            f"{r['codec'].split(':')[0]:<10} {r['defaults']:<50} {yes[r['aggregatable']]:>4} {yes[r['unbiased']]:>4} "
            f"{yes[r['shared_seed']]:>4} {yes[r['error_feedback']]:>3} {r['payload_bytes_1m']:>10,}"
            f"{mark:1}{r['compression_ratio']:>6.1f}x"
        )
    print(
        f"\nbytes@1M: payload for a {EXAMPLE_NUMEL:,} element fp32 tensor ({EXAMPLE_NUMEL * 4:,} bytes dense); "
        f"* for a {EXAMPLE_MATRIX[0]} x {EXAMPLE_MATRIX[1]} fp32 matrix (PowerSGD compresses matrices; "
        "flat tensors travel uncompressed). aggr: aggregatable (all_reduce); unb: unbiased; seed: needs a "
        "seed shared by all ranks; ef: error feedback by default. Every codec also takes start_step=N "
        "(default 0): the first N steps are exchanged dense, e.g. topk:ratio=0.01,start_step=20."
    )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("list", help="list the codecs with their properties and payload sizes")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
