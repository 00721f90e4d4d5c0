"""The functional API: LayerNorm, RMSNorm and the residual add fused with them.

Every function normalizes over the trailing ``normalized_shape`` dims of ``x``, computes
its statistics in float32 (float64 for float64 input), returns ``y`` in the dtype of
``x``, and is differentiable through a hand-written backward (see
:mod:`addnorm.reference` for the formulas). ``backend`` picks the implementation:
``"auto"`` (by device at call time: every size keeps the same numerics), ``"reference"``, or a kernel
backend when installed (``addnorm info`` lists them).

For inference loops, ``out=`` (and ``residual_out=`` for the stream ``s`` of the Add & Norm
functions) take preallocated contiguous buffers of the results' shape and dtype, which are
written and returned instead of fresh tensors (fresh multi-MB outputs page-fault on every
call). They do not support autograd: an error is raised if an input requires grad. A buffer may
be an input itself (``out=x``: written in place), but not share only part of an input's memory,
nor the other buffer's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .checks import check_float_tensor
from .ops import NO_PARALLEL, NO_SUBLAYER, Parallel, Sublayer, add_norm

Shape = int | Sequence[int]


def _sublayer(dropout_p, generator, layer_scale, rowscale, zero_centered_weight, return_dropout_mask) -> Sublayer:
    """The sublayer arguments as :func:`~addnorm.ops.add_norm` takes them: ``NO_SUBLAYER`` itself
    when all are off (a plain call, recognized by identity), else a :class:`~addnorm.ops.Sublayer`."""
    if (
        type(dropout_p) in (int, float)
        and dropout_p == 0
        and generator is None
        and layer_scale is None
        and rowscale is None
        and zero_centered_weight is False
        and return_dropout_mask is False
    ):
        return NO_SUBLAYER
    return Sublayer(dropout_p, generator, layer_scale, rowscale, zero_centered_weight, return_dropout_mask)


def layer_norm(
    x: Tensor,
    normalized_shape: Shape,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    zero_centered_weight: bool = False,
    backend: str = "auto",
    out: Tensor | None = None,
) -> Tensor:
    """``weight * (x - mean) / sqrt(var + eps) + bias`` over the trailing ``normalized_shape``
    dims, with the biased variance; as :func:`torch.nn.functional.layer_norm`.
    ``zero_centered_weight=True`` scales by ``1 + weight`` (computed in float32)."""
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
        sublayer=NO_SUBLAYER if zero_centered_weight is False else Sublayer(zero_centered_weight=zero_centered_weight),
    )


def rms_norm(
    x: Tensor,
    normalized_shape: Shape,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    zero_centered_weight: bool = False,
    backend: str = "auto",
    out: Tensor | None = None,
) -> Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the trailing ``normalized_shape`` dims;
    ``eps=None`` means the machine epsilon of the compute dtype (float32's for float16,
    bfloat16 and float32 input; float64's for float64), as :func:`torch.nn.functional.rms_norm`.
    ``zero_centered_weight=True`` scales by ``1 + weight`` (Gemma's RMSNorm)."""
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
        sublayer=NO_SUBLAYER if zero_centered_weight is False else Sublayer(zero_centered_weight=zero_centered_weight),
    )


def add_layer_norm(
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: Shape,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    prenorm: bool = False,
    residual_dtype: torch.dtype | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    layer_scale: Tensor | None = None,
    rowscale: Tensor | None = None,
    zero_centered_weight: bool = False,
    return_dropout_mask: bool = False,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    backend: str = "auto",
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """Add & Norm with LayerNorm: ``s = x + residual``, then ``layer_norm(s)``.

    ``prenorm=False`` (post-norm, the original Transformer: ``LN(x + sublayer(x))``) returns
    ``layer_norm(s)``. ``prenorm=True`` (pre-norm, GPT-2: ``x + sublayer(LN(x))``) returns
    ``(layer_norm(s), s)``, where ``s`` is the new residual stream. ``s`` is computed in
    ``residual_dtype`` when given (e.g. ``torch.float32`` to keep the stream in fp32
    under bf16 activations), else in torch's promotion of the two dtypes.

    The sublayer branch (keyword-only, all off by default) is fused into the add::

        s = residual + rowscale * layer_scale * dropout(x, dropout_p)

    - ``dropout_p``: inverted dropout of the sublayer output ``x`` (never of the residual), kept
      elements scaled by ``1 / (1 - p)``; the keep mask is a hash of ``(seed, row, column)``
      (:func:`addnorm.reference.keep_mask`), the seed drawn from ``generator`` (torch's default
      generator of ``x``'s device when None), the same bits on every backend, recomputed by the
      backward, never stored. Call with ``dropout_p=0`` in evaluation (as ``nn.Dropout`` in
      ``eval()``; :class:`addnorm.AddNorm` does so). ``return_dropout_mask=True`` also returns the
      mask (a bool tensor of ``x``'s shape), last.
    - ``layer_scale``: a learnable per-feature factor of ``normalized_shape`` (CaiT, DeiT III).
    - ``rowscale``: a per-row factor of ``x``'s leading dims (drop path / stochastic depth), no
      gradient.
    - ``zero_centered_weight=True``: the norm scales by ``1 + weight`` (computed in float32), so
      that weight decay pulls the scale toward 1 (Gemma).

    ``residual=None`` starts the stream (the first block of a pre-norm stack):
    ``s = rowscale * layer_scale * dropout(x)`` in ``residual_dtype`` (``x`` itself when nothing
    applies), returned with ``prenorm=True``.

    Parallel blocks (GPT-J, GPT-NeoX, Falcon, PaLM), keyword-only: ``x1`` is a second sublayer
    output added to the stream with a keep mask of its own (same ``dropout_p``; not with
    ``rowscale``), ``s = (residual + dropout1(x1)) + rowscale * layer_scale * dropout(x)``; with
    ``weight1`` (and ``bias1``) a second norm of the same ``s`` is returned too. The results, in
    this order: ``y``, ``y1`` (with ``weight1``), ``s`` (``prenorm=True``), the keep masks of ``x``
    and of ``x1`` (``return_dropout_mask=True``; the second with ``x1`` only).
    """
    if residual is not None and type(residual) is not Tensor:
        check_float_tensor("residual", residual)
    parallel = NO_PARALLEL if x1 is None and weight1 is None and bias1 is None else Parallel(x1, weight1, bias1)
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
        sublayer=_sublayer(dropout_p, generator, layer_scale, rowscale, zero_centered_weight, return_dropout_mask),
        parallel=parallel,
    )


def add_rms_norm(
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: Shape,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    prenorm: bool = False,
    residual_dtype: torch.dtype | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    layer_scale: Tensor | None = None,
    rowscale: Tensor | None = None,
    zero_centered_weight: bool = False,
    return_dropout_mask: bool = False,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    backend: str = "auto",
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """Add & Norm with RMSNorm; arguments and results as :func:`add_layer_norm`, the sublayer
    branch (dropout, layer scale, rowscale), ``zero_centered_weight``, ``residual=None`` and the
    parallel block's ``x1`` / ``weight1`` included. ``eps=None``: as :func:`rms_norm`'s, for the
    dtype of the stream it normalizes (``residual_dtype``, or x's and residual's promoted)."""
    if residual is not None and type(residual) is not Tensor:
        check_float_tensor("residual", residual)
    parallel = NO_PARALLEL if x1 is None and weight1 is None else Parallel(x1, weight1)
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
        sublayer=_sublayer(dropout_p, generator, layer_scale, rowscale, zero_centered_weight, return_dropout_mask),
        parallel=parallel,
    )


# torch.fx.symbolic_trace records a call of these functions, through this module or the package,
# as one node (as it records torch's norm modules, which are its leaves) instead of tracing into
# the checks, which take no Proxy. (torch.fx.wrap patches the namespace it is called from.)
FX_LEAVES = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
for _name in FX_LEAVES:
    torch.fx.wrap(_name)
