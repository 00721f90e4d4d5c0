r"""A small encoder-decoder Transformer, written by hand on top of addnorm's Add & Norm.

Every sublayer (self-attention, cross-attention, feed-forward) sits on the residual stream
and is wrapped by one Add & Norm step, placed as ``norm_position`` says:

- ``"post"`` (the original Transformer, Vaswani et al. 2017)::

      x = Norm(x + sublayer(x))                  one add_*_norm(..., prenorm=False) call

- ``"pre"`` (GPT-2; Xiong et al. 2020)::

      x = x + sublayer(Norm(x))                  ... and the stack ends with a final Norm

  The add that closes sublayer ``i`` and the norm that opens sublayer ``i + 1`` (or the
  final norm) act on the same tensor, so they are one fused call that returns both::

      h = Norm_0(x)
      for i: h, x = add_*_norm(sublayer_i(h), x, Norm_{i+1}, prenorm=True)
      return h                                   # = FinalNorm(stream)

- ``"none"``: ``x = x + sublayer(x)``, no norm at all.

The norm of sublayer ``i`` (its parameters live in the ``AddNorm`` of that sublayer) is the
one applied to its output in post-norm and to its input in pre-norm. ``norm`` picks
LayerNorm (``"layer"``) or RMSNorm (``"rms"``).

Numeric inputs (e.g. 2-D points) are projected to ``d_model`` by a linear layer before the
positional encoding: normalizing 2 features would map every vector to ±1.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .nn import AddNorm

NORM_POSITIONS = ("post", "pre", "none")
NORMS = ("layer", "rms")
POSITIONALS = ("sinusoidal", "learned")

Sublayer = tuple[Callable[[Tensor], Tensor], AddNorm | None]


def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    r"""``pe[p, 2i] = sin(p / 10000^(2i/d))``, ``pe[p, 2i+1] = cos(p / 10000^(2i/d))``."""
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    angular_speed = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(position * angular_speed)
    pe[:, 1::2] = torch.cos(position * angular_speed)[:, : d_model // 2]
    return pe


class PositionalEncoding(nn.Module):
    r"""``x * sqrt(d_model) + pe[:L]`` for ``x`` of shape ``(N, L, d_model)``.

    ``kind="sinusoidal"``: the fixed table of :func:`sinusoidal_table` (a buffer);
    ``kind="learned"``: a trainable ``(max_len, d_model)`` table, initialised N(0, 0.02²).
    """

    def __init__(self, max_len: int, d_model: int, kind: str = "sinusoidal") -> None:
        super().__init__()
        _check_choice("positional", kind, POSITIONALS)
        self.d_model, self.kind = d_model, kind
        if kind == "sinusoidal":
            self.register_buffer("pe", sinusoidal_table(max_len, d_model))
        else:
            self.pe = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        if x.size(1) > self.pe.size(0):
            raise ValueError(f"sequence length {x.size(1)} exceeds max_len {self.pe.size(0)}")
        return x * math.sqrt(self.d_model) + self.pe[: x.size(1)]


class MultiHeadAttention(nn.Module):
    """Multi-head attention on top of :func:`torch.nn.functional.scaled_dot_product_attention`."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def _heads(self, t: Tensor) -> Tensor:  # (N, L, D) -> (N, H, L, D/H)
        n, length, d = t.shape
        return t.view(n, length, self.n_heads, d // self.n_heads).transpose(1, 2)

    def forward(self, query: Tensor, memory: Tensor, *, causal: bool = False) -> Tensor:
        k, v = self.kv(memory).chunk(2, dim=-1)
        o = F.scaled_dot_product_attention(self._heads(self.q(query)), self._heads(k), self._heads(v), is_causal=causal)
        return self.out(o.transpose(1, 2).reshape(query.shape))


class FeedForward(nn.Sequential):
    """Position-wise feed-forward: ``Linear(d_model, d_ff) -> ReLU -> Linear(d_ff, d_model)``."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))


def residual_stack(
    x: Tensor,
    sublayers: list[Sublayer],
    position: str,
    final: AddNorm | None = None,
    drop: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Run ``sublayers`` (pairs ``(fn, add_norm)``) on the residual stream ``x`` (see the module doc).

    In pre-norm, ``final`` is the norm after the last sublayer; without it the stream itself
    is returned (so a single layer can be run alone and composed with the next one). Residual
    dropout (Vaswani et al., section 5.4) is fused into each Add & Norm (its ``dropout``); the
    adds without one (no norm, a pre-norm layer run alone) apply ``drop``.
    """
    drop = drop or (lambda t: t)
    if position == "none":
        for fn, _ in sublayers:
            x = x + drop(fn(x))
        return x
    if position == "post":
        for fn, add_norm in sublayers:
            x = add_norm(fn(x), x)
        return x
    norms = [add_norm for _, add_norm in sublayers[1:]] + [final]
    h = sublayers[0][1].norm(x)
    for (fn, _), next_norm in zip(sublayers, norms, strict=True):
        if next_norm is None:
            return x + drop(fn(h))
        h, x = next_norm(fn(h), x)
    return h


class _Layer(nn.Module):
    def __init__(
        self, d_model: int, n_sublayers: int, norm_position: str, norm: str, backend: str, dropout: float
    ) -> None:
        super().__init__()
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        _check_choice("norm", norm, NORMS)
        self.norm_position = norm_position
        pre = norm_position == "pre"
        self.norms = nn.ModuleList(
            []
            if norm_position == "none"
            else [
                AddNorm(d_model, norm=norm, prenorm=pre, dropout=dropout, backend=backend) for _ in range(n_sublayers)
            ]
        )
        self.drop = nn.Dropout(dropout)  # for the adds that no AddNorm does (see residual_stack)

    def _norm(self, i: int) -> AddNorm | None:
        return self.norms[i] if len(self.norms) else None


class EncoderLayer(_Layer):
    """Self-attention, then feed-forward, each with its Add & Norm."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        *,
        norm_position: str = "post",
        norm: str = "layer",
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__(d_model, 2, norm_position, norm, backend, dropout)
        self.self_attn = MultiHeadAttention(d_model, n_heads)
        self.ffn = FeedForward(d_model, d_ff)

    def sublayers(self) -> list[Sublayer]:
        return [(lambda h: self.self_attn(h, h), self._norm(0)), (self.ffn, self._norm(1))]

    def forward(self, x: Tensor) -> Tensor:
        """One layer alone; in pre-norm this returns the (un-normalized) residual stream."""
        return residual_stack(x, self.sublayers(), self.norm_position, drop=self.drop)


class DecoderLayer(_Layer):
    """Causal self-attention, cross-attention to the encoder's output, feed-forward."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        *,
        norm_position: str = "post",
        norm: str = "layer",
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__(d_model, 3, norm_position, norm, backend, dropout)
        self.self_attn = MultiHeadAttention(d_model, n_heads)
        self.cross_attn = MultiHeadAttention(d_model, n_heads)
        self.ffn = FeedForward(d_model, d_ff)

    def sublayers(self, memory: Tensor) -> list[Sublayer]:
        return [
            (lambda h: self.self_attn(h, h, causal=True), self._norm(0)),
            (lambda h: self.cross_attn(h, memory), self._norm(1)),
            (self.ffn, self._norm(2)),
        ]

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        """One layer alone; in pre-norm this returns the (un-normalized) residual stream."""
        return residual_stack(x, self.sublayers(memory), self.norm_position, drop=self.drop)


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer for sequences of numeric feature vectors.

    ``forward(source, target_in)``: ``source`` ``(N, S, F)``, ``target_in`` ``(N, T, F)`` (the
    decoder's input: the last source point followed by the target shifted right, i.e. teacher
    forcing); returns the predictions ``(N, T, F)``, where output ``t`` depends on
    ``target_in[:, : t + 1]`` only (causal self-attention). :meth:`predict` runs the decoder
    autoregressively. In pre-norm, encoder and decoder stacks end with a final norm.
    Linear weights are initialised Xavier-uniform, as ``torch.nn.Transformer`` and Xiong et al.
    ``dropout``: residual dropout of every sublayer's output before its add (the original
    Transformer's P_drop = 0.1), fused into the Add & Norm call; active in ``train()`` only.
    """

    def __init__(
        self,
        n_features: int = 2,
        d_model: int = 32,
        n_heads: int = 4,
        d_ff: int = 64,
        n_encoder: int = 6,
        n_decoder: int = 6,
        *,
        norm_position: str = "post",
        norm: str = "layer",
        positional: str = "sinusoidal",
        max_len: int = 16,
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        layer = dict(norm_position=norm_position, norm=norm, dropout=dropout, backend=backend)
        self.norm_position = norm_position
        self.source_proj = nn.Linear(n_features, d_model)
        self.target_proj = nn.Linear(n_features, d_model)
        self.source_pe = PositionalEncoding(max_len, d_model, positional)
        self.target_pe = PositionalEncoding(max_len, d_model, positional)
        self.encoder = nn.ModuleList(EncoderLayer(d_model, n_heads, d_ff, **layer) for _ in range(n_encoder))
        self.decoder = nn.ModuleList(DecoderLayer(d_model, n_heads, d_ff, **layer) for _ in range(n_decoder))
        pre = norm_position == "pre"
        final = dict(norm=norm, prenorm=True, dropout=dropout, backend=backend)
        self.encoder_norm = AddNorm(d_model, **final) if pre else None
        self.decoder_norm = AddNorm(d_model, **final) if pre else None
        self.head = nn.Linear(d_model, n_features)
        self.drop = nn.Dropout(dropout)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)

    def encode(self, source: Tensor) -> Tensor:
        x = self.source_pe(self.source_proj(source))
        subs = [s for layer in self.encoder for s in layer.sublayers()]
        return residual_stack(x, subs, self.norm_position, self.encoder_norm, self.drop)

    def decode(self, target_in: Tensor, memory: Tensor) -> Tensor:
        x = self.target_pe(self.target_proj(target_in))
        subs = [s for layer in self.decoder for s in layer.sublayers(memory)]
        return self.head(residual_stack(x, subs, self.norm_position, self.decoder_norm, self.drop))

    def forward(self, source: Tensor, target_in: Tensor) -> Tensor:
        return self.decode(target_in, self.encode(source))

    @torch.no_grad()
    def predict(self, source: Tensor, n_steps: int) -> Tensor:
        """Autoregressive prediction of ``n_steps`` points, starting from the last source point."""
        memory = self.encode(source)
        inputs = source[:, -1:]
        for _ in range(n_steps):
            nxt = self.decode(inputs, memory)[:, -1:]
            inputs = torch.cat([inputs, nxt], dim=1)
        return inputs[:, 1:]


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
