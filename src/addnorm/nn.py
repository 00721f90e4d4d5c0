"""Drop-in modules: :class:`LayerNorm`, :class:`RMSNorm` and :class:`AddNorm`.

:class:`LayerNorm` and :class:`RMSNorm` subclass :class:`torch.nn.LayerNorm` and
:class:`torch.nn.RMSNorm`: the constructor, parameters, ``state_dict`` keys,
``reset_parameters``, ``extra_repr`` and ``isinstance`` checks are torch's own, so a
torch checkpoint loads with ``strict=True`` and code that initialises "every
``nn.LayerNorm``" keeps working. Only ``forward`` differs: it runs addnorm's ops.
"""

# (no `from __future__ import annotations`: torch.fx copies forward's annotations into the code of
# a GraphModule rooted at one of these modules, which then pickles only if they are types)
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from . import checks
from . import functional as F

Shape = int | Sequence[int]


class _NotScriptable:
    """``torch.jit.script`` asks every module to prepare itself first: addnorm's say why they
    cannot be scripted (TorchScript cannot compile the Python that dispatches to the kernels)."""

    def __prepare_scriptable__(self):
        raise TypeError(
            f"torch.jit.script cannot compile addnorm.{type(self).__name__}: its forward dispatches "
            "to kernels in Python. Use torch.compile(model) (addnorm's ops trace into the graph with "
            "no break) or torch.jit.trace(model, example_inputs)"
        )


class _Norm(_NotScriptable):
    """What addnorm's LayerNorm and RMSNorm add to torch's: ``backend`` and the zero-centred
    weight (``1 + weight``, the weight starting at 0). The class default serves torch norms that
    :func:`addnorm.patch` re-classes without running ``__init__``."""

    zero_centered_weight = False

    def _setup(self, zero_centered_weight: bool, backend: str) -> None:
        self.zero_centered_weight = checks.check_flag("zero_centered_weight", zero_centered_weight)
        if zero_centered_weight:
            if self.weight is None:
                raise ValueError("zero_centered_weight=True scales by 1 + weight: it needs elementwise_affine=True")
            self.reset_parameters()
        self.backend = checks.check_backend(backend)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.zero_centered_weight:
            nn.init.zeros_(self.weight)

    def extra_repr(self) -> str:
        """torch's (the backend changes no result beyond the last bits), plus a zero-centred
        weight, which must not look like a plain one: the same checkpoint scales differently."""
        return super().extra_repr() + (", zero_centered_weight=True" if self.zero_centered_weight else "")


class LayerNorm(_Norm, nn.LayerNorm):
    r"""Layer Normalization over the trailing ``normalized_shape`` dims.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta

    Mean and (biased) variance are computed in float32 (float64 for float64 input).

    Args:
        normalized_shape: int or trailing shape to normalize over.
        eps: added to the variance inside the square root. Default: 1e-5.
        elementwise_affine: learnable ``weight`` (γ, init 1) and ``bias`` (β, init 0).
        bias: with ``elementwise_affine``, whether to learn ``bias``. Default: True.
        zero_centered_weight: scale by ``1 + weight`` (``weight`` then starts at 0), so that
            weight decay pulls the scale toward 1 (keyword only).
        backend: ``"auto"``, ``"reference"`` or a kernel backend (keyword only).

    Shape:
        Input ``(*, *normalized_shape)``; output the same shape and dtype.

    Example::

        >>> ln = addnorm.LayerNorm(768)
        >>> y = ln(torch.randn(4, 16, 768))
    """

    def __init__(
        self,
        normalized_shape: Shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        zero_centered_weight: bool = False,
        backend: str = "auto",
    ) -> None:
        shape = checks.normalize_shape(normalized_shape)  # (a clear error: torch's names no argument)
        super().__init__(shape, eps, elementwise_affine, bias, device, dtype)
        self._setup(zero_centered_weight, backend)

    def forward(self, input: Tensor) -> Tensor:  # (torch's name: LayerNorm(input=x) works as there)
        return F.layer_norm(
            input,
            self.normalized_shape,
            self.weight,
            self.bias,
            self.eps,
            zero_centered_weight=self.zero_centered_weight,
            backend=self.backend,
        )


class RMSNorm(_Norm, nn.RMSNorm):
    r"""Root Mean Square Normalization over the trailing ``normalized_shape`` dims.

    .. math::
        y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \cdot \gamma

    ``eps=None`` uses the machine epsilon of the compute dtype (float32's unless the input
    is float64), as :class:`torch.nn.RMSNorm`.
    Statistics are computed in float32 (float64 for float64 input).

    Args and Shape: as :class:`torch.nn.RMSNorm`, plus ``zero_centered_weight`` (as
    :class:`LayerNorm`: Gemma's ``1 + weight``) and ``backend`` (keyword only).
    """

    def __init__(
        self,
        normalized_shape: Shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        *,
        zero_centered_weight: bool = False,
        backend: str = "auto",
    ) -> None:
        shape = checks.normalize_shape(normalized_shape)
        super().__init__(shape, eps, elementwise_affine, device, dtype)
        self._setup(zero_centered_weight, backend)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(
            x,
            self.normalized_shape,
            self.weight,
            self.eps,
            zero_centered_weight=self.zero_centered_weight,
            backend=self.backend,
        )


class AddNorm(_NotScriptable, nn.Module):
    r"""The residual add fused with the norm: one "Add & Norm" step of a Transformer.

    ``forward(x, residual)`` computes ``s = x + residual`` and

    - post-norm (``prenorm=False``, the original Transformer): returns ``norm(s)``, i.e.
      ``LN(residual + sublayer(residual))`` when ``x = sublayer(residual)``;
    - pre-norm (``prenorm=True``, GPT-2): returns ``(norm(s), s)``; ``s`` is the new
      residual stream and ``norm(s)`` the input of the next sublayer.

    Args:
        normalized_shape: int or trailing shape to normalize over.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm).
        prenorm: return the stream too, as above.
        eps: default 1e-5 for ``"layer"``, the compute dtype's machine epsilon for ``"rms"``.
        elementwise_affine, bias, device, dtype: as :class:`torch.nn.LayerNorm`
            (``bias`` is ignored by ``"rms"``, which has none).
        residual_dtype: dtype of ``s`` (e.g. ``torch.float32`` under bf16).
        dropout: residual dropout of the sublayer output ``x`` (the original Transformer's
            P_drop = 0.1), fused into the add, applied in ``train()`` mode only, as
            :class:`torch.nn.Dropout`; ``generator``: where its seeds come from (torch's default
            generator when None).
        layer_scale: a learnable per-feature scale of ``x`` before the add (CaiT, DeiT III),
            initialised to ``layer_scale_init``.
        zero_centered_weight: the norm scales by ``1 + weight`` (see :class:`LayerNorm`).
        backend: ``"auto"``, ``"reference"`` or a kernel backend.

    ``forward(x, residual, rowscale=None)``: ``rowscale``, one factor per row of ``x``'s
    leading dims, scales the sublayer output too (drop path / stochastic depth), so that
    ``s = residual + rowscale * layer_scale * dropout(x)``.

    The norm's parameters live in ``self.norm`` (an addnorm :class:`LayerNorm` or
    :class:`RMSNorm`), so ``state_dict`` keys are ``norm.weight`` and ``norm.bias`` (and
    ``layer_scale``).
    """

    def __init__(
        self,
        normalized_shape: Shape,
        *,
        norm: str = "layer",
        prenorm: bool = False,
        eps: float | None = None,
        elementwise_affine: bool = True,
        bias: bool = True,
        residual_dtype: torch.dtype | None = None,
        dropout: float = 0.0,
        generator: torch.Generator | None = None,
        layer_scale: bool = False,
        layer_scale_init: float = 1e-5,
        zero_centered_weight: bool = False,
        device=None,
        dtype=None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        common = dict(zero_centered_weight=zero_centered_weight, backend=backend)
        if norm == "layer":
            self.norm: LayerNorm | RMSNorm = LayerNorm(
                normalized_shape, 1e-5 if eps is None else eps, elementwise_affine, bias, device, dtype, **common
            )
        elif norm == "rms":
            self.norm = RMSNorm(normalized_shape, eps, elementwise_affine, device, dtype, **common)
        else:
            raise ValueError(f"norm must be 'layer' or 'rms', got {norm!r}")
        self.kind = norm
        self.prenorm = checks.check_flag("prenorm", prenorm)
        self.residual_dtype = checks.check_residual_dtype(residual_dtype)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
            raise ValueError(f"dropout must be a probability in [0, 1], got {dropout!r}")
        self.dropout = float(dropout)
        self.generator = generator
        self.layer_scale, self.layer_scale_init = None, float(layer_scale_init)
        if checks.check_flag("layer_scale", layer_scale):
            shape = self.norm.normalized_shape
            self.layer_scale = nn.Parameter(torch.full(shape, self.layer_scale_init, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """The parameters as made: the norm's, and the layer scale at ``layer_scale_init``. A
        model made on the meta device calls it after ``to_empty`` (FSDP2's way to build a large
        model), module by module."""
        self.norm.reset_parameters()
        if self.layer_scale is not None:
            with torch.no_grad():
                self.layer_scale.fill_(self.layer_scale_init)

    def forward(
        self, x: Tensor, residual: Tensor | None = None, rowscale: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        n = self.norm
        common = dict(
            prenorm=self.prenorm,
            residual_dtype=self.residual_dtype,
            dropout_p=self.dropout if self.training else 0.0,
            generator=self.generator,
            layer_scale=self.layer_scale,
            rowscale=rowscale,
            zero_centered_weight=n.zero_centered_weight,
            backend=n.backend,
        )
        if self.kind == "layer":
            return F.add_layer_norm(x, residual, n.normalized_shape, n.weight, n.bias, n.eps, **common)
        return F.add_rms_norm(x, residual, n.normalized_shape, n.weight, n.eps, **common)

    def extra_repr(self) -> str:
        extra = f", dropout={self.dropout}" if self.dropout else ""
        extra += ", layer_scale=True" if self.layer_scale is not None else ""
        return f"norm={self.kind!r}, prenorm={self.prenorm}, residual_dtype={self.residual_dtype}{extra}"
