"""The ``addnorm`` command line.

Each subcommand lives in its own module, which defines ``register(subparsers)``: it adds
its parser and sets ``func`` (``args -> exit status``) as the parser's default.

Every failure ends in :func:`main`, which prints it as one line, ``addnorm <command>: error:
<message>``, on stderr and returns the exit status: 2 for bad usage (argparse's complaints and
:class:`UsageError`), 1 for a failure while running (:class:`CommandError`, an ``OSError``, or an
unexpected exception; ``addnorm --traceback ...`` prints Python's traceback for a bug report).
A command checks its inputs and its outputs (:func:`output_dir`, :func:`output_file`) before
it starts any work, so that bad usage never costs a finished run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

# Modules that define register(subparsers), in the order `addnorm --help` lists them.
COMMAND_MODULES = [
    "addnorm.tools.info",
    "addnorm.tools.experiment",
    "addnorm.tools.explain",
    "addnorm.tools.plot",
    "addnorm.tools.bench",
]


class CommandError(Exception):
    """A failure while running: printed as ``addnorm <command>: error: <message>``, exit status 1."""

    status = 1

    def __init__(self, message: str, *, prog: str | None = None):
        super().__init__(message)
        self.prog = prog  # who failed, when not the command being run (argparse's parsers)


class UsageError(CommandError):
    """Bad input from the user: printed as ``addnorm <command>: error: <message>``, exit status 2."""

    status = 2


class Interrupted(CommandError):
    """Stopped by Ctrl-C, after saving what had finished: exit status 130, as for SIGINT."""

    status = 130


class _Parser(argparse.ArgumentParser):
    """argparse, but bad usage is a :class:`UsageError` (one line, exit status 2), a value that
    starts like a number (``--eps -1e-5``, ``--gamma -0.5,2``) is never taken for an option, and
    an empty value (``--arms ''``) is refused rather than taken for the default."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"-\.?\d")  # as Python 3.13's argparse

    def _get_values(self, action, arg_strings):
        if action.option_strings and any(not s.strip() for s in arg_strings):
            self.error(f"argument {'/'.join(action.option_strings)}: expected a value, got an empty string")
        return super()._get_values(action, arg_strings)

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')", prog=self.prog)

    def parse_args(self, args=None, namespace=None):
        """argparse's, but arguments no parser took are reported by the subcommand given them
        (``addnorm info --bogus``: ``addnorm info: error: ...``), not by ``addnorm`` itself."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            _innermost(self, parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def _innermost(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest subcommand's parser that ``parsed`` went through (``addnorm plot hist``'s)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) in action.choices:
            return _innermost(action.choices[getattr(parsed, action.dest)], parsed)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="addnorm",
        description="LayerNorm, RMSNorm and Add & Norm for PyTorch: inspect, learn, measure.",
    )
    parser.add_argument("--version", action="version", version=f"addnorm {_version()}")
    parser.add_argument(
        "--traceback", action="store_true", help="on an unexpected failure, print Python's traceback (for bug reports)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _version() -> str:
    from .. import __version__

    return __version__


def _os_message(err: OSError) -> str:
    """``[Errno 28] No space left on device: 'x'`` -> ``'x': No space left on device``."""
    reason = err.strerror or str(err)
    return f"{str(err.filename)!r}: {reason}" if err.filename is not None else reason


def main(argv: list[str] | None = None) -> int:
    """Run ``addnorm ARGV``; returns the exit status (``--help``/``--version`` exit via argparse)."""
    parser = build_parser()
    prog, show_traceback = "addnorm", False
    try:
        args = parser.parse_args(argv)
        show_traceback = args.traceback
        if args.command is None:
            parser.print_help()
            return 2
        prog = f"addnorm {args.command}"
        with warnings.catch_warnings():  # one line each, as the errors: not Python's file and source line
            warnings.showwarning = lambda message, *_: print(f"{prog}: warning: {message}", file=sys.stderr)
            return int(args.func(args) or 0)
    except CommandError as err:
        return _fail(err.prog or prog, str(err), err.status)
    except BrokenPipeError:  # the reader went away (`addnorm explain --json | head`): stop quietly
        _silence_stdout()
        return 1
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", 130)
    except OSError as err:
        return _fail(prog, _os_message(err), 1)
    except Exception as err:  # a bug: still one line, unless --traceback asks for the details
        if show_traceback:
            traceback.print_exc()
        hint = "" if show_traceback else "; rerun with 'addnorm --traceback ...' to see where"
        first_line = next(iter(str(err).splitlines()), "")[:200]
        return _fail(prog, f"unexpected {type(err).__name__}: {first_line}{hint}", 1)


def _fail(prog: str, message: str, status: int) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises no second BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (captured in tests)
        pass


def read_numbers(path: Path, *, skiprows: int = 0):
    """The numpy array of a ``.npy`` file or of a ``.csv`` file of numbers (2-D); ValueError with a
    reason a user can act on (not numpy's advice to load pickles, never followed here)."""
    import numpy as np

    if path.suffix.lower() == ".npy":
        try:
            return np.load(path, allow_pickle=False)
        except ValueError as err:
            if "allow_pickle" in str(err):
                raise ValueError("not a .npy file of numbers (Python objects in .npy files are never loaded)") from None
            raise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("input contained no data": reported as empty by the caller)
        return np.loadtxt(path, delimiter=",", ndmin=2, skiprows=skiprows, dtype="float64")


def check_seed(seed: int, flag: str) -> None:
    """``seed`` within what ``torch.manual_seed`` takes (a 64-bit integer, signed or not)."""
    if not -(2**63) <= seed < 2**64:
        raise UsageError(f"{flag} must be an integer from -2**63 to 2**64 - 1, got {seed}")


def is_number(text: str) -> bool:
    """Whether ``text`` parses as a float (an option value that is a number, not a path)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_threads(threads: int, flag: str = "--threads") -> None:
    """A thread count between 1 and the CPUs here (far more threads crash OpenMP's start-up)."""
    cpus = os.cpu_count() or 1
    if not 1 <= threads <= cpus:
        raise UsageError(f"{flag} must be between 1 and {cpus} (the CPUs here), got {threads}")


# --------------------------------------------------------------------------- output paths
# Checked before any work: a run must not end by failing to write what it computed.


def _looks_like_file(path: Path) -> bool:
    """``fig.png``, ``notes.txt``: a suffix of letters names a file; ``runs/lr0.001`` does not."""
    return bool(re.fullmatch(r"\.[A-Za-z]{1,5}", path.suffix))


def _writable(folder: Path, flag: str) -> None:
    """Create ``folder`` if it is missing, and check that a file can be made in it."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag}: {str(folder)!r} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise UsageError(f"{flag}: cannot write into {str(folder)!r}: {err.strerror or err}") from None


def output_dir(text: str, flag: str, writes: str) -> Path:
    """The folder ``flag`` names, created and checked writable now. ``writes`` ("train writes
    results.json, ...") says why it must be a folder."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag}: {text!r} is a file; {writes} into a folder")
    if not path.exists() and _looks_like_file(path):
        raise UsageError(
            f"{flag}: {text!r} looks like a file name; {writes} into a folder: "
            f"give a name without the suffix {path.suffix!r} (or an existing folder)"
        )
    _writable(path, flag)
    return path


def output_file(text: str, flag: str, *, suffixes: tuple[str, ...] = (), default_name: str | None = None) -> Path:
    """The file ``flag`` names, its folder created and checked writable now.

    With ``default_name``, a folder (an existing one, or a name without a file suffix) gets a
    file of that name. With ``suffixes``, the file name must end in one of them.
    """
    path = Path(text)
    if default_name is not None and (path.is_dir() or not _looks_like_file(path)):
        path = path / default_name
    elif path.is_dir():
        raise UsageError(f"{flag}: {text!r} is a folder; expected a file name")
    if suffixes and path.suffix.lower() not in suffixes:
        expected = " or ".join(suffixes) + " file" + (", or a folder" if default_name else "")
        raise UsageError(f"{flag}: {text!r}: expected a {expected}")
    _writable(path.parent, flag)
    if path.exists():
        try:
            path.open("ab").close()  # opened for appending and left unchanged: is it writable?
        except OSError as err:
            raise UsageError(f"{flag}: cannot write {text!r}: {err.strerror or err}") from None
    return path


if __name__ == "__main__":
    # Under `python -m addnorm.tools.cli` this file is __main__; run the imported addnorm.tools.cli so that
    # the errors the subcommands raise are the classes main() catches.
    from addnorm.tools.cli import main as _main

    sys.exit(_main())
