"""``gradzip list``: every codec with its properties and payload for a 1 M element fp32 tensor."""

from __future__ import annotations

import argparse
import json

from gradzip.compressors import REGISTRY, build

EXAMPLE_NUMEL = 1 << 20


def codec_rows(numel: int = EXAMPLE_NUMEL) -> list[dict]:
    """One row per registered codec, built with its default parameters."""
    rows = []
    for name in sorted(REGISTRY):
        codec = build(name)
        payload = codec.payload_nbytes(numel)
        rows.append(
            {
                "codec": codec.spec,
                "aggregatable": codec.aggregatable,
                "unbiased": codec.unbiased,
                "shared_seed": codec.needs_shared_seed,
                "error_feedback": codec.error_feedback,
                "payload_bytes_1m": payload,
                "compression_ratio": numel * 4 / payload,
                "summary": (type(codec).__doc__ or "").strip().splitlines()[0],
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    rows = codec_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = f"{'codec':<44} {'aggr':>4} {'unb':>4} {'seed':>4} {'ef':>3} {'bytes@1M':>10} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    yes = {True: "yes", False: "-"}
    for r in rows:
        print(
            f"{r['codec']:<44} {yes[r['aggregatable']]:>4} {yes[r['unbiased']]:>4} {yes[r['shared_seed']]:>4} "
            f"{yes[r['error_feedback']]:>3} {r['payload_bytes_1m']:>10,} {r['compression_ratio']:>6.1f}x"
        )
    print(f"\nbytes@1M: payload for a {EXAMPLE_NUMEL:,} element fp32 tensor ({EXAMPLE_NUMEL * 4:,} bytes dense).")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("list", help="list the codecs with their properties and payload sizes")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
