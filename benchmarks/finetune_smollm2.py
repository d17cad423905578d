"""Fine-tune SmolLM2-135M once per exchange and tabulate final validation loss and payload bytes.

    python benchmarks/finetune_smollm2.py --out runs/finetune_smollm2 [--steps 100 --batch-size 1]
    python benchmarks/finetune_smollm2.py --out runs/finetune_smollm2 --table-only

Each entry is one ``gradzip finetune`` run on 2 local gloo workers with the same seed, data order
and options; an entry naming an optimizer (``onebit-adam``, ``tsr-adam``, ``demo``) runs it
behind the uncompressed hook, as ``gradzip compare`` does. Runs one at a time; the final checkpoints are deleted (1.6 GB each).
Prints a Markdown table: final validation loss (and against ``none``), payload bytes per step
handed to the collectives by each worker (mean over the run, and over its last step for entries
that start dense), compression against the dense gradient.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from gradzip.lab.train.optimizers import names_optimizer

ENTRIES = ["none", "powersgd:approx_rank=4", "topk:ratio=0.01", "efsignsgd", "onebit-adam"]


def slug(entry: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in entry)


def command(entry: str, out: Path, args: argparse.Namespace) -> list[str]:
    exchange = ["--optimizer", entry, "--compressor", "none"] if names_optimizer(entry) else [
        "--compressor", entry]
    return [sys.executable, "-m", "gradzip", "finetune", *exchange, "--steps", str(args.steps),
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--eval-every",
            str(args.eval_every), "--eval-batches", str(args.eval_batches), "--world-size", "2", "--threads", "1",
            "--out", str(out), "--quiet"]


def table(root: Path, entries: list[str]) -> str:
    rows = []
    for entry in entries:
        folder = root / slug(entry)
        summary_path = folder / "summary.json"
        if not summary_path.exists():
            rows.append((entry, None, None))
            continue
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        rows.append((entry, json.loads(summary_path.read_text()), records))
    base = next((s for e, s, _ in rows if e == "none" and s), None)
    lines = ["| exchange | final val loss | vs none | payload bytes/step (mean) | last step | ratio (mean) "
             "| step s (median) |", "|---|---|---|---|---|---|---|"]
    for entry, s, records in rows:
        if s is None:
            lines.append(f"| `{entry}` | not run | | | | | |")
            continue
        versus = f"{s['final_val_loss'] / base['final_val_loss'] - 1:+.2%}" if base else "-"
        last = records[-1]
        ratio = s["dense_bytes_per_step"] / s["payload_bytes_per_step"]
        lines.append(f"| `{entry}` | {s['final_val_loss']:.4f} | {versus} | {s['payload_bytes_per_step']:,.0f} "
                     f"| {last['payload_bytes']:,} | {ratio:.1f}x | {s['step_s_median']:.2f} |")
    if base:
        lines.append(f"\nstart: validation loss {base['initial_val_loss']:.4f}; dense gradient "
                     f"{base['dense_bytes_per_step']:,.0f} bytes per step; {base['parameters']:,} parameters")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--entries", default=";".join(ENTRIES), help="';'-separated (default: %(default)s)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args()
    entries = [e.strip() for e in args.entries.split(";") if e.strip()]
    if not args.table_only:
        for entry in entries:
            out = args.out / slug(entry)
            if (out / "summary.json").exists():
                continue
            argv = command(entry, out, args)
            print("$", " ".join(argv[1:]), flush=True)
            proc = subprocess.run(argv)
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            if proc.returncode:
                print(f"{entry}: exit code {proc.returncode}", file=sys.stderr)
    print(table(args.out, entries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
