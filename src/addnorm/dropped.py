"""Parallel blocks' second sublayer output: ``residual + dropout(x1)`` in the stream dtype.

``x1``'s term is added to the residual first, with a keep mask of its own from the same
counter-based hash as ``x``'s (:func:`addnorm.reference.keep_mask`), rounded once to the stream
dtype. Where the norm's backend adds ``x1`` as it reads each row (``Capabilities.adds_x1``) this
module serves the other calls: :func:`dropped_add` (an ``autograd.Function`` whose backward and
jvp recompute the mask from the seed, never saved), and :func:`keep_mask_of` for the masks a
call returns. The compiled kernels' ``dropped`` runs either direction in one pass where it can
(:func:`_dropped_kernels`).
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import Tensor

from . import backend as backends
from . import reference
from .autograd import transformed


class DroppedAdd(torch.autograd.Function):
    """``residual + dropout(x1)`` in the stream dtype ``sd`` (parallel blocks' ``x1``), with the
    hash keep mask of :func:`addnorm.reference.keep_mask` over rows of ``n`` features: the
    backward recomputes the mask from the seed instead of saving it. ``backend``: the norm's, whose
    compiled ``dropped`` runs both directions where it can (:func:`_dropped_kernels`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(residual, x1, n, p, seed, sd, backend):
        kernels = _dropped_kernels(backend, x1, residual, seed) if p > 0 and residual.dtype is sd else None
        if kernels is not None:  # one pass, compiled
            return kernels.dropped(x1.to(sd), residual, n, p, seed, sd).view(x1.shape)
        # without dropout and with residual in sd, one add in sd: the same bits as the branch's
        # sum in the statistics dtype rounded once, at the cost of torch's add alone
        branch = backends.Branch(p, seed, None, None) if p > 0 or residual.dtype != sd else None
        keep = keep_mask_of(x1, n, p, seed) if p > 0 else None
        return reference.stream(x1.reshape(-1, n), residual.reshape(-1, n), sd, branch, keep=keep).view(x1.shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        residual, x1, n, p, seed, sd, backend = inputs
        ctx.save_for_backward(seed)
        ctx.save_for_forward(seed)  # (forward-mode AD: jvp reads it back the same way)
        ctx.n, ctx.p, ctx.dtypes, ctx.backend = n, p, (residual.dtype, x1.dtype), backend

    @staticmethod
    def backward(ctx, ds):
        (seed,) = ctx.saved_tensors
        n, p, (rd, x1d) = ctx.n, ctx.p, ctx.dtypes
        # (not under create_graph: dx1 is then differentiated again, through the torch ops)
        kernels = _dropped_kernels(ctx.backend, ds, seed) if p > 0 and not torch.is_grad_enabled() else None
        if kernels is not None:  # dx1 in one pass: the kernels' hash, product and rounding
            dx1 = kernels.dropped(ds, None, n, p, seed, x1d).view(ds.shape)
        else:
            dx1 = _dropped(ds, n, p, seed).to(x1d)
        return ds.to(rd), dx1, None, None, None, None, None

    @staticmethod
    def jvp(ctx, dresidual, dx1, *_):
        (seed,) = ctx.saved_tensors
        return dresidual + _dropped(dx1, ctx.n, ctx.p, seed).to(dresidual.dtype)


# torch's Function.apply binds the call's arguments to forward's signature on every call when
# setup_context is defined; inspect builds that signature afresh each time unless it is set.
DroppedAdd.forward.__signature__ = inspect.signature(DroppedAdd.forward)


def _dropped(t: Tensor, n: int, p: float, seed: Tensor | None) -> Tensor:
    """``dropout(t)`` by the hash mask (rows of ``n`` features), in the statistics dtype."""
    if p == 0:
        return t
    cd = reference.stats_dtype(t.dtype)
    rows = torch.arange(t.numel() // n, device=t.device)
    branch, keep = backends.Branch(p, seed, None, None), keep_mask_of(t, n, p, seed)
    return reference.branch_terms(t.reshape(-1, n).to(cd), branch, rows, keep)["t"].view(t.shape)


def keep_mask_of(t: Tensor, n: int, p: float, seed: Tensor) -> Tensor:
    """:func:`addnorm.reference.keep_mask` of ``t``'s rows of ``n`` features, ``(rows, n)``: for a
    plain CPU tensor in eager mode by the cpu backend's hash (the same bits, one compiled loop
    instead of a dozen int64 torch ops over the whole tensor), else by the reference's ops; for a
    DTensor (replicated: a shard of the rows cannot draw their masks) a replicated DTensor."""
    rows = t.numel() // n if n else 0
    if _eager_cpu(t, seed):
        from .kernels import cpu  # (numba: imported on the first such call)

        return cpu.keep_mask(seed, rows, n, p)
    keep = reference.keep_mask(seed, torch.arange(rows, device=t.device), n, p)
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):  # replicated: checks.check_dtensors
        mesh = t.device_mesh
        return dtensor.DTensor.from_local(keep, mesh, [dtensor.Replicate()] * mesh.ndim, run_check=False)
    return keep


def _eager(*tensors: Tensor) -> bool:
    """Whether compiled kernels may take ``tensors``: plain tensors (no subclass, no lazy
    negation), in eager mode (not compiling, no torch.func transform, no Python dispatch mode,
    which sees torch's ops but not a kernel's)."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    if torch._C._len_torch_dispatch_stack():
        return False
    return all(type(t) is Tensor and not t.is_neg() for t in tensors)


def _eager_cpu(*tensors: Tensor) -> bool:
    """:func:`_eager`, on CPU tensors: where the cpu backend's compiled loops run."""
    return _eager(*tensors) and all(t.is_cpu for t in tensors)


def _dropped_kernels(backend: str, *tensors: Tensor):
    """The compiled kernels whose ``dropped`` runs ``x1``'s dropout (or its gradient) on
    ``tensors`` in one pass, those of the norm's ``backend`` (``"auto"`` resolved by device): the
    cpu backend's on CPU tensors, the Triton backend's on CUDA tensors. None (the reference's
    torch ops, the same bits) for any other backend, for tensor subclasses, and under
    torch.compile or a torch.func transform."""
    if not _eager(*tensors):  # (first: under torch.compile nothing below is traced)
        return None
    t = tensors[0]
    name = backends.auto_name(t) if backend == "auto" else backend
    if name == "cpu" and t.is_cpu:
        from .kernels import cpu  # (numba: imported on the first such call)

        return cpu
    if name == "triton" and t.is_cuda:
        from .kernels.triton import dropped_kernels

        return dropped_kernels
    return None


def dropped_add(
    residual: Tensor, x1: Tensor, n: int, p: float, seed: Tensor | None, sd: torch.dtype, backend: str = "auto"
) -> Tensor:
    """``residual + dropout(x1)`` in ``sd``, rows of ``n`` features: :class:`DroppedAdd`, its forward alone where
    nothing is differentiated, or under torch.compile (no custom jvp traced: autograd takes its torch ops)."""
    differentiated = torch.is_grad_enabled() and (residual.requires_grad or x1.requires_grad)
    if (differentiated or transformed()) and not torch.compiler.is_compiling():
        return DroppedAdd.apply(residual, x1, n, p, seed, sd, backend)
    return DroppedAdd.forward(residual, x1, n, p, seed, sd, backend)
