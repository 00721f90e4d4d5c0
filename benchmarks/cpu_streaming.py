"""Non-temporal stores in the CPU kernels: each call with its output streamed and with plain stores.

    python benchmarks/cpu_streaming.py [ROWSxCOLS ...] [--dtype float32] [--rounds 21]
        (default: 4096x768 4096x1024 2048x4096)

add+LayerNorm, add+RMSNorm and add+LayerNorm with dropout (p=0.1): the post-norm forward
(writing ``y``), the pre-norm forward (``y`` and ``s``) and the post-norm backward (writing
``ds``, the stream recomputed from ``x`` and ``residual``; with dropout ``dx`` too),
``addnorm.kernels.cpu`` called directly, the same call with ``streaming_min_bytes`` at 0 (every
output streamed where it fits: ``kernels/cpu/launch.streamed``) and out of reach (plain stores).
Timed interleaved by addnorm's harness (``addnorm.tools.bench.measure``) on torch's thread
count: median ms per call, and how much faster the streamed call is. Run with
``GLIBC_TUNABLES=glibc.malloc.mmap_max=0`` so that fresh outputs do not page-fault
(docs/benchmarks.md, "Fresh outputs page-fault").
"""

from __future__ import annotations

import argparse

import torch

from addnorm.backend import Branch
from addnorm.kernels import cpu
from addnorm.tools.bench import measure, parse_shapes
from addnorm.tools.cli import UsageError

STORES = {"streamed": 0, "plain": 1 << 62}  # streaming_min_bytes
OPS = {"add_layer_norm": (False, 0.0), "add_rms_norm": (True, 0.0), "add_layer_norm_dropout": (False, 0.1)}


def with_stores(stores: str, fn):
    def run():
        with cpu.config.using(streaming_min_bytes=STORES[stores]):
            fn()

    return run


def calls(m: int, n: int, dtype: torch.dtype, rms: bool, dropout_p: float = 0.0) -> dict:
    g = torch.Generator().manual_seed(0)
    branch = Branch(dropout_p, torch.tensor(1234), None, None) if dropout_p else None
    x, r, dy = (torch.randn(m, n, generator=g).to(dtype) for _ in range(3))
    w, b = torch.randn(n, generator=g).to(dtype), None if rms else torch.randn(n, generator=g).to(dtype)
    kw = {"eps": 1e-5, "rms": rms, "residual_dtype": None, "branch": branch}
    _, _, mean, rstd = cpu.forward(x, r, w, b, **kw, write_stream=False)
    fwd = lambda: cpu.forward(x, r, w, b, **kw, write_stream=False)  # noqa: E731
    pre = lambda: cpu.forward(x, r, w, b, **kw, write_stream=True)  # noqa: E731
    bwd = lambda: cpu.backward(  # noqa: E731
        dy, None, (x, r), w, mean, rstd, rms=rms, has_bias=not rms, branch=branch, param_dtype=dtype
    )
    return {
        (direction, stores): with_stores(stores, fn)
        for direction, fn in (("fwd", fwd), ("fwd pre-norm", pre), ("bwd", bwd))
        for stores in STORES
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", metavar="ROWSxCOLS", help="default: 4096x768 4096x1024 2048x4096")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="default float32")
    p.add_argument("--rounds", type=int, default=21, help="interleaved samples per call (default 21)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    try:
        shapes = parse_shapes(",".join(args.shapes or ["4096x768", "4096x1024", "2048x4096"]))
    except UsageError as err:
        p.error(str(err).replace("--shapes: ", ""))
    print(f"{args.dtype}, {torch.get_num_threads()} threads; median ms per call, streamed vs plain stores")
    for m, n in shapes:
        for op, (rms, dropout_p) in OPS.items():
            t = measure(calls(m, n, dtype, rms, dropout_p), args.rounds, "cpu")
            cells = []
            for direction in ("fwd", "fwd pre-norm", "bwd"):
                streamed, plain = t[(direction, "streamed")][0], t[(direction, "plain")][0]
                cells.append(f"{direction} {streamed * 1e3:7.3f} vs {plain * 1e3:7.3f} ({plain / streamed:.2f}x)")
            print(f"{op:<23s}{m:>5d}x{n:<5d} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
