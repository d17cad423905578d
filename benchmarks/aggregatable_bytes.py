"""Bytes per worker against world size for the codecs whose payloads add up.

For each world size, spawns that many gloo ranks on loopback. Every rank takes the gradient of
the demo job's model (the default ``gradzip train`` configuration, freshly initialised, one batch
of its corpus per rank) as one bucket with the model's layer shapes, and reduces it for a few
steps through each codec's reducer: the dense fp32 ring all_reduce (``none``), the aggregatable
codecs (summed by ``all_reduce``: ``separate``, ``radius``, ``countsketch``, ``randomk``,
``powersgd`` and its 8-bit factors, ``int8``; a spec with ``embeddings=`` through the DDP
hook's split reducer, the model's tables taken), and, for contrast, ``topk:ratio=0.01`` through the route the
chooser picks (``all_gather`` at 2 ranks, two-phase above).

Bytes per worker are counted two ways: by the formulas the reducer records in its metrics
(:mod:`gradzip.comm.traffic`), and measured as the growth of ``wchar`` in ``/proc/self/io``
around the exchange (gloo's sockets and message headers included). A ring all_reduce sends
``2 (W - 1) / W`` of its payload per worker, so a summed payload costs at most twice its size at
any world size; an ``all_gather`` costs ``W - 1`` times it.

    python benchmarks/aggregatable_bytes.py                  # world sizes 2..8, 3 steps
    python benchmarks/aggregatable_bytes.py --world-sizes 2,3 --steps 2

Needs the demo job's token ids in the tokenizer cache (any ``gradzip train`` run puts them
there). Writes OUT/aggregatable_bytes.json, OUT/aggregatable_bytes.md and OUT/aggregatable_bytes.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from collectives import written_bytes

import gradzip
from gradzip.choice import parse_compressor
from gradzip.comm import make_reducer
from gradzip.compressors.spec import split_spec_list
from gradzip.keys import bucket_key
from gradzip.testing import run_ranks

DEFAULT_CODECS = (
    "none,separate,radius,countsketch:ratio=0.01,width=2,randomk,powersgd,powersgd:factor_bits=8,int8,topk:ratio=0.01"
)


def demo_bucket(rank: int) -> tuple[torch.Tensor, list[torch.Size], str]:
    """The demo job's model gradient on one batch seeded by ``rank`` (flat, fp32), the shapes of
    its parameters in bucket order, and a description.

    Raises:
        SystemExit: if the corpus's token ids are not in the tokenizer cache.
    """
    from gradzip.lab.bench_input import model_gradient
    from gradzip.lab.train.config import TrainConfig
    from gradzip.lab.train.model import build_model

    cfg = TrainConfig()
    shapes = [p.shape for p in build_model(cfg, cfg.vocab_size).parameters()]
    numel = sum(s.numel() for s in shapes)
    found = model_gradient(numel, seed=rank)
    if found is None:
        raise SystemExit("the demo job's token ids are not cached: run `gradzip train --steps 1` once")
    return found[0], shapes, found[1]


def _reducer(spec: str, shapes: list[torch.Size]):
    """``(reducer, its metrics, the bucket's key)``: a spec with ``embeddings=`` gets the DDP
    hook's split reducer with the demo model's tables taken (its buckets are keyed by
    parameters); any other spec its codec's reducer."""
    if parse_compressor(spec).hook_options:
        from gradzip.lab.train.config import TrainConfig
        from gradzip.lab.train.model import build_model

        cfg = TrainConfig()
        state = gradzip.CompressionState(spec)
        model = build_model(cfg, cfg.vocab_size)
        tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        params = list(model.parameters())
        state.reducer.take(i for i, p in enumerate(params) if id(p) in tables)
        return state.reducer, state.metrics, bucket_key(range(len(shapes)), [s.numel() for s in shapes])
    reducer = make_reducer(spec)
    return reducer, reducer.metrics, "bucket"


def _bench_rank(rank: int, world_size: int, codecs: list[str], steps: int) -> dict:
    grad, shapes, what = demo_bucket(rank)
    rows = []
    for spec in codecs:
        reducer, recorded, key = _reducer(spec, shapes)
        payload, sent, written, routes = [], [], [], []
        for step in range(steps):
            torch.distributed.barrier()
            before = written_bytes()
            reducer.reduce(key, grad, step=step, shapes=shapes).wait()
            written.append(written_bytes() - before)
            metrics = recorded.pop()
            payload.append(metrics["payload_bytes"])
            sent.append(metrics["sent_bytes"])
            routes.append("+".join(bucket["collective"] for bucket in metrics["buckets"].values()))
        rows.append({"spec": spec, "routes": routes, "payload": payload, "sent": sent, "written": written})
    return {"rows": rows, "numel": grad.numel(), "what": what}


def measure(world_sizes: list[int], codecs: list[str], steps: int) -> tuple[list[dict], dict]:
    """One row per (world size, codec): per step, bytes per worker (mean over ranks)."""
    table, info = [], {}
    for world_size in world_sizes:
        ranks = run_ranks(_bench_rank, world_size, codecs, steps, timeout_s=900)
        info = {"numel": ranks[0]["numel"], "what": ranks[0]["what"]}
        for i, row in enumerate(ranks[0]["rows"]):
            per_rank = [r["rows"][i] for r in ranks]
            entry = {"world_size": world_size, "spec": row["spec"], "routes": row["routes"]}
            for field in ("payload", "sent", "written"):
                entry[field] = [statistics.mean(r[field][s] for r in per_rank) for s in range(steps)]
            table.append(entry)
        print(f"world size {world_size}: done", flush=True)
    return table, info


def markdown(table: list[dict], info: dict, steps: int) -> str:
    """Per world size, the last step's payload and sent bytes per worker; then each codec's
    growth from the smallest to the largest world size."""
    specs = list(dict.fromkeys(r["spec"] for r in table))
    sizes = sorted({r["world_size"] for r in table})
    index = {(r["world_size"], r["spec"]): r for r in table}
    dense = info["numel"] * 4
    header = ["| world size | " + " | ".join(f"`{s}`" for s in specs) + " |", "|---:|" + "---:|" * len(specs)]
    lines = [
        f"One bucket: {info['what']}; {info['numel']:,} fp32 elements ({dense / 1e6:.2f} MB), {steps} steps per codec.",
        "",
        "kB of payload each worker hands to the collectives at the last step (counted):",
        "",
        *header,
    ]
    for w in sizes:
        lines.append(f"| {w} | " + " | ".join(f"{index[(w, s)]['payload'][-1] / 1e3:,.1f}" for s in specs) + " |")
    lines += ["", "kB each worker sends at the last step, counted by the route's formula / measured (wchar):", "", *header]
    for w in sizes:
        cells = [f"{index[(w, s)]['sent'][-1] / 1e3:,.1f} / {index[(w, s)]['written'][-1] / 1e3:,.1f}" for s in specs]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lo, hi = sizes[0], sizes[-1]
    lines += [
        "",
        f"From {lo} to {hi} ranks (last step; the first step where it differs, e.g. a refresh round):",
        "",
        f"| codec | route at {hi} | dense / payload at {lo} | payload growth | sent growth | first step's payload at {lo} |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for s in specs:
        first, last = index[(lo, s)], index[(hi, s)]
        p_lo, p_hi = first["payload"][-1], last["payload"][-1]
        growth = f"{p_hi / p_lo:.2f}x" if p_lo else "-"
        sent = f"{last['sent'][-1] / first['sent'][-1]:.2f}x" if first["sent"][-1] else "-"
        ratio = f"{dense / p_lo:,.1f}x" if p_lo else "-"
        step0 = f"{first['payload'][0] / 1e3:,.1f} kB" if first["payload"][0] != p_lo else "same"
        lines.append(f"| `{s}` | {last['routes'][-1]} | {ratio} | {growth} | {sent} | {step0} |")
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.6))
    for spec in dict.fromkeys(r["spec"] for r in table):
        rows = [r for r in table if r["spec"] == spec]
        xs = [r["world_size"] for r in rows]
        line = ax.plot(xs, [r["sent"][-1] / 1e6 for r in rows], "o-", label=spec)[0]
        ax.plot(xs, [r["written"][-1] / 1e6 for r in rows], "x", color=line.get_color(), markersize=8)
    ax.set_yscale("log")
    ax.set_xlabel("world size (gloo ranks on loopback)")
    ax.set_ylabel("MB sent per worker (last step)")
    ax.set_title("The demo job's gradient: lines counted, x measured (wchar)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,3,4,5,6,7,8", help="comma-separated (default 2..8)")
    parser.add_argument("--codecs", default=DEFAULT_CODECS, help=f"specs, comma-separated (default {DEFAULT_CODECS})")
    parser.add_argument("--steps", type=int, default=3, help="exchanges per codec (default 3; Radius refreshes on the first)")
    parser.add_argument("--out", default="benchmarks/results/aggregatable_bytes", help="output folder")
    args = parser.parse_args(argv)
    try:
        world_sizes = [int(w) for w in args.world_sizes.split(",")]
        codecs = split_spec_list(args.codecs, name="--codecs")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if any(w < 2 for w in world_sizes) or args.steps < 1:
        raise SystemExit("--world-sizes must be integers >= 2 and --steps >= 1")
    table, info = measure(world_sizes, codecs, args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "aggregatable_bytes.json").write_text(json.dumps({"info": info, "table": table}, indent=1))
    text = markdown(table, info, args.steps)
    (out / "aggregatable_bytes.md").write_text(text)
    plot(table, out / "aggregatable_bytes.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
