"""``addnorm info``: versions, usable backends, threads, and a self-test of each backend."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from .. import backend as backends
from ..functional import layer_norm

# The seeds' worked example: LayerNorm over the last dim with eps 1e-5 (hand-checked values).
WORKED_INPUT = [[0.2, 0.1, 0.3], [0.5, 0.1, 0.1]]
WORKED_OUTPUT = [[0.0, -1.2238, 1.2238], [1.4140, -0.7070, -0.7070]]

_PACKAGES = ["torch", "numpy", "numba", "triton", "rich", "matplotlib", "transformers"]


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def self_test(backend: str) -> tuple[bool, list[list[float]]]:
    """Run the worked example through ``backend``; True if it matches the seeds to 1e-4."""
    x = torch.tensor(WORKED_INPUT)
    y = layer_norm(x, 3, backend=backend)
    ok = torch.allclose(y, torch.tensor(WORKED_OUTPUT), atol=1e-4, rtol=0)
    return ok, [[round(v, 4) + 0.0 for v in row] for row in y.tolist()]  # + 0.0: no "-0.0"


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="addnorm", show_header=False)
    from .. import __version__

    table.add_row("addnorm", __version__)
    for name, version in versions().items():
        table.add_row(name, version)
    table.add_row("machine", f"{platform.machine()} {platform.system()}, torch threads {torch.get_num_threads()}")
    table.add_row("cuda", torch.cuda.get_device_name() if torch.cuda.is_available() else "not available")
    console.print(table)

    probe = torch.empty(1, 3)
    checks = Table(title=f"backends (auto on CPU: {backends.auto_name(probe)!r}, at every size)")
    for col in ("backend", "usable", "self-test: worked example, eps 1e-5"):
        checks.add_column(col)
    failed = False
    for name in backends.REGISTRY:
        reason = backends.unavailable_reason(name, probe)
        if reason is not None:
            checks.add_row(name, f"no: {reason}", "-")
            continue
        ok, values = self_test(name)
        failed |= not ok
        checks.add_row(name, "yes", f"{'ok' if ok else 'FAILED'} {values}")
    console.print(checks)
    return 1 if failed else 0


def register(sub) -> None:
    p = sub.add_parser(
        "info",
        help="versions, usable backends, and a self-test of each backend",
        description="Print versions, which backends can run here (and why not), "
        "thread count, and run the seeds' worked example through each backend.",
    )
    p.set_defaults(func=run)
