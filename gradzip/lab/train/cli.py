"""``gradzip train``: the main job on the command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from gradzip.lab.options import add_arguments, as_argument
from gradzip.lab.train.config import TrainConfig

HELP = """\
Train a GPT-2 style language model on the Shakespeare plays (or --data FILE) across
data-parallel torch.distributed workers whose gradients travel compressed.

With no arguments: 2 local gloo workers, a 3.7 M parameter model, powersgd:approx_rank=4,
300 steps (about 3 minutes on 2 CPU cores). Under torchrun (RANK/WORLD_SIZE set) this process
runs one rank instead of spawning. Writes OUT/metrics.jsonl, summary.json, loss.png (and
layer_ratios.png, the compression ratio of every layer at every step, under kimad, legacy or edgc)
and a checkpoint; a run without --resume first removes the checkpoints an earlier run left in OUT.

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
    add_arguments(p, TrainConfig)
    add_out_argument(p)
    p.set_defaults(func=run)


def add_out_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"output folder (default {TrainConfig.out}, or the resumed run's folder); a run that "
                        "does not resume replaces what an earlier run left there, its checkpoints too")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's config (under ``--resume``, the settings not given are the checkpoint's)."""
    return config_and_notes(args)[0]


def config_and_notes(args: argparse.Namespace) -> tuple[TrainConfig, list[str], Path | None]:
    """The run's config, what to say about it once it is checked (see
    :func:`with_checkpoint_settings`), and under ``--resume`` the checkpoint folder it continues
    (found and verified once here)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = with_absolute_paths({k: v for k, v in vars(args).items() if k in names})
    notes: list[str] = []
    folder = None
    if values.get("resume"):
        values, notes, folder = with_checkpoint_settings(values, given_options(args))
    if values.get("out") is None:
        from gradzip.lab.train.checkpoint import run_folder

        values["out"] = str(run_folder(args.resume)) if args.resume else TrainConfig.out
    return TrainConfig(**values), notes, folder


def with_absolute_paths(values: dict) -> dict:
    """``values`` with ``data`` and a ``model`` folder made absolute: the checkpoint keeps the
    run's settings, and ``--resume`` from another working directory must find the same files."""
    from gradzip.lab.train.pretrained import SMOLLM2

    values = dict(values)
    for name in ("data", "model"):
        path = values.get(name)
        if isinstance(path, str) and path != SMOLLM2 and os.path.exists(path):
            values[name] = os.path.abspath(path)
    return values


def given_options(args: argparse.Namespace) -> set[str]:
    """The TrainConfig fields given on the command line (every field when the raw arguments are
    not known: a namespace built by hand)."""
    argv = getattr(args, "argv", None)
    if argv is None:
        return {f.name for f in dataclasses.fields(TrainConfig)}
    probe = argparse.ArgumentParser(add_help=False)
    add_arguments(probe, TrainConfig, defaults=False)
    add_out_argument(probe)
    known, _rest = probe.parse_known_args(argv)
    return {name for name, value in vars(known).items() if value is not None}


def with_checkpoint_settings(values: dict, given: set[str]) -> tuple[dict, list[str], Path]:
    """``values`` with every setting not in ``given`` taken from the checkpoint ``--resume`` names,
    so that ``gradzip train --resume runs/a`` continues run ``a`` as it was started (its model,
    codec, world size, steps, ...); what is given still wins, within what a resume may change.
    ``--quiet`` is this command's own.
    Also the notes to print once the run is checked (which settings came from the checkpoint, and
    a changed ``--steps``) and the checkpoint folder.

    Raises:
        ValueError: when ``--resume`` holds no usable checkpoint.
    """
    from gradzip.lab.train.checkpoint import find_checkpoint, manifest_of

    folder, _passed_over = find_checkpoint(values["resume"])
    saved = manifest_of(folder).get("config", {})
    values, taken = dict(values), []
    for name, value in saved.items():
        if name in ("resume", "out", "progress") or name in given or name not in values or values[name] == value:
            continue
        values[name] = value
        taken.append(as_argument(TrainConfig, name, value) if value is not None else f"no --{name.replace('_', '-')}")
    notes = [f"the checkpoint's settings: {', '.join(taken)}"] if taken else []
    if "steps" in given and saved.get("steps") not in (None, values["steps"]):
        notes.append(f"--steps {values['steps']} where the checkpoint's run had {saved['steps']} (the "
                     "learning-rate schedule follows the new count from here)")
    return values, [f"resuming with {note}" for note in notes], folder


def run(args: argparse.Namespace) -> int:
    from gradzip.lab.train.faults import PeerLost, leave
    from gradzip.lab.train.launch import WorkerFailed, launch

    try:
        cfg, notes, folder = config_and_notes(args)
        summary = launch(cfg, notes, checkpoint=folder)
    except PeerLost as exc:  # this process is a rank under torchrun
        leave(str(exc))
    except WorkerFailed as exc:
        from gradzip.lab.cli import one_line

        print(f"gradzip: {one_line(exc)}", file=sys.stderr)
        return 1
    if summary and summary.get("diverged"):  # the run ended, its files are written: say why it failed
        from gradzip.lab.train.report import command

        print(f"{command()}: {summary['diverged']}", file=sys.stderr)
        return 1
    return 0
