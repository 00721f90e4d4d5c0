"""The ``addnorm`` command line.

Each subcommand lives in its own module, which defines ``register(subparsers)``: it adds
its parser and sets ``func`` (``args -> exit status``) as the parser's default.
A :class:`UsageError` raised by a command is printed as one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that define register(subparsers), in the order `addnorm --help` lists them.
COMMAND_MODULES = [
    "addnorm.info",
    "addnorm.experiment",
    "addnorm.explain",
    "addnorm.plot",
    "addnorm.bench",
]


class UsageError(Exception):
    """Bad input from the user: printed as ``addnorm: error: <message>``, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but bad usage is one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="addnorm",
        description="LayerNorm, RMSNorm and Add & Norm for PyTorch: inspect, learn, measure.",
    )
    parser.add_argument("--version", action="version", version=f"addnorm {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        print(f"addnorm {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Under `python -m addnorm.cli` this file is __main__; run the imported addnorm.cli so that
    # the UsageError the subcommands raise is the class main() catches.
    from addnorm.cli import main as _main

    sys.exit(_main())
