"""Time the Triton kernels' launch heuristics on a CUDA device: which settings of the launch
table (``addnorm.kernels.triton.config.TABLE``: each kind's ``bytes_per_thread``, the
backward's ``warps_in_flight``, the chunked path's ``chunk_n`` and ``bytes_per_thread``, the fused
limits ``max_fused_n``) are fastest, and what a call costs besides its kernels.

    python benchmarks/triton_tune.py                    # the sweep below, bf16 and fp32
    python benchmarks/triton_tune.py --shapes 32768x4096 --dtype bfloat16

Kernel times are device times with the host's share left out (``addnorm.tools.bench.
kernel_seconds``: a CUDA graph of the call replayed between CUDA events, as the GPU checklist's
kernel table; wall time would time the launches, not the kernels, on a slow host) of
``kernels.triton.forward`` (add + LayerNorm with weight and bias, the forward of training) and
``backward``, as a fraction of a copy timed the same way (``kernel_copy_bandwidth``), of the
bytes they move (``bytes_moved``). Overhead is the wall time per call of tiny rows (8x768), kernels and host
included (``addnorm.tools.bench.measure``), for addnorm and torch.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

import addnorm
from addnorm.backend import Branch
from addnorm.kernels import triton as K
from addnorm.kernels.triton import backward_kernels, common, config
from addnorm.tools.bench import bytes_moved, kernel_copy_bandwidth, kernel_seconds, measure, parse_shapes
from addnorm.tools.cli import UsageError

SHAPES = ["65536x768", "16384x1024", "32768x4096", "8192x8192", "4096x16384", "4096x65536"]


ROUNDS = 15


def _ms(fn) -> float:
    return kernel_seconds(fn, "cuda") * 1e3


@triton.jit
def _noop(X):
    pass


def _triton_launcher(fn):
    """``fn`` launching through Triton's own launcher (``common.launch`` without its cache)."""

    def run():
        fast, common.FAST_LAUNCH = common.FAST_LAUNCH, False
        try:
            return fn()
        finally:
            common.FAST_LAUNCH = fast

    return run


class _Empty(torch.autograd.Function):
    """The floor of a Python autograd op on these tensors: a view forward, ``dy`` passed back."""

    @staticmethod
    def forward(x, w, b):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None


def overhead(profile: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(8, 768, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    w, b = torch.ones(768, device="cuda", dtype=x.dtype), torch.zeros(768, device="cuda", dtype=x.dtype)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    rstd = K.forward(x, r, w, b, eps=1e-5, rms=True, residual_dtype=None)[3]
    partials = torch.randn(2, 132, 768, device="cuda")  # dweight and dbias
    cases = {
        "kernels.triton.forward": lambda: K.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None),
        "kernels.triton.backward": lambda: K.backward(x, None, (r,), w, None, rstd, rms=True, has_bias=True),
        "kernels.triton._sum_partials": lambda: backward_kernels._sum_partials(partials, [partials.dtype] * 2),
        "addnorm.add_layer_norm fwd": lambda: addnorm.add_layer_norm(x, r, 768, w, b, backend="triton"),
        "torch add + layer_norm fwd": lambda: F.layer_norm(x + r, (768,), w, b),
        "addnorm.add_layer_norm fwd+bwd": lambda: (
            addnorm.add_layer_norm(xg, r, 768, wg, bg, backend="triton").sum().backward()
        ),
        "torch add + layer_norm fwd+bwd": lambda: F.layer_norm(xg + r, (768,), wg, bg).sum().backward(),
    }
    for name in [k for k in cases if k.startswith(("kernels", "addnorm"))]:
        cases[name + " (Triton's launcher)"] = _triton_launcher(cases[name])
    cases["a Triton kernel of one argument"] = lambda: _noop[(1,)](x)  # the launch floor
    cases["an empty autograd.Function fwd+bwd"] = lambda: _Empty.apply(xg, wg, bg).sum().backward()
    cases["torch.empty"] = lambda: torch.empty((8, 768), device="cuda", dtype=x.dtype)
    for name, (median, _, _) in measure(cases, ROUNDS, "cuda").items():
        print(f"overhead 8x768 bf16  {name:32s} {median * 1e6:7.1f} us/call", flush=True)
    if profile:
        import cProfile
        import pstats

        fn = cases["addnorm.add_layer_norm fwd+bwd"]
        with cProfile.Profile() as prof:  # enough calls that each function's share shows
            for _ in range(300):
                fn()
            torch.cuda.synchronize()
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof).sort_stats(key).print_stats(40)


def _prefetch(pf: bool | None) -> dict:
    """The table fields that set a backward's ``prefetch`` to ``pf``; none for None (the table's)."""
    return {} if pf is None else {"prefetch": pf}


def branch_sweep(label: str, x, r, s, dy, w, b, mean, rstd, bwd_bytes: int, copy_gbps: float, prefetch=(None,)) -> None:
    """The branch_backward launch at 16, 32 and 64 bytes per thread (with and without its
    ``prefetch`` where both are given): a parallel block's backward (a second norm's ``dy1`` and
    ``weight1`` besides) and the backward with dropout."""
    m, n = x.shape
    seed = torch.tensor(1, dtype=torch.int64, device=x.device)
    cases = {
        "parallel block": (
            lambda: K.backward(dy, None, (s,), w, mean, rstd, rms=False, has_bias=True, second=(x, b, True)),
            bwd_bytes + m * n * x.element_size(),  # and dy1
        ),
        "dropout 0.1": (
            lambda: K.backward(
                dy, None, (x, r), w, mean, rstd, rms=False, has_bias=True, branch=Branch(0.1, seed, None, None)
            ),
            bwd_bytes + 2 * m * n * x.element_size(),  # x and residual read, dx written besides
        ),
    }
    base = config.TABLE
    try:
        for name, pf in ((name, pf) for name in cases for pf in prefetch):
            fn, moved = cases[name]
            line = f"{label} bwd {name:14s}" + (f" prefetch={int(pf)}" if len(prefetch) > 1 else "")
            for bb in (16, 32, 64):
                config.TABLE = base.updated("branch_backward", bytes_per_thread=bb, **_prefetch(pf))
                warps = config.plan("branch_backward", n, x.device, x.element_size()).num_warps
                t = _ms(fn)
                line += f" | {bb}B/{warps:2d}w {t * 1e3:7.1f} us {moved / t / 1e6 / copy_gbps:4.2f}"
            print(line, flush=True)
    finally:
        config.TABLE = base


def sweep(
    shape: str,
    dtype: torch.dtype,
    copy_gbps: float,
    branch_only=False,
    tiles=(None,),
    per_sm=(32, 64, 128),
    fwd=True,
    prefetch=(None,),
) -> None:
    m, n = map(int, shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g).to(dtype)
    x, r, dy, w, b = mk(m, n), mk(m, n), mk(m, n), mk(n), mk(n)
    size = x.element_size()
    # kernels.triton.forward is the forward of training (it writes s and the statistics, which
    # the backward reads): fwd+bwd less bwd
    bwd_bytes = bytes_moved("add_layer_norm", m, n, dtype, "bwd")
    fwd_bytes = bytes_moved("add_layer_norm", m, n, dtype, "fwd+bwd") - bwd_bytes
    base = config.TABLE
    head = f"{shape:>11s} {str(dtype)[6:]:8s}"
    if branch_only:
        y, s, mean, rstd = K.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None)
        branch_sweep(head, x, r, s, dy, w, b, mean, rstd, bwd_bytes, copy_gbps, prefetch)
        return
    try:
        wide = n > base.backward.max_fused_n
        for chunk, tile in ((c, t) for c in ([2048, 4096, 8192] if wide else [base.chunked.chunk_n]) for t in tiles):
            chunk_table = base.updated("chunked", chunk_n=chunk)
            label = f"{head} CHUNK_N={chunk:<5d}" if wide else head
            if tile is not None:  # elements per tile of stacked short rows, every fused kind
                for kind in config.KINDS:
                    chunk_table = chunk_table.updated(kind, tile_elems=tile)
                label += f" tile={tile:<5d}"
            line = label + " fwd"
            for fb in (16, 32, 64, 128) if fwd else ():  # whichever path applies: fused or chunked
                table = chunk_table.updated("forward", bytes_per_thread=fb).updated("chunked", bytes_per_thread=fb)
                config.TABLE = table
                warps = config.plan("forward", n, x.device, size).num_warps
                f = _ms(lambda: K.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None))
                line += f" | {fb}B/{warps}w {f * 1e3:7.1f} us {fwd_bytes / f / 1e6 / copy_gbps:4.2f}"
            if fwd:
                print(line, flush=True)
            config.TABLE = chunk_table
            y, s, mean, rstd = K.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None)
            for bb, pf in ((bb, pf) for bb in (16, 32, 64) for pf in prefetch):
                bytes_table = chunk_table.updated("backward", bytes_per_thread=bb, **_prefetch(pf))
                bytes_table = bytes_table.updated("chunked", bytes_per_thread=bb, **_prefetch(pf))
                config.TABLE = bytes_table
                warps = config.plan("backward", n, x.device, size).num_warps
                line = f"{label} bwd {bb:3d}B/{warps:2d}w" + (f" prefetch={int(pf)}" if len(prefetch) > 1 else "")
                for sm in per_sm:  # warps in flight per SM of an H100 (132 SMs)
                    per_sm_table = bytes_table.updated("backward", warps_in_flight=132 * sm)
                    config.TABLE = per_sm_table.updated("chunked", warps_in_flight=132 * sm)
                    t = _ms(
                        lambda s=s, mean=mean, rstd=rstd: K.backward(
                            dy, None, (s,), w, mean, rstd, rms=False, has_bias=True
                        )
                    )
                    line += f" | {sm:3d} warps/SM {t * 1e3:7.1f} us {bwd_bytes / t / 1e6 / copy_gbps:4.2f}"
                print(line, flush=True)
            if fwd and n <= base.branch_backward.max_fused_n:
                config.TABLE = chunk_table
                branch_sweep(label, x, r, s, dy, w, b, mean, rstd, bwd_bytes, copy_gbps, prefetch)
    finally:
        config.TABLE = base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--dtype", default="bfloat16,float32")
    p.add_argument("--max-fused-n", type=int, default=None, help="set the forward's and backward's max_fused_n first")
    p.add_argument("--no-overhead", action="store_true")
    p.add_argument("--profile", action="store_true", help="cProfile the 8x768 fwd+bwd call")
    p.add_argument(
        "--branch-only", action="store_true", help="sweep only the branch backward (parallel block, dropout)"
    )
    p.add_argument("--per-sm", default="32,64,128", help="the backward's warps in flight per SM to sweep")
    p.add_argument("--backward-only", action="store_true", help="sweep the plain backward alone")
    p.add_argument("--tiles", default=None, help="sweep tile_elems too, e.g. 1024,2048,4096 (stacked short rows)")
    p.add_argument(
        "--prefetch", action="store_true", help="time every backward with and without its prefetch of the next tile"
    )
    args = p.parse_args()
    try:
        parse_shapes(args.shapes)
    except UsageError as e:
        p.error(str(e))
    if not all(isinstance(getattr(torch, d, None), torch.dtype) for d in args.dtype.split(",")):
        p.error(f"--dtype: expected dtypes such as bfloat16,float32, got {args.dtype!r}")
    try:
        tiles = [int(t) for t in args.tiles.split(",")] if args.tiles else [None]
        per_sm = [int(t) for t in args.per_sm.split(",")]
    except ValueError:
        tiles = per_sm = [0]
    if not all(t is None or (t > 0 and t & (t - 1) == 0) for t in tiles) or min(per_sm) < 1:
        p.error(
            "--tiles takes powers of two such as 1024,4096 and --per-sm positive integers; "
            f"got {args.tiles!r} and {args.per_sm!r}"
        )
    if args.branch_only and (args.tiles or args.backward_only or args.per_sm != p.get_default("per_sm")):
        p.error(
            "--branch-only sweeps the branch backward's bytes per thread alone: no --tiles, --per-sm or --backward-only"
        )
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (python benchmarks/triton_registers.py compiles the kernels without one)")
    if args.max_fused_n:
        table = config.TABLE.updated("forward", max_fused_n=args.max_fused_n)
        config.TABLE = table.updated("backward", max_fused_n=args.max_fused_n)
    copy_gbps = kernel_copy_bandwidth("cuda", mib=256)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        f"copy {copy_gbps:.0f} GB/s (256 MiB, bytes read + written, host excluded); the plain "
        "backward's bytes per thread count its statistics dtype (fp32 for bf16: its stats_bytes)",
        flush=True,
    )
    if not args.no_overhead:
        overhead(args.profile)
    for shape in args.shapes.split(","):
        for dtype in args.dtype.split(","):
            sweep(
                shape, getattr(torch, dtype), copy_gbps, args.branch_only, tiles, per_sm, not args.backward_only,
                (False, True) if args.prefetch else (None,),
            )  # fmt: skip


if __name__ == "__main__":
    main()
