"""The shortest route: a plain call, handed straight to the backend's kernel or to the training
Function.

A decode step normalizes one row per call, and there the Python around the kernel costs more than
the kernel: :func:`addnorm.ops.add_norm` checks every argument and option and picks a route, and
the backend's ``forward`` sorts through options the call does not use (docs/benchmarks.md,
"Per-call cost at small sizes"). A call with none of them is recognized here in one expression.
Without gradients it is handed to the ``plain_forward`` of the backend ``"auto"`` runs on its
device, where the backend has one (:mod:`addnorm.backend`): the cpu backend's takes calls small
enough for one thread, the triton backend's (on CUDA tensors) launches the forward kernel writing
neither statistics nor an unreturned stream, with less Python around the launch, which bounds a
small call on a GPU. A call that takes a gradient goes to :class:`~addnorm.autograd.PlainAddNorm`,
which saves and differentiates as the general route's :class:`~addnorm.autograd.EagerAddNorm`.

A plain call: ``backend="auto"``; plain tensors (:data:`addnorm.checks.PLAIN`) on the CPU or all
on one CUDA device, all of one supported dtype, strided; ``x`` ending with ``normalized_shape``,
one dim of more than two features; ``residual`` of ``x``'s shape (or None, not pre-norm);
``weight`` and ``bias`` of ``(N,)`` or None; ``eps`` a float the checks accept; ``prenorm`` a
bool; no sublayer branch, parallel block, ``residual_dtype`` or buffer (the caller's part); eager
mode (no ``torch.compile``, export, trace, ``torch.func`` transform, forward-mode AD, Python
dispatch mode or ``__torch_function__`` mode, which would see the general route's torch calls; a
default device's mode, ``torch.set_default_device``, may be on). Such a call is one
:func:`addnorm.ops.add_norm` would check, then route to the backend's ``forward`` with nothing
saved (or, taking a gradient, to EagerAddNorm) and return as it is: the same kernel, the same
bits (a training call's backward node is then ``PlainAddNormBackward``, not
``EagerAddNormBackward``). Anything else, and every call the backend declines, takes that general route, which checks
and reports what it must.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._device import DeviceContext as _DeviceContext

from . import backend as backends
from .autograd import op_args, plain_apply, transformed
from .checks import PLAIN, SUPPORTED_DTYPES

_DTYPES = frozenset(SUPPORTED_DTYPES)
_SHAPES = (tuple, list, torch.Size)
_STRIDED = torch.strided
_FLOAT32_MAX = torch.finfo(torch.float32).max  # (the largest eps the checks accept)
_is_compiling, _is_exporting = torch.compiler.is_compiling, torch.compiler.is_exporting
_tracing_state = torch._C._get_tracing_state
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_function_mode_count, _function_mode_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
_grad_enabled = torch.is_grad_enabled


def eager_mode() -> bool:
    """Whether torch runs ops as they are called: not compiling, exporting or tracing, no
    ``torch.func`` transform or forward-mode AD, no Python dispatch mode (make_fx, FakeTensorMode,
    selective checkpointing: they see torch's ops, never a kernel's)."""
    if _is_compiling() or _is_exporting() or _tracing_state() is not None or transformed():
        return False
    return not _dispatch_modes()  # (asked only in eager mode: while compiling it breaks the graph)


def _device_modes_only() -> bool:
    """Whether every ``__torch_function__`` mode on is a default device's (``torch.set_default_device``,
    ``with torch.device(...)``): one gives a device to the factory calls that name none, and every
    call on this route names one, so it would see the general route's calls to no effect."""
    return all(type(_function_mode_at(i)) is _DeviceContext for i in range(_function_mode_count()))


def _plain(t: Tensor, dtype: torch.dtype, device: torch.device | None) -> bool:
    """``t`` a plain strided tensor of ``dtype`` on ``device`` (None: the CPU)."""
    return (
        type(t) in PLAIN
        and t.dtype is dtype
        and (t.is_cpu if device is None else t.device == device)
        and t.layout is _STRIDED
    )


def forward(
    x: object, residual: object, normalized_shape: object, weight: object, bias: object, eps: object, rms: bool,
    prenorm: object,
) -> Tensor | tuple[Tensor, Tensor] | None:  # fmt: skip
    """``y`` (``(y, s)`` with ``prenorm``) of a plain call (module docstring), or None: the call
    takes the general route."""
    if not eager_mode() or (_function_modes() and not _device_modes_only()):  # (first: nothing below is traced)
        return None  # (a __torch_function__ mode sees the general route's torch calls: it takes that)
    n = normalized_shape
    if type(n) is not int:
        if type(n) not in _SHAPES or len(n) != 1 or type(n[0]) is not int:
            return None
        n = n[0]
    if type(x) not in PLAIN or type(eps) is not float or type(prenorm) is not bool:
        return None
    dtype, cpu = x.dtype, x.is_cpu
    device = None if cpu else x.device  # (x.device costs more than the rest of a CPU call)
    if not (
        2 < n
        and dtype in _DTYPES
        and (cpu or x.is_cuda)
        and x.layout is _STRIDED
        and not x.is_nested
        and x.dim() > 0
        and x.shape[-1] == n
        and 0.0 <= eps <= _FLOAT32_MAX
        and (residual is None and not prenorm or _plain(residual, dtype, device) and residual.shape == x.shape)
        and (weight is None or _plain(weight, dtype, device) and weight.dim() == 1 and weight.shape[0] == n)
        and (bias is None or _plain(bias, dtype, device) and bias.dim() == 1 and bias.shape[0] == n)
    ):
        return None
    if _grad_enabled() and (
        x.requires_grad
        or (residual is not None and residual.requires_grad)
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    ):
        return _training(x, residual, weight, bias, eps, rms, prenorm)
    run = backends.auto_plain_forward("cpu" if cpu else "cuda")
    if run is None:
        return None
    result = run(x, residual, weight, bias, eps, rms, prenorm)
    if result is None:
        return None
    return result if prenorm else result[0]


def _training(x: Tensor, residual: Tensor | None, weight, bias, eps: float, rms: bool, prenorm: bool):
    """A plain call that takes a gradient: :class:`~addnorm.autograd.PlainAddNorm`, which saves and
    differentiates as the general route's :class:`~addnorm.autograd.EagerAddNorm` would."""
    a = op_args((x, residual, weight, bias, eps, rms, None, "auto", prenorm, 0.0, None, None, None))
    impl = backends.resolve("auto", x)
    if residual is None:
        y = plain_apply(a, impl, x, weight, bias)
    else:
        y = plain_apply(a, impl, x, weight, bias, residual)
    if prenorm:
        return y
    return y[0] if type(y) is tuple else y
