"""``gradzip train``: the main job on the command line."""

from __future__ import annotations

import argparse
import dataclasses

from gradzip.comm.routes import COLLECTIVES
from gradzip.control.auto import FIRST_WINDOW_STEPS
from gradzip.lab.train.config import TrainConfig

HELP = """\
Train a GPT-2 style language model on the Shakespeare plays (or --data FILE) across
data-parallel torch.distributed workers whose gradients travel compressed.

With no arguments: 2 local gloo workers, a 3.7 M parameter model, powersgd:approx_rank=4,
300 steps (a few minutes on 2 CPU cores). Under torchrun (RANK/WORLD_SIZE set) this process
runs one rank instead of spawning. Writes OUT/metrics.jsonl, summary.json, loss.png and a
checkpoint.

examples:
  gradzip train
  gradzip train --compressor topk:ratio=0.01 --steps 200 --out runs/topk
  gradzip train --compressor topk:ratio=0.01 --collective twophase --world-size 4
  gradzip train --compressor torch:powersgd:approx_rank=4      # PyTorch's own hook, as an anchor
  gradzip train --optimizer onebit-adam --compressor none      # 1-bit Adam after a dense warm-up
  gradzip train --compressor auto --adapt-every 50 --verify-every 100
  gradzip train --fsdp --compressor topk:ratio=0.01           # sharded, compressed reduce-scatter
  torchrun --nproc-per-node 2 -m gradzip train --steps 50
  gradzip train --checkpoint-every 50 --out runs/a; gradzip train --resume runs/a   # exact resume
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a GPT on Shakespeare with compressed gradients", description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = TrainConfig()
    p.add_argument("--compressor", default=d.compressor, metavar="SPEC",
                   help=f"codec spec, e.g. topk:ratio=0.01 (see 'gradzip list'); add start_step=N to exchange the first N "
                   "steps dense (topk:ratio=0.01,start_step=20); torch:fp16 etc. for PyTorch's hooks "
                   f"(default {d.compressor})")
    p.add_argument("--optimizer", default=d.optimizer, metavar="SPEC",
                   help="adamw, onebit-adam[:warmup_steps=N,bucket_cap_mb=M] or zeroone-adam[:var_freeze_step=N,"
                   "var_update_scaler=K,local_step_scaler=S,local_step_clipper=H,bucket_cap_mb=M]; the last two send "
                   "1-bit momenta after N full-precision steps (unless given: 20%% of --steps, at least "
                   f"--warmup-steps); default {d.optimizer}")
    p.add_argument("--world-size", type=int, default=d.world_size, help=f"local workers to spawn (default {d.world_size})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"sequences per worker per step (default {d.batch_size})")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per sequence (default {d.seq_len})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak AdamW learning rate (default {d.lr})")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help=f"learning-rate warm-up steps (default {d.warmup_steps})")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help=f"AdamW weight decay (default {d.weight_decay})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of model init and data order (default {d.seed})")
    p.add_argument("--data", default=None, metavar="PATH", help="a UTF-8 text file to train on instead of Shakespeare")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help=f"BPE vocabulary size (default {d.vocab_size})")
    p.add_argument("--n-layer", type=int, default=d.n_layer, help=f"transformer blocks (default {d.n_layer})")
    p.add_argument("--n-embd", type=int, default=d.n_embd, help=f"hidden width (default {d.n_embd})")
    p.add_argument("--n-head", type=int, default=d.n_head, help=f"attention heads (default {d.n_head})")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help=f"steps between validation passes (default {d.eval_every})")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches, help=f"validation batches per pass (default {d.eval_batches})")
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb, help=f"DDP bucket size in MB (default {d.bucket_cap_mb})")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (fully_shard per block) and compress its gradient reduce-scatter")
    p.add_argument("--collective", default=d.collective, choices=COLLECTIVES,
                   help="how compressed buckets travel: auto picks by bytes; twophase is the compressed all_reduce "
                        "whose bytes per worker stay flat in the world size (default auto)")
    p.add_argument("--min-compress-bytes", type=int, default=d.min_compress_bytes, metavar="N",
                   help=f"buckets below N bytes travel uncompressed, fused into one all_reduce (default {d.min_compress_bytes})")
    p.add_argument("--no-exchange", action="store_true", help="no gradient exchange at all: measures compute alone (replicas drift)")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help=f"collective timeout in seconds (default {d.timeout_s:g})")
    p.add_argument("--backend", default=d.backend, choices=["auto", "gloo", "nccl"], help="process-group backend (default auto)")
    p.add_argument("--threads", type=int, default=d.threads, help="CPU threads per worker; 0 shares the cores (default 0)")
    p.add_argument("--out", default=None, metavar="DIR", help=f"output folder (default {d.out}, or the resumed run's folder)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="N",
                   help="save a checkpoint every N steps (default 0: only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, metavar="K",
                   help=f"complete checkpoints to keep, newest first; 0 keeps all (default {d.keep_checkpoints})")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue a run exactly from its last complete checkpoint (a run folder or a checkpoint folder)")
    g = p.add_argument_group("monitoring and auto")
    g.add_argument("--monitor-every", type=int, default=d.monitor_every, metavar="N",
                   help=f"quality checks (norm ratio, cosine, relative error) every N steps; 0 off (default {d.monitor_every})")
    g.add_argument("--verify-every", type=int, default=d.verify_every, metavar="N",
                   help="dense all_reduce beside the compressed one every N steps, difference reported; 0 off")
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files to OUT/tensorboard")
    g.add_argument("--norm-warn", type=float, default=d.norm_warn, metavar="R",
                   help=f"warn when a bucket's norm ratio stays under R (default {d.norm_warn})")
    g.add_argument("--norm-warn-checks", type=int, default=d.norm_warn_checks, metavar="K",
                   help=f"... for K consecutive checks (default {d.norm_warn_checks})")
    g.add_argument("--adapt-every", type=int, default=d.adapt_every, metavar="N",
                   help="--compressor auto: re-decide every N steps; the first decision comes after a "
                        f"measuring window of min(N, {FIRST_WINDOW_STEPS}) steps after step 0 (default {d.adapt_every})")
    g.add_argument("--auto-schedule", default=d.auto_schedule, choices=["cost", "accordion", "legacy", "edgc"],
                   help="--compressor auto: bandwidth-aware cost (default), accordion, legacy or edgc")
    g.add_argument("--auto-candidates", default=None, metavar="SPECS",
                   help="--compressor auto: codecs separated by ';', gentlest first (default: the schedule's list)")
    g.add_argument("--auto-max-error", type=float, default=d.auto_max_error, metavar="E",
                   help=f"--compressor auto: largest one-step relative error per bucket (default {d.auto_max_error})")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary table")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["progress"] = not args.quiet
    if values.get("out") is None:
        from gradzip.lab.train.checkpoint import run_folder

        values["out"] = str(run_folder(args.resume)) if args.resume else TrainConfig.out
    return TrainConfig(**values)


def run(args: argparse.Namespace) -> int:
    from gradzip.lab.train.faults import PeerLost, leave
    from gradzip.lab.train.launch import WorkerFailed, launch

    try:
        launch(config_from_args(args))
    except PeerLost as exc:  # this process is a rank under torchrun
        leave(str(exc))
    except WorkerFailed as exc:
        import sys

        from gradzip.lab.cli import one_line

        print(f"gradzip: {one_line(exc)}", file=sys.stderr)
        return 1
    return 0
