"""The backend contract, the registry, and how to write a backend.

A backend is a module (in this package or your own) that computes :mod:`addnorm.reference`'s
formulas on rows: ``x`` and every tensor of its shape hold ``N`` features in their last dim, with
any leading dims (``M`` rows in all) and any strides (a transposed activation, a gradient
expanded over the rows). It provides the three functions of :class:`Backend`
and a :class:`Capabilities` declaration; nothing else is read from it. The registry names each
backend and imports it on first use; a module that lacks a function or the declaration is
rejected with the name of what is missing.

Writing a backend, the checklist:

1. ``CAPABILITIES = Capabilities(device_types=("xpu",))``: the device types it runs on, and
   ``recomputes_stream=(torch.float32, ...)``: the stream dtypes whose post-norm backward should
   recompute ``s = x + residual`` from the saved inputs (then its forward need not write ``s``:
   :func:`addnorm.autograd.save_plan`);
   ``second_norm=True`` if ``forward``/``backward`` take ``second=``, a second norm of the same
   stream (parallel blocks; :class:`Capabilities`, checked by the conformance check);
   ``adds_x1=True`` if ``forward`` takes ``x1=`` (:class:`X1`), parallel blocks' second sublayer
   output added to the residual in the same pass.
2. ``unavailable_reason(x)``: ``None`` if it can run (on ``x``, when given), else why not (a
   missing dependency, another device); ``addnorm info`` prints it.
3. ``forward(x, residual, weight, bias, *, eps, rms, residual_dtype, write_stream, write_stats,
   out, residual_out, branch)`` returning ``(y, s, mean, rstd)`` (:meth:`Backend.forward`).
4. ``backward(dy, dstream, s_parts, weight, mean, rstd, *, rms, has_bias, branch, param_dtype)``
   returning :class:`Grads` (:meth:`Backend.backward`).
5. The numerics every backend shares: statistics in float32 (float64 for float64 input); the
   mean corrected by the mean of the centred row; rows scaled by a power of two before their
   squares can overflow (:func:`addnorm.reference.row_scale`); ``y`` in ``x``'s dtype.
6. Batch invariance: each row's results depend on that row alone, never on how many rows are
   in the call, where the row sits, or how many threads run.
7. The sublayer :class:`Branch`: dropout's keep mask is :func:`addnorm.reference.keep_mask`, bit
   for bit, recomputed in the backward (never stored).
8. Optional: ``plain_forward(x, residual, weight, bias, eps, rms, write_stream)``, the commonest
   call without ``forward``'s options (:mod:`addnorm.shortcut` hands it plain calls without
   gradients: tensors of one dtype, ``residual`` or ``bias`` may be None), returning ``(y, s)``
   (``s`` None unless ``write_stream`` with a residual) with ``forward``'s bits, or None to
   decline, as for a layout or a size its shortest path does not take; written in the module
   that defines ``forward`` (:func:`auto_plain_forward`).
9. ``register("mine", "my_package.my_backend", device_types_for_auto=("xpu",))`` makes
   ``backend="mine"`` work everywhere (and ``"auto"`` pick it on those device types);
   ``addnorm.testing.check_backend("mine")`` runs the conformance check that every backend of
   this package passes in its test suite: forward and backward against a float64 oracle on the
   rows that break naive code and on calls as addnorm makes them (leading dims, strides, eps,
   ``residual_dtype``, the recomputed stream, every result's dtype), batch invariance, the
   dropout mask bits, zero rows and bad input.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple, Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares about itself.

    ``device_types``: the tensor device types it runs on (``None``: any device).
    ``recomputes_stream``: the stream dtypes whose post-norm training is cheaper when the
    forward writes ``y`` alone and the backward recomputes ``s = x + residual`` from the saved
    inputs (see ``addnorm.autograd.save_plan``); for other dtypes the forward writes ``s`` and
    it is saved. A backend that lists any is one whose forward writes only what the call
    returns or saves (``write_stream``, ``write_stats``).
    ``second_norm``: ``forward`` and ``backward`` take ``second=``, a second norm of the same
    stream (parallel blocks, :func:`addnorm.kernels.cpu.forward` and ``backward``): ``y1`` from
    the forward's statistics, ``dweight1``/``dbias1`` from the same passes; without it, parallel
    blocks run as two calls.
    ``adds_x1``: ``forward`` takes ``x1=`` (:class:`X1`), parallel blocks' second sublayer output,
    and adds it to the residual as it reads each row (:func:`addnorm.kernels.cpu.forward`);
    without it (and in training where the backward takes the summed residual:
    :func:`addnorm.ops._adds_x1`), ``residual + dropout(x1)`` is a pass of its own before the norm.
    """

    device_types: tuple[str, ...] | None
    recomputes_stream: tuple[torch.dtype, ...] = ()
    second_norm: bool = False
    adds_x1: bool = False

    def __post_init__(self):
        _check_device_types("Capabilities.device_types", self.device_types, none_is="any device")
        dtypes = self.recomputes_stream
        if not isinstance(dtypes, tuple) or not all(isinstance(d, torch.dtype) for d in dtypes):
            raise TypeError(
                f"Capabilities.recomputes_stream takes a tuple of torch dtypes (the stream dtypes "
                f"whose post-norm backward recomputes s), e.g. (torch.float32,); got {dtypes!r}"
            )


def _check_device_types(name: str, value, none_is: str | None = None) -> None:
    """A tuple of device type names (``("cpu",)``): a bare string would be taken a letter at a time."""
    if value is None and none_is is not None:
        return
    if not isinstance(value, tuple) or not all(isinstance(d, str) and d for d in value):
        also = f", or None ({none_is})" if none_is is not None else ""
        raise TypeError(f"{name} takes a tuple of device type names, e.g. ('cpu',){also}; got {value!r}")


class Branch(NamedTuple):
    """The sublayer branch of Add & Norm, fused into the add: ``s = residual + rowscale *
    layer_scale * dropout(x)`` (:func:`addnorm.reference.branch` is the formula; the keep mask is
    :func:`addnorm.reference.keep_mask`, a function of ``(seed, row, column)``).

    ``p``: the dropout probability (0: no dropout, ``seed`` is then unused); ``seed``: an int64
    0-d tensor on ``x``'s device; ``layer_scale``: ``(N,)`` or None; ``rowscale``: ``(M,)`` (one
    factor per row of the 2-D view) or None."""

    p: float
    seed: Tensor | None
    layer_scale: Tensor | None
    rowscale: Tensor | None


class X1(NamedTuple):
    """Parallel blocks' second sublayer output, added to the residual before the branch:
    the forward's residual is then ``residual + dropout(x1, p)``, summed in the statistics dtype
    and rounded to the stream dtype (:func:`addnorm.dropped.dropped_add`'s bits; without
    dropout, torch's add of the two in the stream dtype). ``x1``: of ``x``'s shape; ``p``: its
    dropout probability, ``seed`` its keep mask's (:func:`addnorm.reference.keep_mask`; None when
    ``p`` is 0)."""

    x1: Tensor
    p: float
    seed: Tensor | None


class Grads(NamedTuple):
    """What a backend's ``backward`` returns. ``ds``: the gradient of ``s`` (so of ``residual``),
    in the stream dtype; ``dweight``/``dbias``: summed in the statistics dtype and returned in
    ``backward``'s ``param_dtype`` (rounded once), or in the statistics dtype when that is None;
    ``None`` where there is no such parameter; with a :class:`Branch`, ``dx`` (in the stream dtype)
    and ``dlayer_scale`` (in the statistics dtype, ``None`` without a layer scale), else both
    ``None`` (``dx`` is ``ds``)."""

    ds: Tensor
    dweight: Tensor | None
    dbias: Tensor | None
    dx: Tensor | None = None
    dlayer_scale: Tensor | None = None
    dweight1: Tensor | None = None  # with a second norm (``Capabilities.second_norm``), as dweight
    dbias1: Tensor | None = None


class Backend(Protocol):
    """The functions every backend module provides (besides ``CAPABILITIES``)."""

    CAPABILITIES: Capabilities

    def unavailable_reason(self, x: Tensor | None) -> str | None:
        """Why this backend cannot run (on ``x``, if given): a missing dependency, another
        device, a dtype it lacks; ``None`` if it can."""

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        weight: Tensor | None,
        bias: Tensor | None,
        *,
        eps: float,
        rms: bool,
        residual_dtype: torch.dtype | None,
        write_stream: bool = True,
        write_stats: bool = True,
        out: Tensor | None = None,
        residual_out: Tensor | None = None,
        branch: Branch | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """``(y, s, mean, rstd)`` for the rows ``x`` (plus ``residual``, through ``branch`` when
        given): ``y`` in ``x.dtype``, ``s = x + residual`` in the stream dtype (``None`` without a
        residual, and may be ``None`` when ``write_stream`` is False), ``mean`` (``None`` for
        RMSNorm) and ``rstd`` of shape ``(M,)`` in the statistics dtype (both may be ``None`` when
        ``write_stats`` is False).
        ``out``/``residual_out``: contiguous buffers to write ``y``/``s`` into, returned as such."""

    def backward(
        self,
        dy: Tensor,
        dstream: Tensor | None,
        s_parts: tuple[Tensor, ...],
        weight: Tensor | None,
        mean: Tensor | None,
        rstd: Tensor,
        *,
        rms: bool,
        has_bias: bool,
        branch: Branch | None = None,
        param_dtype: torch.dtype | None = None,
    ) -> Grads:
        """:class:`Grads`. ``s_parts`` holds the norm's input ``s`` as it was saved: ``(s,)``, or
        ``(x, residual)`` (both in the stream dtype, see :func:`check_s_parts`), from which the
        forward's ``s`` is recomputed bit for bit (through ``branch``, which needs them). ``dstream``
        is the gradient of the returned stream (pre-norm) or ``None``. ``param_dtype``: the dtype
        of the weight and bias (given when they share it), which ``dweight``/``dbias`` are
        returned in: a kernel that rounds its sums to it spares the caller a conversion per call."""


@dataclass(frozen=True)
class BackendSpec:
    name: str
    module: str | ModuleType  # a path is imported on first use: an optional dependency is needed only then
    summary: str


_BUILT_IN = (
    BackendSpec("reference", "addnorm.kernels.torch", "the plain-torch formulas; test oracle and fallback, any device"),
    BackendSpec("cpu", "addnorm.kernels.cpu", "fused numba kernels, CPU"),
    BackendSpec("triton", "addnorm.kernels.triton", "fused Triton kernels, CUDA (CPU tensors through the interpreter)"),
)
REGISTRY: dict[str, BackendSpec] = {spec.name: spec for spec in _BUILT_IN}
_REQUIRED = ("unavailable_reason", "forward", "backward")
_LOADED: dict[str, Backend] = {}


def names() -> list[str]:
    """Every value ``backend=`` accepts."""
    return ["auto", *REGISTRY]


def _checked(name: str, module: ModuleType) -> Backend:
    missing = [f for f in _REQUIRED if not callable(getattr(module, f, None))]
    if not isinstance(getattr(module, "CAPABILITIES", None), Capabilities):
        missing.append("CAPABILITIES")
    if missing:
        raise TypeError(f"backend {name!r} ({module.__name__}) does not implement {', '.join(missing)}")
    return module


def load(name: str) -> Backend:
    """The backend module ``name``, imported and checked against the contract once.
    ImportError when an optional dependency is missing."""
    backend = _LOADED.get(name)
    if backend is None:
        module = REGISTRY[name].module
        if isinstance(module, str):
            module = importlib.import_module(module)
        backend = _LOADED[name] = _checked(name, module)
    return backend


def register(
    name: str, module: str | ModuleType, *, summary: str = "", device_types_for_auto: tuple[str, ...] = ()
) -> None:
    """Make ``backend=name`` run ``module`` (a module, or its import path, imported on first use).

    ``device_types_for_auto``: device types on which ``backend="auto"`` picks this backend from
    now on (where it can run; else the reference). A module object is checked against the
    contract now, a path when first loaded. A name already registered is refused: call
    :func:`unregister` first."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"backend name must be an identifier, got {name!r}")
    if name == "auto" or name in REGISTRY:
        raise ValueError(f"backend {name!r} is already registered; unregister({name!r}) first")
    if not isinstance(module, (str, ModuleType)):
        raise TypeError(f"module must be a module or its import path, got {type(module).__name__}")
    if isinstance(device_types_for_auto, list):
        device_types_for_auto = tuple(device_types_for_auto)
    _check_device_types("device_types_for_auto", device_types_for_auto)
    if isinstance(module, ModuleType):  # (every check before the registry changes)
        _LOADED[name] = _checked(name, module)
    REGISTRY[name] = BackendSpec(name, module, summary or f"registered from {getattr(module, '__name__', module)}")
    for device_type in device_types_for_auto:
        _AUTO_PREFERENCE[device_type] = name
        _AUTO.pop(device_type, None)


def unregister(name: str) -> None:
    """Remove a backend added by :func:`register` (the built-in ones stay), and ``"auto"``'s
    preference for it: those device types fall back to the built-in choice."""
    if any(spec.name == name for spec in _BUILT_IN):
        raise ValueError(f"backend {name!r} is built in and cannot be unregistered")
    if name not in REGISTRY:
        raise ValueError(f"backend {name!r} is not registered")
    del REGISTRY[name]
    _LOADED.pop(name, None)
    for device_type, preferred in list(_AUTO_PREFERENCE.items()):
        if preferred == name:
            _AUTO_PREFERENCE.pop(device_type)
            _AUTO_PREFERENCE.update({k: v for k, v in _BUILT_IN_AUTO.items() if k == device_type})
    _AUTO.clear()


def unavailable_reason(name: str, x: Tensor | None = None) -> str | None:
    """Why backend ``name`` cannot run (on ``x``, if given), or ``None`` if it can."""
    try:
        backend = load(name)
    except ImportError as err:  # an optional dependency is missing
        return f"{err.name or err}: not installed"
    devices = backend.CAPABILITIES.device_types
    if x is not None and devices is not None and x.device.type not in devices:
        return f"runs on {' and '.join(devices)} tensors, got a tensor on {x.device}"
    return backend.unavailable_reason(x)


# backend="auto" per device type: the fused kernels of that device where they can run, else the
# reference. The choice depends on the device alone (every backend takes every supported dtype),
# never on the size of the input: one path, the same numerics, at every size.
_BUILT_IN_AUTO = {"cpu": "cpu", "cuda": "triton"}
_AUTO_PREFERENCE = dict(_BUILT_IN_AUTO)
_AUTO: dict[str, str] = {}


def auto_plain_forward(device_type: str):
    """The optional ``plain_forward`` of the backend ``"auto"`` runs on ``device_type``
    (:mod:`addnorm.shortcut`), once its first call there has chosen it; else None. Only one
    written beside the backend's ``forward`` (in the same module): a backend that re-exports
    another's functions (``from addnorm.kernels.cpu import *``) and writes a ``forward`` of its
    own gets that forward, not the other's shortcut."""
    backend = _LOADED.get(_AUTO.get(device_type))
    run = getattr(backend, "plain_forward", None)
    if run is None or getattr(sys.modules.get(run.__module__), "forward", None) is not backend.forward:
        return None  # (the forward of plain_forward's own module, not a name a wrapper copied)
    return run


def auto_name(x: Tensor) -> str:
    """The backend ``backend="auto"`` runs for tensors on ``x``'s device."""
    device_type = x.device.type
    name = _AUTO.get(device_type)
    if name is None:
        preferred = _AUTO_PREFERENCE.get(device_type)
        name = preferred if preferred and unavailable_reason(preferred, x) is None else "reference"
        _AUTO[device_type] = name
    return name


def resolve(name: str, x: Tensor) -> Backend:
    """The backend that runs ``backend=name`` on ``x``, or a RuntimeError saying why it cannot."""
    if name == "auto":
        if x.is_cpu and "cpu" in _AUTO:  # (x.device costs more than the rest of this call)
            return _LOADED[_AUTO["cpu"]]
        return load(auto_name(x))
    reason = unavailable_reason(name, x)
    if reason is not None:
        raise RuntimeError(f"backend {name!r} cannot run here: {reason}")
    return _LOADED[name]


def check_s_parts(s_parts: tuple[Tensor, ...], branch: Branch | None = None) -> None:
    """``(x, residual)`` in backward must share shape and dtype: only then is ``x + residual``,
    rounded to that dtype, bit for bit the forward's ``s``. A branch needs them (``dx`` is not
    ``ds``, and the layer scale's gradient reads ``x``); its stream dtype is ``residual``'s."""
    if branch is not None and len(s_parts) != 2:
        raise ValueError("with a branch (dropout, layer_scale or rowscale) s_parts must be (x, residual)")
    if len(s_parts) == 2:
        x, residual = s_parts
        # with a branch the stream is summed in the statistics dtype and rounded to residual's
        if residual.shape != x.shape or (branch is None and residual.dtype != x.dtype):
            raise ValueError(
                f"s_parts=(x, residual) in backward need one shape and dtype, got "
                f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}"
            )
    elif len(s_parts) != 1:
        raise ValueError(f"s_parts must be (s,) or (x, residual), got {len(s_parts)} tensors")


def active(branch: Branch | None) -> Branch | None:
    """``branch`` when it changes anything, else None (``p = 0`` and no scales: a plain add)."""
    if branch is None or (branch.p == 0 and branch.layer_scale is None and branch.rowscale is None):
        return None
    return branch
