"""``gradzip compare`` on the command line."""

from __future__ import annotations

import argparse
import shlex
import sys

from gradzip.lab.compare.core import NETWORKS, CompareConfig
from gradzip.lab.options import add_arguments, names_where
from gradzip.lab.train.config import FINETUNE_DEFAULTS, TrainConfig

HELP = """\
Run the main job once per compressor on the same workers, same seed and data order, and
compare time to a target validation loss, step time against the compute-alone limit, and
bytes (payload counted by the hook, and bytes on each host's link).

With root, the workers run in emulated hosts (network namespaces) whose links are limited to
--bandwidth by tbf; otherwise on loopback, which the report says. Writes OUT/report.md,
results.json, loss_vs_time.png, loss_vs_bytes.png, layer_ratios.png (when an entry is kimad,
legacy or edgc) and one folder per run under OUT/runs/.

examples:
  gradzip compare --compressors none,fp16,powersgd:approx_rank=4,topk:ratio=0.01 \\
      --world-size 4 --bandwidth 100mbit --steps 100 --out runs/compare-100mbit
  gradzip compare --compressors fp16,torch:fp16,torch:powersgd --network loopback --steps 20
  gradzip compare --compressors powersgd:approx_rank=4,diloco:sync_every=20+uniform:bits=8 --bandwidth 20mbit
  gradzip compare --compressors auto,kimad --network emulated --bandwidth 1gbit \\
      --link-schedule 40:20mbit,80:1gbit --steps 120
  gradzip compare --model smollm2-135m --compressors none,powersgd:approx_rank=4 --world-size 2 --batch-size 2

With --model the runs fine-tune that model; --lr and --warmup-steps then default to those of
'gradzip finetune'.
"""

#: ``gradzip train`` options passed through unchanged (None keeps train's default)
TRAIN_OPTIONS = names_where(TrainConfig, "compare")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "compare", help="time to loss of several compressors side by side on an emulated slow network",
        description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--compressors", default="none,fp16,powersgd:approx_rank=4,topk:ratio=0.01", metavar="SPECS",
                   help="comma-separated specs; torch:fp16, torch:powersgd etc. run PyTorch's hooks; onebit-adam, "
                   "zeroone-adam, tsr-adam, demo and adamw[:options] run that optimizer behind the uncompressed hook; "
                   "diloco:sync_every=H[,...][+CODEC] "
                   "runs DiLoCo with CODEC between the workers (gradzip train --outer, --outer-compressor) "
                   "(default: %(default)s)")
    p.add_argument("--world-size", type=int, default=4, help="workers, one per host (default 4)")
    p.add_argument("--ranks-per-host", type=int, default=1, metavar="K",
                   help="ranks on each emulated host, dividing --world-size; traffic inside a host is not limited, "
                   "and DiLoCo entries run one replica per host (default 1)")
    p.add_argument("--bandwidth", default="100mbit", help="each host's link rate, e.g. 20mbit, 1gbit (default 100mbit)")
    p.add_argument("--steps", type=int, default=100, help="training steps of every run (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of model and data order, shared by all runs (default 0)")
    p.add_argument("--out", default="runs/compare", metavar="DIR", help="output folder (default runs/compare)")
    p.add_argument("--target-loss", type=float, default=None,
                   help="validation loss to reach (default: final validation loss of 'none' plus --target-margin)")
    p.add_argument("--target-margin", type=float, default=None, metavar="F",
                   help="the default target's margin over 'none''s final validation loss, a fraction in [0, 1] "
                   "(default 0.01: 1%%; with --report-only, the comparison's own)")
    p.add_argument("--network", choices=NETWORKS, default="auto",
                   help="emulated hosts, loopback, or auto: emulated where root allows (default auto)")
    p.add_argument("--no-pin-cpus", action="store_true",
                   help="let the kernel place the workers on any core; by default each emulated host's workers run "
                   "on their own share of the cores (taskset), as real hosts do not take each other's")
    p.add_argument("--link-schedule", default=None, metavar="STEP:RATE,...",
                   help="change the links' rate during every run: 40:20mbit,80:100mbit sets 20mbit once step 39 is "
                   "recorded and 100mbit once step 79 is; each run starts at --bandwidth (needs --network emulated)")
    p.add_argument("--timeout-s", type=float, default=3600.0,
                   help="wall-clock limit of one run; a run past it is stopped and reported (default 3600)")
    p.add_argument("--collective-timeout-s", type=float, default=300.0,
                   help="timeout of each collective inside a run (default 300)")
    p.add_argument("--no-limit", action="store_true", help="skip the 'limit' row (no gradient exchange)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the 'none' row (dense DDP, the slowest on a slow link) unless --compressors names it; "
                        "needs --target-loss, and the ratios against 'none' are left blank")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run every row N times, in rounds of all rows, so that a slow minute of a shared machine "
                   "falls on one round's rows alike; the report gives medians over the rounds and the range of "
                   "compute utilisation and time to target, in [1, 20] (default 1)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoint")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the report, results and plots again from the runs in --out "
                        "(of a stopped comparison: from the runs it finished)")
    group = p.add_argument_group("training options passed to 'gradzip train' (its defaults when omitted)")
    add_arguments(group, TrainConfig, names=TRAIN_OPTIONS, defaults=False)
    p.set_defaults(func=run)


def train_options(args: argparse.Namespace) -> dict:
    """The training options the user gave; with ``--model``, ``gradzip finetune``'s defaults
    for those not given (its learning rate and warm-up, not those of a GPT-2 from scratch)."""
    given = {name: getattr(args, name) for name in TRAIN_OPTIONS if getattr(args, name) is not None}
    if "model" not in given:
        return given
    return {**{k: v for k, v in FINETUNE_DEFAULTS.items() if k in TRAIN_OPTIONS}, **given}


def config(args: argparse.Namespace) -> CompareConfig:
    """The comparison the command line asks for (not yet validated)."""
    from gradzip.lab.compare.core import split_compressors

    return CompareConfig(
        compressors=split_compressors(args.compressors),
        world_size=args.world_size,
        ranks_per_host=args.ranks_per_host,
        bandwidth=args.bandwidth,
        steps=args.steps,
        seed=args.seed,
        out=args.out,
        network=args.network,
        pin_cpus=not args.no_pin_cpus,
        link_schedule=args.link_schedule,
        target_loss=args.target_loss,
        **({} if args.target_margin is None else {"target_margin": args.target_margin}),
        timeout_s=args.timeout_s,
        collective_timeout_s=args.collective_timeout_s,
        limit=not args.no_limit,
        baseline=not args.no_baseline,
        repeats=args.repeats,
        keep_checkpoints=args.keep_checkpoints,
        train_options=train_options(args),
        command="gradzip " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["compare"] else "",
    )


def run(args: argparse.Namespace) -> int:
    from gradzip.lab.compare.core import rewrite_report, run_compare

    if args.report_only:
        rows = rewrite_report(args.out, target_loss=args.target_loss, target_margin=args.target_margin)
        return 0 if all(r["status"] == "ok" for r in rows) else 1
    from gradzip.lab.train.launch import sigterm_as_interrupt

    with sigterm_as_interrupt():  # stopped by a scheduler: the runs and the hosts go as on Ctrl-C
        rows = run_compare(config(args), log=lambda line: print(line, flush=True))
    return 0 if all(r["status"] == "ok" for r in rows) else 1
