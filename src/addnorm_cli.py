"""The ``addnorm`` command's entry point, outside the package: importing ``addnorm`` (torch,
numba) takes seconds, and a Ctrl-C in those seconds ends the command as it does later, with one
line and status 130 (:func:`addnorm.tools.cli.main`), not a traceback."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from addnorm.tools.cli import main as run
    except KeyboardInterrupt:
        print("addnorm: error: interrupted", file=sys.stderr)
        return 130
    return run()
