"""What the forward and backward kernels share: the Triton helpers both call (rounding, the keep
mask of the sublayer branch, the row scale, centring) and the launchers' tensor plumbing."""

from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from ... import reference

# --------------------------------------------------------------------------- Triton helpers


@triton.jit
def _round(v, DT: tl.constexpr):
    """``v`` rounded to ``DT`` to nearest even, through float32 (as torch casts a float64: so twice
    rounded). Compiled, that is the cast itself; in Triton's interpreter, whose own fp32 -> bf16
    cast truncates, bf16 is rounded by hand from the bits, to the same result."""
    if DT == tl.bfloat16 and _INTERPRETED:
        v = v.to(tl.float32)
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        # a NaN stays a NaN (quiet), even one whose payload is in the low 16 bits alone
        out = tl.where(v != v, (bits >> 16) | 0x40, rounded)
        return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif DT == tl.bfloat16 or DT == tl.float16:
        return v.to(tl.float32).to(DT)
    else:
        return v.to(DT)


# Triton's interpreter casts fp32 -> bf16 by truncation; compiled kernels round to nearest even
# (read by _round when it is compiled or interpreted, so it may follow it)
_INTERPRETED = tl.constexpr(isinstance(_round, InterpretedFunction))


@triton.jit
def _load_tile(P, rows, cols, stride, mask):
    """One tile of ``P``'s rows (``stride`` elements apart), in ``P``'s dtype, zero outside ``mask``."""
    return tl.load(P + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _fmix32(h):
    """MurmurHash3's finalizer on uint32 values (``reference.fmix32``): wraps mod 2**32."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _gate(rows, cols, SEED, SCALE, threshold, CD: tl.constexpr):
    """The dropout gate of one tile: ``keep ? scale : 0`` with ``keep`` the hash of ``(seed, row,
    column)`` at least ``threshold`` (reference.mask_hash, bit for bit)."""
    seed = tl.load(SEED)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    a = _fmix32(_fmix32(rows.to(tl.uint32) ^ k0) + k1)
    b = _fmix32(_fmix32(cols.to(tl.uint32) ^ k1) + (k0 ^ 0x9E3779B9))
    keep = _fmix32(a[:, None] + b[None, :]).to(tl.int64) >= threshold
    return tl.where(keep, tl.load(SCALE).to(CD), 0.0)


@triton.jit
def _branch(x, rows, cols, M, N, SEED, SCALE, LS, RSC, threshold, CD: tl.constexpr):
    """``(t, gate)`` of one tile: ``gate`` of :func:`_gate`, ``t = x * (gate * layer_scale) *
    rowscale``: reference.branch_terms, bit for bit. A missing factor is a tensor of ones (``* 1``
    is exact)."""
    gate = _gate(rows, cols, SEED, SCALE, threshold, CD)
    factor = gate * tl.load(LS + cols, mask=cols < N, other=1.0).to(CD)[None, :]
    t = x * factor * tl.load(RSC + rows, mask=rows < M, other=1.0).to(CD)[:, None]
    return t, gate


@triton.jit
def _row_scale(amax):
    """Per row, the power of two ``k = 2**-e <= 1`` with ``max|s * k| < 1`` (``reference.row_scale``),
    built from the exponent bits of ``amax = max|s|``: exact, and at ``amax = 2**j`` it is
    ``2**-(j + 1)``, as frexp. ``e`` stops at the smallest normal's exponent, so ``k`` is never
    subnormal (a GPU may flush those): rows beyond ``2**126`` get ``max|s * k| < 4``, which is
    as safe. Non-finite rows get ``k = 1`` and propagate as unscaled."""
    if amax.dtype == tl.float64:
        biased = (amax.to(tl.int64, bitcast=True) >> 52) & 0x7FF
        e = tl.where(biased == 0x7FF, 0, tl.minimum(tl.maximum(biased - 1022, 0), 1022))
        return ((1023 - e) << 52).to(tl.float64, bitcast=True)
    else:
        biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        e = tl.where(biased == 0xFF, 0, tl.minimum(tl.maximum(biased - 126, 0), 126))
        return ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _centre(sk, mask, mean_k, IS_RMS: tl.constexpr):
    """``d = s * k - mean_k`` from ``sk = s * k``, zero outside ``mask`` (``sk`` for RMSNorm)."""
    if IS_RMS:
        return sk
    else:
        return tl.where(mask, sk - mean_k[:, None], 0.0)


@triton.jit
def _xhat(d, corr, rstd_k, IS_RMS: tl.constexpr):
    """``xhat = (d - corr) * rstd_k`` from ``d`` of :func:`_centre`: the rough mean subtracted, then
    its correction (exact for constant rows), as ``reference.forward_rows`` (``d * rstd_k`` for
    RMSNorm). Not masked (a select less, fewer registers): outside the tile's mask it is never
    stored, and the backward's column sums take it times ``dy``, which is zero there."""
    if IS_RMS:
        return d * rstd_k[:, None]
    else:
        return (d - corr[:, None]) * rstd_k[:, None]


# --------------------------------------------------------------------------- launcher helpers

# Triton's interpreter patches triton.language's globals while a kernel runs, so two Python
# threads interpreting kernels at once break each other: interpreted launches take turns.
INTERPRETER_LOCK = threading.RLock()


def _device(t: Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it ``t``'s (multi-GPU processes).
    On CPU tensors (the interpreter) it holds the interpreter's lock instead."""
    return torch.cuda.device(t.device) if t.is_cuda else INTERPRETER_LOCK


# Whether :func:`launch` reuses a compiled kernel directly (benchmarks/triton_tune.py switches it
# off to time Triton's own launcher beside it).
FAST_LAUNCH = True
_COMPILED: dict = {}  # specialization key -> (compiled kernel, the constexprs in parameter order)


def _specs(args: tuple) -> tuple:
    """What Triton specializes a kernel on for each of ``args`` (or finer): a tensor's dtype and
    whether its address is 16-byte aligned; an int's value being 1, its divisibility by 16 and
    its width; a float's type; None and bools themselves. (One loop: a launch's key is built on
    every call, and a function call per argument cost twice as much.)"""
    out = []
    add = out.append
    for a in args:
        if a is None or a.__class__ is bool:
            add(a)
        elif isinstance(a, Tensor):
            add((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, int):
            add((a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a < 2**63))
        else:
            add(type(a))
    return tuple(out)


def launch(kernel, grid: tuple, args: tuple, num_warps: int, **constexprs) -> None:
    """``kernel[grid](*args, **constexprs, num_warps=num_warps, enable_fp_fusion=False)`` (the
    current CUDA device must be the tensors'). On a GPU, once a specialization has compiled, the
    next launch of it calls the compiled kernel directly: Triton's own launcher binds, specializes
    and hashes every argument in Python on each call, several times the cost of the launch
    itself, and a call of a few rows is bound by it (docs/performance-log.md, "On an NVIDIA H200: the
    direct launcher"). The key holds everything Triton's specialization reads (:func:`_specs`) and
    the settings its own key holds (:func:`_settings`), so a launch reuses only the kernel Triton
    itself would have picked. Hooks (a profiler's, a kernel's pre-run hooks) and Triton before
    3.4 (no ``triton.knobs``) take Triton's path."""
    x = args[0]
    key = _key(kernel, args, num_warps, constexprs) if FAST_LAUNCH and x.is_cuda else None
    hit = None if key is None else _COMPILED.get(key)
    if hit is None:  # Triton's own launcher (which compiles the specialization if it has not)
        compiled = kernel[grid](*args, **constexprs, num_warps=num_warps, enable_fp_fusion=False)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        if key is not None and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            _COMPILED[key] = compiled, tuple(constexprs[name] for name in kernel.arg_names[len(args) :])
        return
    compiled, tail = hit
    grid = (*grid, 1, 1)
    stream = _current_stream(x.device.index)
    compiled.run(
        grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail
    )


def _key(kernel, args: tuple, num_warps: int, constexprs: dict) -> tuple | None:
    """The key of a launch's compiled kernel in :data:`_COMPILED` (:func:`launch`), or None where
    Triton's own launcher must run it (:func:`_settings`)."""
    settings = _settings(kernel)
    if settings is None:
        return None
    return (kernel, args[0].device.index, num_warps, settings, *constexprs.items(), *_specs(args))


def _settings(kernel) -> tuple | None:
    """The Triton settings a compiled kernel depends on besides its arguments (debug mode,
    instrumentation, float sanitizing), or None where the direct launch would skip something:
    a launch, pre-run or compile-stage hook is set, or ``triton.knobs`` is missing."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or getattr(kernel, "pre_run_hooks", None):
        return None
    runtime, compilation = knobs.runtime, knobs.compilation
    for name in ("launch_enter_hook", "launch_exit_hook", "add_stages_inspection_hook"):
        hook = getattr(runtime, name, None)
        if getattr(hook, "calls", hook):
            return None
    return (
        runtime.debug,
        getattr(compilation, "instrumentation_mode", None),
        getattr(compilation, "fpsan_homomorphic_casts", None),
    )


def _current_stream(index: int) -> int:
    return triton.runtime.driver.active.get_current_stream(index)


def _rows(t: Tensor | None) -> Tensor | None:
    """``t`` with unit column stride (rows may keep any stride), its lazy negation, if any,
    applied, and a ZeroTensor (autograd's zeros, with no memory) made real zeros: copy only when
    needed."""
    if t is None:
        return t
    if t.is_neg():
        t = t.resolve_neg()
    if t._is_zerotensor():
        t = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


_CONSTANTS: dict = {}  # (length, dtype, device, value) -> tensor, at most _MAX_CONSTANTS of them
_MAX_CONSTANTS = 64


def _constant(n: int, dtype: torch.dtype, device: torch.device, value: float) -> Tensor:
    """``n`` values ``value`` (never written): a missing layer scale or rowscale (ones), the dropout
    scale (one value), a seed when there is no dropout (zero), eps. Kept for reuse in a tensor
    whose length is a power of two (rows of any count share one), made where no CUDA graph's
    memory pool can hold it: a CUDA graph tree routes every allocation of the thread warming it up
    into its pool and refuses to record while a tensor there outlives the call, so a kept constant
    is made on a thread of its own (on the caller's stream, in order with the launch that reads
    it); while a graph is being captured, one not kept yet is made for that launch alone (the
    graph replays its fill)."""
    size = 1 << max(n - 1, 0).bit_length()
    key = (size, dtype, device, value)
    kept = _CONSTANTS.get(key)
    if kept is None:
        if _capturing(device):
            return torch.full((n,), value, dtype=dtype, device=device)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        kept = _on_own_thread(_make_constant, size, dtype, device, value, stream)
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            _CONSTANTS.pop(next(iter(_CONSTANTS)))  # the oldest
        _CONSTANTS[key] = kept
    return kept if size == n else kept[:n]


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (asked on that device: the
    current device may be another)."""
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _make_constant(size: int, dtype: torch.dtype, device: torch.device, value: float, stream) -> Tensor:
    with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
        return torch.full((size,), value, dtype=dtype, device=device)


def _on_own_thread(fn, *args):
    """``fn(*args)`` run on a new thread; what it raises is raised here."""
    done: list = []

    def run() -> None:
        try:
            done.append(fn(*args))
        except BaseException as err:  # noqa: BLE001 - raised again on the caller's thread
            done.append(err)

    thread = threading.Thread(target=run, name="addnorm-constant")
    thread.start()
    thread.join()
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]


def _dropout_args(p: float, seed: Tensor | None, cd: torch.dtype, device: torch.device) -> tuple:
    """``(SEED, SCALE, threshold)`` of dropout with probability ``p`` for the kernels (see
    ``_gate``); at ``p = 0`` a zero seed, unused (every element kept)."""
    seed = seed if p > 0 else _constant(1, torch.int64, device, 0)
    return seed, _constant(1, cd, device, reference.dropout_scale(p)), reference.keep_threshold(p)


def _branch_args(branch, m: int, n: int, cd: torch.dtype, device: torch.device) -> tuple:
    """``(SEED, SCALE, LS, RSC, threshold)`` for the kernels (see ``_branch``): a missing factor is
    a row of ones; all None (and threshold 0) without a branch."""
    if branch is None:
        return None, None, None, None, 0
    seed, scale, threshold = _dropout_args(branch.p, branch.seed, cd, device)
    return (
        seed,
        scale,
        _rows(branch.layer_scale) if branch.layer_scale is not None else _constant(n, cd, device, 1.0),
        _rows(branch.rowscale) if branch.rowscale is not None else _constant(m, cd, device, 1.0),
        threshold,
    )
