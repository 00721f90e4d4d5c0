"""``addnorm explain``: its options, and what it prints for them."""

from __future__ import annotations

import math

import torch

from ..cli import UsageError
from . import show
from .compute import compare_batchnorm, steps
from .parse import MATRIX_HELP, check_precision, read_inputs
from .textbook import textbook_comparison

# the options of `addnorm explain` that --textbook does not take (it has its own rows)
TEXTBOOK_CONFLICTS = ("input", "normalized_shape", "eps", "gamma", "beta", "residual", "backward", "grad", "compare")


def run_textbook(args) -> int:
    """``addnorm explain --textbook``: :func:`textbook_comparison`, as tables or ``--json``."""
    given = [k for k in TEXTBOOK_CONFLICTS if getattr(args, k) is not None and getattr(args, k) is not False]
    extra = [f"--{k.replace('_', '-')}" for k in given] + (["--norm rms"] if args.norm != "layer" else [])
    if extra:
        raise UsageError(f"--textbook runs its own rows; drop {', '.join(extra)}")
    check_precision(args.precision)
    doc = textbook_comparison()
    if args.json:
        show.print_json(doc)
    else:
        show.print_textbook(doc, show.Printer(args.precision, (1,), (1,)))
    return 0


def run(args) -> int:
    if args.textbook:
        return run_textbook(args)
    inp = read_inputs(args)
    x, normalized_shape, eps = inp.x, inp.normalized_shape, inp.eps
    r = steps(
        x,
        normalized_shape,
        eps=eps,
        gamma=inp.gamma,
        beta=inp.beta,
        rms=inp.rms,
        residual=inp.residual,
        grad=inp.grad,
        backward=args.backward,
        dropout=args.dropout,
        seed=0 if args.seed is None else args.seed,
    )
    if eps == 0 and not torch.isfinite(r["rstd"]).all():  # (a constant row: what eps is there for)
        rows = [i for i, v in enumerate(r["rstd"].reshape(-1).tolist()) if not math.isfinite(v)]
        raise UsageError(
            f"--eps 0: row(s) {rows} are constant (all zero, for RMSNorm), so the variance + eps is 0 "
            "and x̂ would divide by zero; that is what eps prevents: give --eps > 0"
        )
    cmp = compare_batchnorm(r["x"], eps) if args.compare else None
    if args.json:
        doc = {
            "shape": list(x.shape),
            "normalized_shape": list(normalized_shape),
            "rows": r["x"].shape[0],
            "features": r["x"].shape[1],
            "norm": args.norm,
            "eps": eps,
            "dtype": str(x.dtype)[6:],
        }
        doc |= {k: v for k, v in r.items() if k not in ("backward",)}
        if args.backward:
            doc["backward"] = r["backward"]
        if cmp is not None:
            doc["compare_batchnorm"] = cmp
        show.print_json(doc)
        return 0
    pr = show.Printer(args.precision, tuple(x.shape[: -len(normalized_shape)]), normalized_shape)
    if cmp is not None:
        pr.matrix("input x", r["x"], tuple(x.shape))
        show.print_compare(cmp, eps, pr)
        for msg in r["warnings"]:
            pr.console.print(f"note: {msg}", style="yellow")
        return 0
    show.print_explanation(r, tuple(x.shape), normalized_shape, eps, inp.rms, pr)
    if args.backward:
        show.print_backward(r, tuple(x.shape), normalized_shape, inp.rms, inp.grad is not None, pr)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "explain",
        help="LayerNorm / RMSNorm / Add & Norm step by step, with shapes",
        description="Print every step of a norm with shapes: input, normalized dims, per-row mean, "
        "biased variance, std with eps, normalized values, gamma, beta, output; the effect "
        "of eps; the hand-derived backward (--backward); BatchNorm beside it (--compare). "
        "Default input: the worked example [[0.2,0.1,0.3],[0.5,0.1,0.1]].",
    )
    p.add_argument("--input", metavar="MATRIX|FILE", help=MATRIX_HELP + " (a literal is read in float64)")
    p.add_argument(
        "--normalized-shape",
        metavar="DIMS",
        help="trailing dims normalized together, e.g. 3 or 1,3 (default: the last dim)",
    )
    p.add_argument(
        "--eps",
        type=float,
        help="added to the variance inside the square root "
        "(default 1e-5; RMSNorm: the dtype's machine epsilon, as torch)",
    )
    p.add_argument("--gamma", metavar="VALUES", help="weight γ: one number, or one per feature (default 1)")
    p.add_argument("--beta", metavar="VALUES", help="bias β: one number, or one per feature (default 0)")
    p.add_argument("--norm", choices=["layer", "rms"], default="layer", help="LayerNorm (default) or RMSNorm")
    p.add_argument("--residual", metavar="MATRIX|FILE", help="Add & Norm: normalize s = input + residual")
    p.add_argument(
        "--dropout",
        metavar="P",
        type=float,
        default=0.0,
        help="with --residual: residual dropout of x before the add, as the original Transformer (P_drop 0.1)",
    )
    p.add_argument("--seed", metavar="S", type=int, help="the generator seed of --dropout's mask (default 0)")
    p.add_argument("--backward", action="store_true", help="the hand-derived backward beside autograd's")
    p.add_argument("--grad", metavar="MATRIX|FILE", help="upstream gradient for --backward (default: ones)")
    p.add_argument("--compare", choices=["batchnorm"], help="put BatchNorm beside LayerNorm")
    p.add_argument(
        "--textbook",
        action="store_true",
        help="the textbook form (addnorm.textbook) beside the exact one on rows where the textbook breaks",
    )
    p.add_argument("--json", action="store_true", help="print the same numbers as JSON (full precision)")
    p.add_argument("--precision", metavar="N", type=int, default=4, help="digits after the point in tables (default 4)")
    p.set_defaults(func=run)
