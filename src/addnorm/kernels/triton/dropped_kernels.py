"""Parallel blocks' ``x1``: ``addend + dropout(src)`` on tiles, one launch (and its gradient,
``dropout(ds)``): :func:`addnorm.reference.stream` of a dropout-only branch, bit for bit, the
keep mask from the same hash as the norms' (``common._gate``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import reference
from . import config
from .common import _device, _dropout_args, _gate, _load_tile, _round, _rows, launch

_BLOCK_M, _BLOCK_N, _WARPS = 4, 512, 4  # an elementwise tile: 2048 elements, 16 per thread


@triton.jit
def _dropped_kernel(
    SRC, ADDEND, OUT, M, N, s_src, s_add, SEED, SCALE, threshold,
    HAS_ADDEND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    CD: tl.constexpr = SCALE.dtype.element_ty  # the statistics dtype
    col_tiles = tl.cdiv(N, BLOCK_N)  # a 1-D grid: the second axis would stop at 65535 tiles
    pid = tl.program_id(0)
    rows = (pid // col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)
    t = _load_tile(SRC, r64, cols, s_src, mask).to(CD) * _gate(rows, cols, SEED, SCALE, threshold, CD)
    if HAS_ADDEND:
        t = _load_tile(ADDEND, r64, cols, s_add, mask).to(CD) + t
    tl.store(OUT + r64[:, None] * N + cols[None, :], _round(t, OUT.dtype.element_ty), mask=mask)


def dropped(src: Tensor, addend: Tensor | None, n: int, p: float, seed: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``addend + dropout(src)`` over rows of ``n`` features, summed in the statistics dtype of
    ``src``'s and rounded once to ``out_dtype``; without ``addend``, ``dropout(src)``. As
    :func:`addnorm.kernels.cpu.dropped`: ``addend``, when given, has ``src``'s dtype and shape;
    ``0 < p``."""
    shape = src.shape
    src = _rows(src.reshape(-1, n) if n else src)
    out = torch.empty(shape, dtype=out_dtype, device=src.device)
    m = src.numel() // n if n else 0
    if m == 0:
        return out
    addend = None if addend is None else _rows(addend.reshape(-1, n))
    cd = reference.stats_dtype(src.dtype)
    with _device(src):
        launch(
            _dropped_kernel,
            (config.cdiv(m, _BLOCK_M) * config.cdiv(n, _BLOCK_N),),
            (
                src,
                addend,
                out,
                m,
                n,
                src.stride(0),
                0 if addend is None else addend.stride(0),
                *_dropout_args(p, seed, cd, src.device),
            ),
            num_warps=_WARPS,
            HAS_ADDEND=addend is not None,
            BLOCK_M=_BLOCK_M,
            BLOCK_N=_BLOCK_N,
        )
    return out
