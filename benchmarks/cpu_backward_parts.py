"""Where the CPU add+LayerNorm backward's time goes: the kernel against its parts, rebuilt alone.

    python benchmarks/cpu_backward_parts.py [ROWSxCOLS ...] [--threads T] [--rounds 15]

fp32, post-norm (the stream recomputed as ``x + residual``, as the kernel does). Each variant is
the kernel's row loop with something left out (or one rearranged), written here in a few lines of
numba compiled as the kernels are (``addnorm.kernels.cpu.jit``); each thread
runs a contiguous share of the rows (nogil), all variants timed interleaved by addnorm's harness
(``addnorm.tools.bench.measure``) beside the kernel itself (``addnorm.kernels.cpu.backward``) and
the copy bandwidth of the same run:

- ``stream``: ``ds = dy + x + residual`` in one pass, the least the backward's memory traffic
  costs (three reads and a write per element);
- ``two passes``: a row sum, then ``ds`` from the row while it is in cache: the backward's memory
  pattern with almost no arithmetic;
- ``no dweight/dbias``: the backward's two passes (sums, then ``ds``) without the parameters'
  gradients;
- ``backward``: the kernel's two passes, ``dweight``/``dbias`` added row after row;
- ``backward, rows paired``: the second pass over two rows at a time, ``dweight``/``dbias``
  loaded and stored once per pair (the kernel's ``rows._gradient_pair``);
- ``backward, next row's sums``: one row ahead, as the forward runs: the loop of row i's second
  pass also takes row i+1's sums (from its saved mean and rstd), so that the next row's loads
  run under this row's arithmetic and stores.

Each line: median ms, the fraction of the copy bandwidth (four tensor passes), and the time over
``stream``'s. The variants compute what the kernel computes without its mean correction, dtype
handling or blocks: they bound what a change of the row loop could save, they are not the kernel.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from addnorm.kernels import cpu
from addnorm.kernels.cpu.jit import njit
from addnorm.tools.bench import Copy, measure, parse_shapes
from addnorm.tools.cli import UsageError

SUM = {"reassoc"}


@njit(nogil=True)
def stream(x, r, dy, w, mean, rstd, ds, dw, db, lo, hi):
    for i in range(lo, hi):
        xi, ri, dyi, dsi = x[i], r[i], dy[i], ds[i]
        for j in range(w.shape[0]):
            dsi[j] = dyi[j] + xi[j] + ri[j]


@njit(nogil=True, fastmath=SUM)
def two_passes(x, r, dy, w, mean, rstd, ds, dw, db, lo, hi):
    for i in range(lo, hi):
        xi, ri, dyi, dsi = x[i], r[i], dy[i], ds[i]
        total = np.float32(0)
        for j in range(w.shape[0]):
            total += dyi[j] + xi[j] + ri[j]
        for j in range(w.shape[0]):
            dsi[j] = dyi[j] + xi[j] + ri[j] + total


@njit(inline="always")
def _sum_terms(xi, ri, dyi, w, mu, rs, j):
    """Element j's terms of the row sums: ``g = dy * w`` and ``g * xhat``."""
    g = dyi[j] * w[j]
    return g, g * (((xi[j] + ri[j]) - mu) * rs)


@njit(inline="always")
def _gradient_element(xi, ri, dyi, dsi, w, dw, db, mu, rs, mg, mgx, j):
    """Element j of the second pass: ``ds``, and its terms of ``dweight``/``dbias``."""
    d = dyi[j]
    xh = ((xi[j] + ri[j]) - mu) * rs
    dw[j] += d * xh
    db[j] += d
    dsi[j] = (d * w[j] - xh * mgx - mg) * rs


@njit(fastmath=SUM)  # not inline="always": inlined, it would compile with its caller's flags
def _sums(xi, ri, dyi, w, mu, rs):
    sg = sgx = np.float32(0)
    for j in range(w.shape[0]):
        g, gx = _sum_terms(xi, ri, dyi, w, mu, rs, j)
        sg += g
        sgx += gx
    n = w.shape[0]
    return sg / n, sgx / n


@njit(nogil=True)
def no_param_grads(x, r, dy, w, mean, rstd, ds, dw, db, lo, hi):
    for i in range(lo, hi):
        xi, ri, dyi, dsi, mu, rs = x[i], r[i], dy[i], ds[i], mean[i], rstd[i]
        mg, mgx = _sums(xi, ri, dyi, w, mu, rs)
        for j in range(w.shape[0]):
            xh = ((xi[j] + ri[j]) - mu) * rs
            dsi[j] = (dyi[j] * w[j] - xh * mgx - mg) * rs


@njit(nogil=True)
def backward(x, r, dy, w, mean, rstd, ds, dw, db, lo, hi):
    for i in range(lo, hi):
        xi, ri, dyi, dsi, mu, rs = x[i], r[i], dy[i], ds[i], mean[i], rstd[i]
        mg, mgx = _sums(xi, ri, dyi, w, mu, rs)
        for j in range(w.shape[0]):
            _gradient_element(xi, ri, dyi, dsi, w, dw, db, mu, rs, mg, mgx, j)


@njit(fastmath=SUM)  # the sums reassociated, as the kernel's own: here in the whole loop
def _pass_and_next_sums(xi, ri, dyi, dsi, w, dw, db, mu, rs, mg, mgx, xk, rk, dyk, mu2, rs2):
    sg = sgx = np.float32(0)
    for j in range(w.shape[0]):
        _gradient_element(xi, ri, dyi, dsi, w, dw, db, mu, rs, mg, mgx, j)
        g, gx = _sum_terms(xk, rk, dyk, w, mu2, rs2, j)
        sg += g
        sgx += gx
    n = w.shape[0]
    return sg / n, sgx / n


@njit(nogil=True)
def ahead(x, r, dy, w, mean, rstd, ds, dw, db, lo, hi):
    if hi <= lo:
        return
    mg, mgx = _sums(x[lo], r[lo], dy[lo], w, mean[lo], rstd[lo])
    for i in range(lo, hi):
        xi, ri, dyi, dsi, mu, rs = x[i], r[i], dy[i], ds[i], mean[i], rstd[i]
        k = min(i + 1, hi - 1)  # the last row takes its own sums again, unused
        mg, mgx = _pass_and_next_sums(xi, ri, dyi, dsi, w, dw, db, mu, rs, mg, mgx, x[k], r[k], dy[k], mean[k], rstd[k])


@njit(nogil=True)
def paired(x, r, dy, w, mean, rstd, ds, dw, db, lo, hi):
    for i in range(lo, hi - 1, 2):
        xi, ri, dyi, dsi, mu, rs = x[i], r[i], dy[i], ds[i], mean[i], rstd[i]
        xk, rk, dyk, dsk, mu2, rs2 = x[i + 1], r[i + 1], dy[i + 1], ds[i + 1], mean[i + 1], rstd[i + 1]
        mg, mgx = _sums(xi, ri, dyi, w, mu, rs)
        mg2, mgx2 = _sums(xk, rk, dyk, w, mu2, rs2)
        for j in range(w.shape[0]):
            wj, d, d2 = w[j], dyi[j], dyk[j]
            xh = ((xi[j] + ri[j]) - mu) * rs
            xh2 = ((xk[j] + rk[j]) - mu2) * rs2
            dw[j] = (dw[j] + d * xh) + d2 * xh2
            db[j] = (db[j] + d) + d2
            dsi[j] = (d * wj - xh * mgx - mg) * rs
            dsk[j] = (d2 * wj - xh2 * mgx2 - mg2) * rs2


VARIANTS = {
    "stream": stream,
    "two passes": two_passes,
    "no dweight/dbias": no_param_grads,
    "backward": backward,
    "backward, rows paired": paired,
    "backward, next row's sums": ahead,
}


def calls(m: int, n: int, threads: int, pool: ThreadPoolExecutor) -> dict:
    g = torch.Generator().manual_seed(0)
    x, r, dy = (torch.randn(m, n, generator=g) for _ in range(3))
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    _, _, mean, rstd = cpu.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None, write_stream=False)
    arrays = [t.numpy() for t in (x, r, dy, w, mean, rstd)]
    ds = np.empty((m, n), np.float32)
    # each thread's dweight/dbias rows apart, as the kernel's (separate tensors): rows of one array
    # 4 KiB apart would alias one another's stores, and two threads' rows share no cache line
    partials = [(torch.zeros(n).numpy(), torch.zeros(n).numpy()) for _ in range(threads)]
    shares = [(k * m // threads, (k + 1) * m // threads) for k in range(threads)]

    def run(fn):
        def one(k):
            fn(*arrays, ds, *partials[k], *shares[k])

        return lambda: list(pool.map(one, range(threads)))

    out = {name: run(fn) for name, fn in VARIANTS.items()}
    out["addnorm cpu.backward"] = lambda: cpu.backward(dy, None, (x, r), w, mean, rstd, rms=False, has_bias=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "shapes", nargs="*", default=["4096x1024", "2048x4096"], help="ROWSxCOLS (default 4096x1024 2048x4096)"
    )
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved samples per variant (default 15)")
    args = p.parse_args()
    try:
        shapes = parse_shapes(",".join(args.shapes))
    except UsageError as e:
        p.error(str(e))
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    copy = Copy("cpu")
    print(f"fp32, {args.threads} thread(s); ms · fraction of the copy bandwidth (timed in the same rounds) · vs stream")
    with ThreadPoolExecutor(max_workers=args.threads) as pool:
        for m, n in shapes:
            runs = {**calls(m, n, args.threads, pool), Copy: copy}
            medians = {k: t[0] for k, t in measure(runs, args.rounds, "cpu").items()}
            bandwidth = copy.gbps(medians.pop(Copy))
            print(f"  {m}x{n}: copy bandwidth {bandwidth:.1f} GB/s")
            passes = 4 * m * n * 4  # dy, x, residual read; ds written
            for name, sec in medians.items():
                frac = passes / sec / 1e9 / bandwidth
                print(f"  {m}x{n}  {name:<22} {sec * 1e3:8.3f} ms · {frac:.2f} · {sec / medians['stream']:.2f}x")


if __name__ == "__main__":
    main()
