"""flash-attn's fused Add & Norm signatures on addnorm's ops, on every device and backend.

Code written for ``flash_attn.ops.triton.layer_norm`` (or its copy in ``mamba_ssm``) runs on
addnorm with one import changed::

    from addnorm.compat.flash_attn import RMSNorm, layer_norm_fn, layer_norm_linear_fn, rms_norm_fn

(``LayerNormFn.apply`` and ``LayerNormLinearFn.apply`` too, for code that calls flash-attn's
Functions directly)
and its tests, with ``layer_norm_ref`` / ``rms_norm_ref``, its formulas in plain torch ops. The
arguments and the order of the results are flash-attn's; the numerics are addnorm's
(statistics in float32, the corrected mean, the same bits on every backend). mamba_ssm 1.x's
copy (``mamba_ssm.ops.triton.layernorm``) has no ``x1``: pass its ``eps``, ``prenorm`` and
``residual_in_fp32`` by keyword. Where the two differ:

- ``y`` normalizes the stream ``s`` as it is returned, rounded to the residual dtype (as ``x +
  residual`` then a norm in torch); flash-attn normalizes the float32 sum before rounding it, so
  with a 16-bit stream the two ``y`` differ by about one rounding;
- dropout's keep masks come from addnorm's counter-based hash, not Triton's ``tl.rand``: other
  random bits, the same distribution, and the same bits on the CPU and the GPU;
- a dropped element is multiplied by 0, as torch's dropout does, so an inf or NaN there gives
  NaN in the stream and its row; flash-attn's kernel (and :func:`layer_norm_ref`, its oracle)
  selects 0 instead. Finite values give the same results either way;
- ``x1``'s term is added to the residual first and rounded to the residual dtype, then ``x``'s
  (:func:`addnorm.add_layer_norm`); flash-attn sums the three in float32 before one rounding;
- ``out_dtype`` converts the result of the input dtype (flash-attn writes it in ``out_dtype``
  directly, so a wider ``out_dtype`` than ``x``'s keeps more bits there);
- ``out=`` / ``residual_out=``: without autograd the kernels write them, as everywhere in addnorm;
  under autograd (an input requires grad) the results are computed, then copied into them (a copy
  autograd records; flash-attn's kernel writes them directly). ``out`` has ``x``'s dtype (not with
  an ``out_dtype`` of another), and neither combines with ``x1`` or ``weight1``. As in flash-attn,
  a buffer may hold ``x``'s rows in another shape (``(rows, hidden)`` for a 3-D ``x``), and the
  result is then a view of it in ``x``'s shape.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..checks import check_dtype, check_flag, check_float_tensor
from ..ops import NO_PARALLEL, NO_SUBLAYER, Parallel, Sublayer, add_norm


def layer_norm_fn(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None = None,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    zero_centered_weight: bool = False,
    is_rms_norm: bool = False,
    return_dropout_mask: bool = False,
    out_dtype: torch.dtype | None = None,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
    *,
    backend: str = "auto",
):
    """flash-attn's ``layer_norm_fn``: ``s = residual + dropout(rowscale * x) + dropout(x1)``,
    normalized over the last dim (LayerNorm, or RMSNorm with ``is_rms_norm``; both take a bias).

    Returns ``y`` (or ``(y, y1)`` with ``weight1``), then ``s`` when ``prenorm``, then both keep
    masks when ``return_dropout_mask`` (``None`` without dropout; the second ``None`` without
    ``x1``). ``s`` is kept in ``residual``'s dtype, or in float32 when there is no residual and
    ``residual_in_fp32``; it is ``x`` itself when nothing is added, dropped or converted.
    ``backend`` (keyword-only, addnorm's own) picks the backend, ``"auto"`` by default.
    ``rowscale`` holds one factor per row, in x's leading dims or flat (flash-attn's ``(rows,)``)."""
    check_flag("is_rms_norm", is_rms_norm)
    check_flag("residual_in_fp32", residual_in_fp32)
    check_dtype("out_dtype", out_dtype)
    if isinstance(x1, (bool, int, float)):  # (a positional call in mamba_ssm 1.x's order)
        raise TypeError(
            f"x1 must be a torch.Tensor or None, got {type(x1).__name__}: mamba_ssm 1.x's layer_norm_fn and "
            "rms_norm_fn take eps or prenorm fifth; pass eps=, prenorm= and residual_in_fp32= by keyword"
        )
    if isinstance(x, Tensor):  # (anything else: add_norm says what x must be)
        if out is not None and out_dtype is not None and out_dtype != x.dtype:
            raise ValueError(
                f"out= with out_dtype={out_dtype}: addnorm writes out in x's dtype ({x.dtype}) and converts after; "
                "pass out without out_dtype, or out_dtype without out"
            )
        if x.dim() == 0:
            raise ValueError("x must have the hidden size as its last dim, got a 0-d tensor")
        if isinstance(weight, Tensor) and weight.dim() == 1 and weight.shape[0] != x.shape[-1]:
            raise ValueError(
                f"x's last dim must be the hidden size, weight's {weight.shape[0]}, got x of shape "
                f"{tuple(x.shape)}: flash-attn's functions normalize over x's last dim"
            )
        if isinstance(rowscale, Tensor) and rowscale.numel() == x.numel() // max(x.shape[-1], 1):
            rowscale = rowscale.reshape(x.shape[:-1])  # flash-attn takes the rows flat
        out, residual_out = (_shaped_as(x, buffer) for buffer in (out, residual_out))
    if residual is not None:
        residual_dtype = check_float_tensor("residual", residual).dtype
    else:
        residual_dtype = torch.float32 if residual_in_fp32 else None
    buffers = None
    if (out is not None or residual_out is not None) and x1 is None and weight1 is None and bias1 is None:
        tensors = (x, residual, weight, bias)
        if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors):
            buffers, out, residual_out = (out, residual_out), None, None  # (written after: _copied_into)
    sublayer = NO_SUBLAYER
    if dropout_p or rowscale is not None or zero_centered_weight or return_dropout_mask:
        sublayer = Sublayer(dropout_p, None, None, rowscale, zero_centered_weight, return_dropout_mask)
    parallel = NO_PARALLEL if x1 is None and weight1 is None and bias1 is None else Parallel(x1, weight1, bias1)
    n = int(x.shape[-1]) if isinstance(x, Tensor) else 0  # (an int under torch.jit.trace too)
    result = add_norm(
        x,
        residual,
        n,
        weight,
        bias,
        eps,
        rms=is_rms_norm,
        prenorm=prenorm or (buffers is not None and buffers[1] is not None),
        residual_dtype=residual_dtype,
        backend=backend,
        out=out,
        residual_out=residual_out,
        sublayer=sublayer,
        parallel=parallel,
    )
    result = list(result) if isinstance(result, tuple) else [result]
    outputs = 2 if weight1 is not None else 1
    if buffers is not None:
        result = _copied_into(result, buffers, prenorm)
    if out_dtype is not None:
        result[:outputs] = [y.to(out_dtype) for y in result[:outputs]]
    if return_dropout_mask:
        masks = result[outputs + prenorm :]
        masks = [None if not dropout_p else m for m in masks] + [None] * (2 - len(masks))
        result = result[: outputs + prenorm] + masks
    head = tuple(result[:outputs]) if outputs == 2 else result[0]
    if not prenorm and not return_dropout_mask:
        return head
    rest = tuple(result[outputs:])
    return (*head, *rest) if outputs == 2 else (head, *rest)


def _copied_into(result: list, buffers: tuple, prenorm: bool) -> list:
    """``out=`` / ``residual_out=`` under autograd, as flash-attn's Function writes and returns them:
    ``y`` (``result[0]``) and the stream (``result[1]``, computed for ``residual_out`` whatever
    ``prenorm``) copied into their buffers, a copy autograd records, so that gradients reach the
    inputs through the buffers returned in their place; the stream left out again without
    ``prenorm``. A buffer must have its result's shape, dtype and device."""
    for i, (name, buffer) in enumerate(zip(("out", "residual_out"), buffers)):
        if buffer is None:
            continue
        t = result[i]
        if (
            not isinstance(buffer, Tensor)
            or buffer.shape != t.shape
            or buffer.dtype != t.dtype
            or buffer.device != t.device
        ):
            got = (
                f"{buffer.dtype} of shape {tuple(buffer.shape)} on {buffer.device}"
                if isinstance(buffer, Tensor)
                else type(buffer).__name__
            )
            raise ValueError(f"{name} must be a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}, got {got}")
        result[i] = buffer.copy_(t)
    if buffers[1] is not None and not prenorm:
        del result[1]
    return result


def _shaped_as(x: Tensor, buffer: Tensor | None) -> Tensor | None:
    """A contiguous buffer of ``x``'s rows in another shape (flash-attn's ``(rows, hidden)`` for a
    3-D ``x``) as a view of ``x``'s shape, as flash-attn reshapes it; anything else as it is (for
    add_norm to check)."""
    if (
        isinstance(buffer, Tensor)
        and buffer.shape != x.shape
        and buffer.dim() >= 1
        and buffer.shape[-1] == x.shape[-1]
        and buffer.numel() == x.numel()
        and buffer.is_contiguous()
    ):
        return buffer.view(x.shape)
    return buffer


def rms_norm_fn(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None = None,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    zero_centered_weight: bool = False,
    return_dropout_mask: bool = False,
    out_dtype: torch.dtype | None = None,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
    *,
    backend: str = "auto",
):
    """flash-attn's ``rms_norm_fn``: :func:`layer_norm_fn` with ``is_rms_norm=True``."""
    return layer_norm_fn(
        x,
        weight,
        bias,
        residual,
        x1,
        weight1,
        bias1,
        eps,
        dropout_p,
        rowscale,
        prenorm,
        residual_in_fp32,
        zero_centered_weight,
        True,
        return_dropout_mask,
        out_dtype,
        out,
        residual_out,
        backend=backend,
    )


def layer_norm_linear_fn(
    x: Tensor,
    norm_weight: Tensor | None,
    norm_bias: Tensor | None,
    linear_weight: Tensor,
    linear_bias: Tensor | None,
    residual: Tensor | None = None,
    eps: float = 1e-6,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    is_rms_norm: bool = False,
    *,
    backend: str = "auto",
):
    """flash-attn's ``layer_norm_linear_fn``: :func:`layer_norm_fn`, then a linear layer of its
    output, in autocast's dtype under autocast (else the output's), ``linear_weight`` and
    ``linear_bias`` converted to it. Returns the linear's output, then ``s`` when ``prenorm``.
    flash-attn recomputes the norm's output in its backward; here autograd keeps it for the
    linear's backward (in training, one more tensor of ``x``'s shape and dtype)."""
    if not isinstance(linear_weight, Tensor):
        raise TypeError(f"linear_weight must be a torch.Tensor, got {type(linear_weight).__name__}")
    n = int(x.shape[-1]) if isinstance(x, Tensor) and x.dim() else None
    if n is not None and (linear_weight.dim() != 2 or linear_weight.shape[1] != n):  # (a bad x: layer_norm_fn says)
        raise ValueError(
            f"linear_weight must be (out_features, {n}), the hidden size of x last, got {tuple(linear_weight.shape)}"
        )
    if linear_bias is not None and (
        not isinstance(linear_bias, Tensor) or tuple(linear_bias.shape) != (linear_weight.shape[0],)
    ):
        got = tuple(linear_bias.shape) if isinstance(linear_bias, Tensor) else type(linear_bias).__name__
        raise ValueError(f"linear_bias must be ({linear_weight.shape[0]},), one per output feature, got {got}")
    result = layer_norm_fn(
        x,
        norm_weight,
        norm_bias,
        residual,
        eps=eps,
        prenorm=prenorm,
        residual_in_fp32=residual_in_fp32,
        is_rms_norm=is_rms_norm,
        backend=backend,
    )
    y = result[0] if prenorm else result
    device = y.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else y.dtype
    bias = linear_bias.to(dtype) if linear_bias is not None else None
    out = nn.functional.linear(y.to(dtype), linear_weight.to(dtype), bias)
    return (out, result[1]) if prenorm else out


class LayerNormFn:
    """flash-attn's autograd Function behind :func:`layer_norm_fn`, for code that calls it
    directly: ``LayerNormFn.apply(...)`` takes :func:`layer_norm_fn`'s arguments, in its order."""

    apply = staticmethod(layer_norm_fn)


class LayerNormLinearFn:
    """flash-attn's autograd Function behind :func:`layer_norm_linear_fn`: ``apply`` takes its
    arguments, in its order."""

    apply = staticmethod(layer_norm_linear_fn)


def layer_norm_ref(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None = None,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: Tensor | None = None,
    prenorm: bool = False,
    zero_centered_weight: bool = False,
    dropout_mask: Tensor | None = None,
    dropout_mask1: Tensor | None = None,
    upcast: bool = False,
    *,
    is_rms_norm: bool = False,
):
    """flash-attn's ``layer_norm_ref``: :func:`layer_norm_fn`'s result in plain torch ops, unfused,
    the oracle flash-attn's tests compare it with. Computes in the inputs' dtypes, or in float32
    with ``upcast``, in flash-attn's order: ``s = (rowscale * x)``, dropped, plus ``x1`` dropped,
    plus ``residual``; then ``norm(s)`` and ``norm1(s)``, cast to ``x``'s dtype. ``dropout_mask`` /
    ``dropout_mask1`` (what ``layer_norm_fn(..., return_dropout_mask=True)`` returned) drop the same
    elements; without them ``dropout_p`` draws torch's dropout. Returns ``y`` or ``(y, y1)``, then
    ``s`` when ``prenorm``."""
    if rowscale is not None and x1 is not None:
        raise ValueError("rowscale with x1 is ambiguous (which sublayer output does it scale?), as in flash-attn")
    dtype = x.dtype
    if upcast:
        x, weight, bias, residual, x1, weight1, bias1 = (
            None if t is None else t.float() for t in (x, weight, bias, residual, x1, weight1, bias1)
        )
    if rowscale is not None:
        x = x * rowscale.reshape(*x.shape[:-1], 1)
    if dropout_p > 0:
        x = _dropped(x, dropout_mask, dropout_p)
        x1 = None if x1 is None else _dropped(x1, dropout_mask1, dropout_p)
    s = x if x1 is None else x + x1
    s = s if residual is None else (s + residual).to(s.dtype)

    def norm(w: Tensor | None, b: Tensor | None) -> Tensor:
        w = w + 1 if zero_centered_weight and w is not None else w
        if not is_rms_norm:
            y = nn.functional.layer_norm(s if w is None else s.to(w.dtype), s.shape[-1:], w, b, eps)
        else:
            y = s * (1 / torch.sqrt(s.square().mean(-1, keepdim=True) + eps))  # (flash-attn's rounding)
            y = y if w is None else y * w
            y = y if b is None else y + b
        return y.to(dtype)

    y = norm(weight, bias) if weight1 is None else (norm(weight, bias), norm(weight1, bias1))
    if not prenorm:
        return y
    return (*y, s) if weight1 is not None else (y, s)


def rms_norm_ref(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None = None,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: Tensor | None = None,
    prenorm: bool = False,
    zero_centered_weight: bool = False,
    dropout_mask: Tensor | None = None,
    dropout_mask1: Tensor | None = None,
    upcast: bool = False,
):
    """flash-attn's ``rms_norm_ref``: :func:`layer_norm_ref` with RMSNorm,
    ``y = s / sqrt(mean(s²) + eps) * weight + bias``."""
    args = (x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, zero_centered_weight)
    return layer_norm_ref(*args, dropout_mask, dropout_mask1, upcast, is_rms_norm=True)


def _dropped(x: Tensor, keep: Tensor | None, p: float) -> Tensor:
    """Inverted dropout of ``x``: by the keep mask ``keep`` (in x's shape or flash-attn's ``(rows,
    hidden)``), or drawn by torch without one."""
    return nn.functional.dropout(x, p) if keep is None else x.masked_fill(~keep.reshape(x.shape), 0.0) / (1 - p)


class RMSNorm(nn.Module):
    """flash-attn's ``RMSNorm`` module: the same constructor, attributes (``eps``, ``drop``,
    ``zero_centered_weight``, ``weight``, ``bias = None``) and ``state_dict``, so that
    :func:`addnorm.patch` can swap the class of flash-attn's or mamba_ssm's modules in place.
    ``forward(x, residual=None, prenorm=False, residual_in_fp32=False)`` as :func:`rms_norm_fn`,
    with dropout in training only (a module patched by :func:`addnorm.patch` runs on its
    ``backend``)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        dropout_p: float = 0.0,
        zero_centered_weight: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.drop = nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.zero_centered_weight = zero_centered_weight
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.zero_centered_weight else nn.init.ones_(self.weight)

    def forward(self, x: Tensor, residual: Tensor | None = None, prenorm: bool = False, residual_in_fp32: bool = False):
        drop = getattr(self, "drop", None)
        return rms_norm_fn(
            x,
            self.weight,
            self.bias,
            residual=residual,
            eps=self.eps,
            dropout_p=drop.p if drop is not None and self.training else 0.0,
            prenorm=prenorm,
            residual_in_fp32=residual_in_fp32,
            zero_centered_weight=getattr(self, "zero_centered_weight", False),
            backend=getattr(self, "backend", "auto"),
        )
