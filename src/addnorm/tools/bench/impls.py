"""The implementations ``addnorm bench`` compares: torch eager, ``torch.compile``, addnorm's
backends, and Liger, Apex and flash-attn when installed. Each is ``f(x, residual, weight, bias)
-> y`` for one op; :func:`runner` makes one pass of it a no-argument callable for the harness."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ... import backend as backends
from ... import reference

DROPOUT_P = 0.1  # "*_dropout" ops: the original Transformer's P_drop
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
OTHER_IMPLS = ["liger", "apex", "flash-attn"]
EPS = 1e-5


def all_impls() -> list[str]:
    return ["torch-eager", "torch-compile", "addnorm", *(f"addnorm-{b}" for b in backends.REGISTRY), *OTHER_IMPLS]


def _torch_norm(op: str) -> Callable:
    """What one writes with torch: dropout, then the add, then the norm."""
    rms = "rms" in op
    p = DROPOUT_P if op.endswith("_dropout") else 0.0

    def f(x, r, w, b):
        s = (F.dropout(x, p) if p else x) + r if r is not None else x
        return F.rms_norm(s, (s.shape[-1],), w, None) if rms else F.layer_norm(s, (s.shape[-1],), w, b, EPS)

    return f


def _addnorm_norm(op: str, backend: str) -> Callable:
    from ... import functional

    if op.endswith("_dropout"):
        fn = getattr(functional, op.removesuffix("_dropout"))
        if "rms" in op:
            return lambda x, r, w, b, **out: fn(x, r, x.shape[-1], w, dropout_p=DROPOUT_P, backend=backend, **out)
        return lambda x, r, w, b, **out: fn(x, r, x.shape[-1], w, b, dropout_p=DROPOUT_P, backend=backend, **out)
    fn = getattr(functional, op)
    # one plain call per op, as lean as _torch_norm's: at small sizes the per-call cost is the
    # time measured (docs/benchmarks.md, "Per-call cost at small sizes")
    if op == "layer_norm":
        return lambda x, r, w, b, **out: fn(x, x.shape[-1], w, b, backend=backend, **out)
    if op == "rms_norm":
        return lambda x, r, w, b, **out: fn(x, x.shape[-1], w, backend=backend, **out)
    if op == "add_layer_norm":
        return lambda x, r, w, b, **out: fn(x, r, x.shape[-1], w, b, backend=backend, **out)
    return lambda x, r, w, b, **out: fn(x, r, x.shape[-1], w, backend=backend, **out)


def _reference_norm(op: str) -> Callable:
    rms = "rms" in op

    def f(x, r, w, b):
        eps = torch.finfo(reference.stats_dtype(x.dtype)).eps if rms else EPS  # torch's defaults
        # the formulas on all rows at once: reference.forward's row-block loop (a memory bound for
        # eager) would unroll into one graph per block under torch.compile
        return reference.forward_steps(x, r, w, None if rms else b, eps, rms, None)["y"].to(x.dtype)

    return f


def _other_norm(name: str, op: str, device: str) -> Callable:
    """Liger / Apex / flash-attn norms; ImportError when not installed, RuntimeError when unusable."""
    rms = "rms" in op
    p = DROPOUT_P if op.endswith("_dropout") else 0.0
    if p and name != "flash-attn":
        raise RuntimeError("no fused dropout")
    if name == "liger":
        from liger_kernel.transformers.functional import liger_layer_norm, liger_rms_norm

        def norm(s, w, b):
            return liger_rms_norm(s, w, 1e-6) if rms else liger_layer_norm(s, w, b, EPS)
    elif name == "apex":
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine

        def norm(s, w, b):
            shape = (s.shape[-1],)
            return fused_rms_norm_affine(s, w, shape, EPS) if rms else fused_layer_norm_affine(s, w, b, shape, EPS)
    else:
        from flash_attn.ops.triton.layer_norm import layer_norm_fn

        def f(x, r, w, b):
            return layer_norm_fn(x, w, None if rms else b, residual=r, eps=EPS, dropout_p=p, is_rms_norm=rms)

        norm = None
    if device != "cuda":
        raise RuntimeError("needs a CUDA device")
    if norm is None:
        return f
    return lambda x, r, w, b: norm(x + r if r is not None else x, w, b)


def make_impl(name: str, op: str, device: str) -> Callable:
    """``f(x, residual, weight, bias) -> y`` for implementation ``name``; raises if unusable."""
    if name == "torch-eager":
        return _torch_norm(op)
    if name == "torch-compile":
        # a fresh compile per configuration: past dynamo's recompile limit (8) it would
        # silently run the reference eagerly
        torch._dynamo.reset()
        # with dropout: the torch code one would write, compiled (the reference has no dropout)
        return torch.compile(_torch_norm(op) if op.endswith("_dropout") else _reference_norm(op))
    if name == "addnorm":
        return _addnorm_norm(op, "auto")
    if name.startswith("addnorm-"):
        backend = name.removeprefix("addnorm-")
        probe = torch.empty(1, 4, device=device)
        reason = backends.unavailable_reason(backend, probe)
        if reason is not None:
            raise RuntimeError(reason)
        return _addnorm_norm(op, backend)
    return _other_norm(name, op, device)


def traffic(name: str, device: str, dtype: torch.dtype) -> dict[str, bool]:
    """How implementation ``name`` runs a post-norm call of ``dtype``, as
    :func:`~.measure.bytes_moved`'s keywords: ``recomputes_stream`` as its backend declares it
    for ``dtype``; ``writes_unused`` where its backend's forward writes the stream or the
    statistics it is not asked for (``write_stream``, ``write_stats``: the ``reference``
    backend; the ``cpu`` and ``triton`` kernels write only what the call returns or saves), as
    one small call shows; for ``torch.compile``, whose graph writes only what it returns or
    saves, not; and for everything else, which adds then normalizes as torch does (``s`` and the
    statistics written; an unfused add's second read of ``s`` is not counted)."""
    if name == "torch-compile":
        return {"recomputes_stream": False, "writes_unused": False}
    if not name.startswith("addnorm"):
        return {"recomputes_stream": False, "writes_unused": True}
    backend = name.removeprefix("addnorm-") if name != "addnorm" else backends.auto_name(torch.empty(0, device=device))
    recomputes = backends.load(backend).CAPABILITIES.recomputes_stream
    return {"recomputes_stream": dtype in recomputes, "writes_unused": _writes_unused(backend, device, dtype)}


@functools.cache
def _writes_unused(backend: str, device: str, dtype: torch.dtype) -> bool:
    """Whether ``backend``'s forward writes the stream or the statistics when asked for neither:
    one call on two rows of 16 features."""
    x = torch.zeros(2, 16, dtype=dtype, device=device)
    kw = dict(eps=1e-5, rms=False, residual_dtype=None, write_stream=False, write_stats=False)
    _, s, mean, rstd = backends.load(backend).forward(x, x, None, None, **kw)
    return s is not None or mean is not None or rstd is not None


def out_variant(name: str, op: str, fn: Callable, x, r, w, b) -> Callable | None:
    """The forward of ``fn`` writing into preallocated buffers (``y``, and the stream ``s`` with a
    residual), or None if ``name`` has none."""
    y = torch.empty_like(x)
    s = torch.empty_like(x) if r is not None else None
    if name.startswith("addnorm"):
        out = {"out": y, "residual_out": s} if s is not None else {"out": y}
        return lambda x, r, w, b: fn(x, r, w, b, **out)
    if name == "torch-eager" and "rms" not in op and not op.endswith("_dropout"):
        m = x.new_empty((x.shape[0], 1))  # aten wants the statistics in x.dtype here
        rs = torch.empty_like(m)

        def f(x, r, w, b):
            src = torch.add(x, r, out=s) if r is not None else x
            return torch.ops.aten.native_layer_norm.out(src, [x.shape[-1]], w, b, EPS, out0=y, out1=m, out2=rs)

        return f
    return None


def runner(fn: Callable, pass_: str, x, r, w, b, dy) -> Callable[[], object]:
    """A no-argument callable doing one ``pass_`` of ``fn`` on the given tensors: ``fwd`` under
    ``no_grad`` (inference), ``bwd`` the backward of one forward kept (``retain_graph``),
    ``fwd+bwd`` a training forward and its backward."""
    leaves = [t for t in (x, r, w, b) if t is not None]
    if pass_ == "fwd":

        def run():
            with torch.no_grad():
                return fn(x, r, w, b)

        return run
    grads = [t.detach().requires_grad_() for t in leaves]
    it = iter(grads)
    gx, gr, gw, gb = (next(it) if t is not None else None for t in (x, r, w, b))
    if pass_ == "fwd+bwd":
        return lambda: torch.autograd.grad(fn(gx, gr, gw, gb), grads, dy)
    y = fn(gx, gr, gw, gb)
    return lambda: torch.autograd.grad(y, grads, dy, retain_graph=True)
