"""The ``gradzip`` command. Thin: each subcommand lives beside the code it drives.

Every subcommand module exposes ``add_parser(subparsers)`` (which sets ``func`` on its parser)
and is listed in :data:`COMMANDS`. User errors (a ``ValueError``, a missing file, a number too
large for the arithmetic it feeds) print one line and exit 2, never a traceback. Options declared
``type=int`` or ``type=float`` read ASCII numbers only: no other scripts' digits, no ``1_000``,
and no NaN or infinity.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import signal
import sys
import tempfile
from pathlib import Path

from gradzip.compressors.values import FLOAT_TEXT, INT_TEXT, shown
from gradzip.lab import missing_lab_module

#: modules that contribute subcommands, in the order ``--help`` lists them
COMMANDS = [
    "gradzip.lab.train.cli",
    "gradzip.lab.train.finetune",
    "gradzip.lab.listing",
    "gradzip.lab.bench",
    "gradzip.lab.compare.cli",
    "gradzip.lab.cluster.cli",
    "gradzip.lab.simulate.cli",
]


def one_line(text: object) -> str:
    """``text`` with its line breaks escaped, so a message quoting user input stays one line."""
    return str(text).strip().replace("\r", "\\r").replace("\n", "\\n")


def ascii_int(text: str) -> int:
    """An option's integer: ASCII digits with an optional sign.

    Raises:
        argparse.ArgumentTypeError: for anything else.
    """
    if not INT_TEXT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"must be an integer written in ASCII digits; got {shown(text)}")
    return int(text)


def finite_float(text: str) -> float:
    """An option's number: ASCII decimal or exponent notation that is finite as a float.

    Raises:
        argparse.ArgumentTypeError: for anything else, NaN and numbers beyond the float range included.
    """
    if not FLOAT_TEXT.fullmatch(text.strip()) or not math.isfinite(float(text)):
        raise argparse.ArgumentTypeError(f"must be a finite number written in ASCII; got {shown(text)}")
    return float(text)


def writable_folder(path: str | os.PathLike, option: str) -> Path:
    """Make sure ``path`` is a folder this process can write to, creating it if need be.

    Raises:
        ValueError: naming ``option`` and why not, in one line.
    """
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{option} {shown(str(path))} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"{option} {shown(str(path))} cannot be written: {reason}") from None
    return folder


def warn(message: str) -> None:
    """One warning line on stderr, the way errors are printed."""
    print(f"gradzip: warning: {one_line(message)}", file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        # No abbreviations: one can name another option (compare's --compressor read as its
        # --compressors, and ran what the other option's value named).
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # Every subcommand's type=int and type=float options read through these.
        self.register("type", int, ascii_int)
        self.register("type", float, finite_float)

    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"gradzip: error: {one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gradzip",
        description=(
            "Compressed gradient exchange for data-parallel training on torch.distributed. "
            "Run 'gradzip train' to train a small GPT on Shakespeare across local gloo workers."
        ),
    )
    from gradzip import __version__

    parser.add_argument("--version", action="version", version=f"gradzip {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # which options were given (train --resume)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        if missing_lab_module(exc):
            print(f"gradzip: error: this command needs the lab extra (no module {exc.name!r}): "
                  "pip install 'gradzip[lab]'", file=sys.stderr)
            return 2
        raise
    except BrokenPipeError:  # the reader went away (gradzip list | head): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    except (ValueError, OSError, OverflowError) as exc:  # bad values, unreadable or missing files
        print(f"gradzip: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        from gradzip.lab.train.launch import Terminated

        # on a terminal the line starts fresh: a progress bar (drawn with no newline) may hold it
        start = "\n" if sys.stderr.isatty() else ""
        if isinstance(exc, Terminated):
            print(f"{start}gradzip: terminated (SIGTERM); the workers were stopped", file=sys.stderr)
            return 128 + signal.SIGTERM
        print(f"{start}gradzip: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
