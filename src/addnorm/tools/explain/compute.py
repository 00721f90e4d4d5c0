"""The numbers ``addnorm explain`` prints: every step of the norm in float64, addnorm's and
torch's ops beside them, the hand-derived backward beside autograd's, and BatchNorm beside
LayerNorm. Each function returns plain tensors and numbers; :mod:`.show` prints them."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as TF
from torch import Tensor

from ... import backend, functional, ops, reference
from ...backend import Branch
from ...nn import LayerNorm


def _rows(t: Tensor, n: int) -> Tensor:
    return t.reshape(-1, n).to(torch.float64)


def maxdiff(a: Tensor, b: Tensor) -> float:
    """max |a − b|, in float64."""
    return (a.double() - b.double()).abs().max().item()


def steps(
    x: Tensor,
    normalized_shape: tuple[int, ...],
    *,
    eps: float,
    gamma: Tensor,
    beta: Tensor | None,
    rms: bool = False,
    residual: Tensor | None = None,
    grad: Tensor | None = None,
    backward: bool = False,
    dropout: float = 0.0,
    seed: int = 0,
) -> dict:
    """Every step of the norm of ``x`` over its trailing ``normalized_shape`` dims, as tensors.

    Values are (rows, features) float64 tensors, per-row statistics are ``(rows,)``. With
    ``dropout`` (and a residual), the sublayer output ``x`` is dropped before the add, with the
    keep mask addnorm's op draws from a generator seeded ``seed``.
    """
    n = math.prod(normalized_shape)
    x2 = _rows(x, n)
    r2 = _rows(residual, n) if residual is not None else None
    w = gamma.reshape(n)
    b = beta.reshape(n) if beta is not None else None
    branch = None
    if dropout:  # the seed the op below draws from torch.Generator().manual_seed(seed)
        branch = Branch(dropout, ops.draw_seed(torch.Generator().manual_seed(seed), x2.device), None, None)
    st = reference.forward_steps(x2, r2, w, b, eps, rms, None, branch)
    bare = reference.forward_steps(st["s"], None, None, None, 0.0, rms, None)
    out = {
        "x": x2,
        "residual": r2,
        "s": st["s"],
        "mean": st["mean"],
        "var": st["var"],
        "std": torch.sqrt(st["var"] + eps),
        "rstd": st["rstd"],
        "xhat": st["xhat"],
        "gamma": w,
        "beta": b,
        "y": st["y"],
        "std_no_eps": torch.sqrt(bare["var"]),
        "xhat_no_eps": bare["xhat"],
        "dropout": dropout,
    }
    if branch is not None:
        terms = reference.branch_terms(x2, branch, torch.arange(x2.shape[0]))
        out["keep"], out["dropped"] = terms["keep"], x2 * terms["gate"]
    out["check_mean"] = st["xhat"].mean(dim=-1)
    xh = st["xhat"]
    out["check_std"] = (xh * xh).mean(dim=-1).sqrt() if rms else xh.std(dim=-1, correction=0)

    # addnorm's op in the input's dtype, and torch's own op in float64, on the same input.
    dt = x.dtype
    xt = x.detach().clone().requires_grad_(backward)
    rt = residual.to(dt).detach().clone().requires_grad_(backward) if residual is not None else None
    wt = gamma.to(dt).detach().clone().requires_grad_(backward)  # a copy even when dt is already float64
    bt = beta.to(dt).detach().clone().requires_grad_(backward) if beta is not None else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rt is None:
            y_op = (
                functional.rms_norm(xt, normalized_shape, wt, eps)
                if rms
                else functional.layer_norm(xt, normalized_shape, wt, bt, eps)
            )
        else:
            drop = dict(dropout_p=dropout, generator=torch.Generator().manual_seed(seed)) if dropout else {}
            y_op = (
                functional.add_rms_norm(xt, rt, normalized_shape, wt, eps, **drop)
                if rms
                else functional.add_layer_norm(xt, rt, normalized_shape, wt, bt, eps, **drop)
            )
    out["warnings"] = [str(c.message) for c in caught]
    s64 = st["s"].reshape(x.shape).clone().requires_grad_(backward)
    w64 = gamma.clone().requires_grad_(backward)
    b64 = beta.clone().requires_grad_(backward) if beta is not None else None
    y_torch = (
        TF.rms_norm(s64, normalized_shape, w64, eps) if rms else TF.layer_norm(s64, normalized_shape, w64, b64, eps)
    )
    out["op_name"] = (
        f"addnorm.{'add_' if residual is not None else ''}{'rms' if rms else 'layer'}_norm"
        f" ({str(dt).removeprefix('torch.')}, backend auto: {backend.auto_name(x2)})"
    )
    out["torch_name"] = f"torch.nn.functional.{'rms' if rms else 'layer'}_norm (float64)"
    out["op_maxdiff"] = maxdiff(y_op.reshape(-1, n), st["y"])
    out["torch_maxdiff"] = maxdiff(y_torch.reshape(-1, n), st["y"])

    if backward:
        dy = _rows(grad, n) if grad is not None else torch.ones_like(x2)
        bs = reference.backward_steps(dy, None, st["s"], w, st["mean"], st["rstd"], rms=rms, has_bias=beta is not None)
        out["backward"] = dict(bs, dy=dy)
        y_torch.backward(dy.reshape(x.shape))
        y_op.backward(dy.reshape(x.shape).to(dt))
        auto = {
            "ds": s64.grad.reshape(-1, n),
            "dweight": w64.grad.reshape(n),
            "dbias": b64.grad.reshape(n) if b64 is not None else None,
        }
        out["backward"]["autograd"] = auto
        out["backward"]["autograd_maxdiff"] = {k: maxdiff(v, bs[k]) for k, v in auto.items() if v is not None}
        op_grads = {
            "ds": (rt if rt is not None else xt).grad.reshape(-1, n),  # x's is ds only without dropout
            "dweight": wt.grad.reshape(n),
            "dbias": bt.grad.reshape(n) if bt is not None else None,
        }
        out["backward"]["op_maxdiff"] = {k: maxdiff(v, bs[k]) for k, v in op_grads.items() if v is not None}
    return out


def _random_rows(like: Tensor, rows: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = like.std().item() if like.numel() > 1 else 1.0
    return torch.randn(rows, like.shape[1], generator=g, dtype=like.dtype) * (scale or 1.0) + like.mean()


def compare_batchnorm(x2: Tensor, eps: float) -> dict:
    """BatchNorm (per feature over the rows) beside LayerNorm (per row over the features).

    Row 0 is normalized inside batches that differ in their other rows or their size: its
    LayerNorm output never changes, its BatchNorm output does. Then train vs eval mode.
    """
    m, n = x2.shape
    ln = LayerNorm(n, eps=eps, dtype=torch.float64)
    bn = torch.nn.BatchNorm1d(n, eps=eps, dtype=torch.float64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few features: steps() reports it once
        ln_y, bn_y = ln(x2), bn(x2)  # bn is in training mode: batch statistics
        bn_mean, bn_var = x2.mean(dim=0), x2.var(dim=0, correction=0)
        variants = [("as given", x2)]
        if m > 1:
            variants.append(("other rows redrawn (seed 0)", torch.cat([x2[:1], _random_rows(x2, m - 1, 0)])))
        variants.append(("batch of 1: row 0 alone", x2[:1]))
        variants.append((f"batch of {m + 4}: 4 random rows added", torch.cat([x2, _random_rows(x2, 4, 1)])))
        rows = []
        for label, batch in variants:
            fresh = torch.nn.BatchNorm1d(n, eps=eps, dtype=torch.float64)
            try:
                bn_row0 = fresh(batch)[0]
                bn_error = None
            except ValueError as err:  # BatchNorm cannot normalize one value per feature
                bn_row0, bn_error = None, str(err)
            ln_row0 = ln(batch)[0]
            rows.append(
                {
                    "batch": label,
                    "batch_size": batch.shape[0],
                    "layernorm_row0": ln_row0,
                    "layernorm_change": maxdiff(ln_row0, ln_y[0]),
                    "batchnorm_row0": bn_row0,
                    "batchnorm_error": bn_error,
                    "batchnorm_change": None if bn_row0 is None else maxdiff(bn_row0, bn_y[0]),
                }
            )
        ln.eval()
        bn.eval()
        ln_eval, bn_eval = ln(x2), bn(x2)
    return {
        "x": x2,
        "layernorm": ln_y,
        "batchnorm": bn_y,
        "batch_mean": bn_mean,
        "batch_var": bn_var,
        "row0": rows,
        "layernorm_buffers": [name for name, _ in ln.named_buffers()],
        "batchnorm_buffers": {name: b for name, b in bn.named_buffers() if b.is_floating_point()},
        "batchnorm_momentum": bn.momentum,
        "layernorm_eval": ln_eval,
        "batchnorm_eval": bn_eval,
        "layernorm_train_eval_diff": maxdiff(ln_eval, ln_y),
        "batchnorm_train_eval_diff": maxdiff(bn_eval, bn_y),
    }
