"""The functional API: LayerNorm, RMSNorm and the residual add fused with them.

Every function normalizes over the trailing ``normalized_shape`` dims of ``x``, computes
its statistics in float32 (float64 for float64 input), returns ``y`` in the dtype of
``x``, and is differentiable through a hand-written backward (see
:mod:`addnorm.reference` for the formulas). ``backend`` picks the implementation:
``"auto"`` (by device, dtype and size at call time), ``"reference"``, or a kernel
backend when installed (``addnorm info`` lists them).

For inference loops, ``out=`` (and ``residual_out=`` for the stream ``s`` of the Add & Norm
functions) take preallocated contiguous buffers of the results' shape and dtype, which are
written and returned instead of fresh tensors (fresh multi-MB outputs page-fault on every
call). They do not support autograd: an error is raised if an input requires grad.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .ops import _check_float_tensor, add_norm

Shape = int | Sequence[int]


def layer_norm(
    x: Tensor,
    normalized_shape: Shape,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str = "auto",
    out: Tensor | None = None,
) -> Tensor:
    """``weight * (x - mean) / sqrt(var + eps) + bias`` over the trailing ``normalized_shape``
    dims, with the biased variance; as :func:`torch.nn.functional.layer_norm`."""
    return add_norm(
        x,
        None,
        normalized_shape,
        weight,
        bias,
        eps,
        rms=False,
        prenorm=False,
        residual_dtype=None,
        backend=backend,
        out=out,
    )


def rms_norm(
    x: Tensor,
    normalized_shape: Shape,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    backend: str = "auto",
    out: Tensor | None = None,
) -> Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the trailing ``normalized_shape`` dims;
    ``eps=None`` means the machine epsilon of the compute dtype (float32's for float16,
    bfloat16 and float32 input; float64's for float64), as :func:`torch.nn.functional.rms_norm`."""
    return add_norm(
        x,
        None,
        normalized_shape,
        weight,
        None,
        eps,
        rms=True,
        prenorm=False,
        residual_dtype=None,
        backend=backend,
        out=out,
    )


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: Shape,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    prenorm: bool = False,
    residual_dtype: torch.dtype | None = None,
    backend: str = "auto",
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Add & Norm with LayerNorm: ``s = x + residual``, then ``layer_norm(s)``.

    ``prenorm=False`` (post-norm, the original Transformer: ``LN(x + sublayer(x))``) returns
    ``layer_norm(s)``. ``prenorm=True`` (pre-norm, GPT-2: ``x + sublayer(LN(x))``) returns
    ``(layer_norm(s), s)``, where ``s`` is the new residual stream. ``s`` is computed in
    ``residual_dtype`` when given (e.g. ``torch.float32`` to keep the stream in fp32
    under bf16 activations), else in torch's promotion of the two dtypes.
    """
    if type(residual) is not Tensor:  # None here would silently be a plain norm
        _check_float_tensor("residual", residual)
    return add_norm(
        x,
        residual,
        normalized_shape,
        weight,
        bias,
        eps,
        rms=False,
        prenorm=prenorm,
        residual_dtype=residual_dtype,
        backend=backend,
        out=out,
        residual_out=residual_out,
    )


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: Shape,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    prenorm: bool = False,
    residual_dtype: torch.dtype | None = None,
    backend: str = "auto",
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Add & Norm with RMSNorm; arguments and results as :func:`add_layer_norm`."""
    if type(residual) is not Tensor:  # None here would silently be a plain norm
        _check_float_tensor("residual", residual)
    return add_norm(
        x,
        residual,
        normalized_shape,
        weight,
        None,
        eps,
        rms=True,
        prenorm=prenorm,
        residual_dtype=residual_dtype,
        backend=backend,
        out=out,
        residual_out=residual_out,
    )
