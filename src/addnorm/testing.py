"""The conformance check every backend passes: :func:`check_backend`.

A backend written against :mod:`addnorm.backend`'s checklist runs it on its own device::

    import addnorm.backend, addnorm.testing
    addnorm.backend.register("mine", "my_package.my_backend")
    addnorm.testing.check_backend("mine", device="xpu")

It calls the backend's ``forward`` and ``backward`` directly and compares them with an
independent float64 oracle (torch's own ops and autograd), on the rows that break naive code
and on calls as addnorm makes them (leading dims, strides, eps, ``residual_dtype``, the stream
recomputed from ``(x, residual)``, every result's dtype); it checks batch invariance, the
dropout keep mask bit for bit, zero rows and bad input, an optional ``plain_forward`` against
``forward``, and a backend declaring
``Capabilities.second_norm`` its second norm (parallel blocks) against the same oracle, and one
declaring ``Capabilities.adds_x1`` its ``x1`` against the same forward on the summed residual;
it raises ``AssertionError`` saying what failed. The package's own backends pass it in the test
suite (``tests/test_backend_contract.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import Tensor

from . import backend as backends
from . import reference

# (rtol, atol) of a backend's result against the float64 oracle, from the inputs rounded to the
# dtype: what the dtype's own rounding of an exact result allows, and some room for the order of
# summation. Parameter gradients (sums over rows) get ``sqrt(rows)`` times more.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-6, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPES = tuple(TOLERANCES)


# --------------------------------------------------------------------------- the oracle


def _oracle(s, weight, bias, dy, dstream, eps, rms):
    """``(y, mean, rstd, (ds, dweight, dbias))`` of the norm of the rows ``s`` (the stream as the
    backend rounds it), in float64 from torch ops and autograd: the gradients of
    ``(y * dy).sum() + (s * dstream).sum()`` (None where there is no such parameter)."""
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in (s, weight, bias)]
    s64, w64, b64 = leaves
    # each row times a power of two k (exact) so that no square overflows, even in float64;
    # eps scaled by k**2 with it: y, and the gradients through it, are those of the unscaled row
    with torch.no_grad():
        _, e = torch.frexp(s64.abs().amax(dim=-1, keepdim=True))
        k = torch.ldexp(torch.ones_like(s64[:, :1]), -e.clamp(min=0))
    sk = s64 * k
    mean_k = None if rms else sk.mean(-1, keepdim=True)
    centred = sk if rms else sk - mean_k
    rstd_k = torch.rsqrt((centred * centred).mean(-1, keepdim=True) + eps * k * k)
    y = centred * rstd_k
    y = y if w64 is None else y * w64
    y = y if b64 is None else y + b64
    loss = (y * dy.double()).sum()
    if dstream is not None:
        loss = loss + (s64 * dstream.double()).sum()
    present = [t for t in leaves if t is not None]
    it = iter(torch.autograd.grad(loss, present))
    grads = tuple(None if t is None else next(it) for t in leaves)
    mean = None if rms else (mean_k / k)[:, 0].detach()
    return y.detach(), mean, (rstd_k * k)[:, 0].detach(), grads


class _Failures:
    """Collects what failed, so that one run reports every failing case at once."""

    def __init__(self, name: str):
        self.name, self.lines = name, []

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.lines.append(what)

    def close(self, got: Tensor | None, want: Tensor | None, what: str, dtype: torch.dtype, scale: float = 1.0):
        if want is None or got is None:
            self.check(got is None and want is None, f"{what}: expected {_present(want)}, got {_present(got)}")
            return
        if tuple(got.shape) != tuple(want.shape):
            self.lines.append(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            return
        rtol, atol = TOLERANCES[dtype]
        err = (got.double() - want).abs()
        allowed = scale * atol + rtol * want.abs()
        bad = ~(err <= allowed)  # NaN fails too
        if bool(bad.any()):
            i = int(bad.flatten().nonzero()[0])
            self.lines.append(
                f"{what}: {int(bad.sum())} of {err.numel()} elements off; e.g. flat index {i}: "
                f"{got.flatten()[i].item():.8g}, expected {want.flatten()[i].item():.8g}"
            )

    def same_bits(self, got: Tensor | None, want: Tensor | None, what: str) -> None:
        same = got is None and want is None
        if got is not None and want is not None:
            same = got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
            if not same and got.is_floating_point():
                both_nan = got.isnan() & want.isnan()
                same = got.shape == want.shape and bool(((got == want) | both_nan).all())
        self.check(same, f"{what}: not bitwise equal")

    def raise_if_any(self) -> None:
        if self.lines:
            head = f"backend {self.name!r} failed {len(self.lines)} check(s):"
            raise AssertionError("\n  ".join([head, *self.lines[:40]]))


def _present(t: Tensor | None) -> str:
    return "None" if t is None else f"a tensor of shape {tuple(t.shape)}"


# --------------------------------------------------------------------------- the rows


def _rows(kind: str, m: int, n: int, dtype: torch.dtype, g: torch.Generator, device) -> Tensor:
    """Rows that break naive code: far from zero (E[x²] − E[x]² cancels), constant (a mean off by
    its rounding leaves a nonzero output), near the top of the dtype's range (squares overflow)."""
    base = torch.randn(m, n, generator=g, dtype=torch.float64)
    if kind == "offset":
        base = base + (1e4 if dtype in (torch.float32, torch.float64) else 3e2)
    elif kind == "constant":
        base = torch.full((m, n), 3.7, dtype=torch.float64)
    elif kind == "huge":
        base = base * (torch.finfo(dtype).max / 8 if dtype != torch.float16 else 6e3)
    return base.to(dtype).to(device)


_CASES = (  # (rows kind, M, N)
    ("normal", 37, 256),
    ("normal", 5, 1),
    ("normal", 3, 3),
    ("offset", 9, 1000),
    ("constant", 4, 64),
    ("huge", 6, 128),
    ("normal", 3, 33000),  # past torch's reduction grain: wide rows summed in fixed chunks
)


def _param(n, dtype, g, device, shift=0.0):
    return (torch.randn(n, generator=g, dtype=torch.float64) * 0.5 + 1 + shift).to(dtype).to(device)


def _inputs(kind, m, n, dtype, g, device, residual: bool):
    x = _rows(kind, m, n, dtype, g, device)
    r = _rows("normal", m, n, dtype, g, device) if residual and kind != "constant" else None
    if residual and kind == "constant":
        r = torch.zeros_like(x)
    return x, r, _param(n, dtype, g, device), _param(n, dtype, g, device, shift=-1)


# --------------------------------------------------------------------------- the checks


def _label(dtype, kind, m, n, rms, residual) -> str:
    return f"{dtype} {kind} {m}x{n} {'rms' if rms else 'layer'}{' +residual' if residual else ''}"


def _forward_backward(f, impl, dtype, kind, m, n, rms, residual, device, g):
    x, r, w, b = _inputs(kind, m, n, dtype, g, device, residual)
    if rms:
        b = None
    dy = torch.randn(m, n, generator=g).to(dtype).to(device)
    dstream = torch.randn(m, n, generator=g).to(dtype).to(device) if residual else None
    eps = 1e-5
    case = _label(dtype, kind, m, n, rms, residual)
    y, s, mean, rstd = impl.forward(x, r, w, b, eps=eps, rms=rms, residual_dtype=None)
    stream = reference.stream(x, r, None)  # x + residual, rounded to the stream dtype as torch adds
    oy, omean, orstd, (gs, gw, gb) = _oracle(stream, w, b, dy, dstream, eps, rms)
    f.check(y.dtype == dtype, f"{case}: y is {y.dtype}, expected {dtype}")
    cd = reference.stats_dtype(dtype)
    f.check(rstd is not None and rstd.dtype == cd, f"{case}: rstd is not {cd}")
    f.close(y, oy, f"{case}: forward y", dtype)
    if residual:
        f.same_bits(s, stream, f"{case}: forward s = x + residual")
    if not rms:  # the mean's error is relative to the row's values
        f.close(mean, omean, f"{case}: mean", cd, scale=max(1.0, float(stream.abs().max())))
    if rstd is not None:  # relative: a huge row's rstd is tiny
        f.close(rstd.double() / orstd, torch.ones_like(orstd), f"{case}: rstd (relative)", cd)
    s_parts = (s,) if residual else (x,)
    grads = impl.backward(dy, dstream, s_parts, w, mean, rstd, rms=rms, has_bias=b is not None)
    rows_scale = math.sqrt(m)
    f.check(grads.ds.dtype == dtype, f"{case}: backward ds is {grads.ds.dtype}, expected {dtype}")
    f.close(grads.ds, gs, f"{case}: backward ds", dtype)
    f.close(grads.dweight, gw, f"{case}: backward dweight", cd, scale=rows_scale)
    f.close(grads.dbias, gb, f"{case}: backward dbias", cd, scale=rows_scale)


def _calls_as_addnorm_makes_them(f, impl, dtype, device, g):
    """What addnorm's calls hand a backend besides contiguous 2-D rows at eps 1e-5: leading dims
    of any number, any strides (a transposed activation, a gradient expanded over the rows),
    another eps, a stream dtype of its own (``residual_dtype=float32`` under 16-bit inputs, and
    ``bfloat16`` under wider ones, whose inputs are each rounded to it before they are added),
    and, for a stream dtype it ``recomputes_stream`` for, post-norm's saved ``(x, residual)``:
    each result against the oracle, in its dtype and shape."""
    n, eps = 64, 0.1  # rows of variance about 0.01: eps weighs
    widest = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    strided = lambda: (torch.randn(n, 6, generator=g) * 0.1).to(dtype).to(device).t().unflatten(0, (2, 3))  # noqa: E731
    x, r, dstream = strided(), strided(), strided()
    dy = torch.randn(n, generator=g).to(dtype).to(device).expand(2, 3, n)  # stride 0 over the rows
    narrower = (torch.bfloat16,) if dtype is torch.float32 else ()  # (16-bit inputs: a stream of float32)
    for sd in (widest, *narrower):
        residual_dtype = None if sd is dtype else sd
        cd = reference.stats_dtype(sd)
        for rms in (False, True):
            w, b = _param(n, dtype, g, device), None if rms else _param(n, dtype, g, device, shift=-1)
            case = (
                f"{dtype} {'rms' if rms else 'layer'} (2, 3, {n}) strided, eps={eps}, residual_dtype={residual_dtype}"
            )
            y, s, mean, rstd = impl.forward(x, r, w, b, eps=eps, rms=rms, residual_dtype=residual_dtype)
            stream = reference.stream(x, r, residual_dtype)
            oy, omean, orstd, (gs, gw, gb) = _oracle(stream.reshape(-1, n), w, b, dy.reshape(-1, n), None, eps, rms)
            f.check(y.shape == x.shape and y.dtype == dtype, f"{case}: y is {y.dtype} {tuple(y.shape)}")
            f.close(y.reshape(-1, n), oy, f"{case}: forward y", dtype)
            f.same_bits(s, stream, f"{case}: forward s = x.to({sd}) + residual.to({sd})")
            for got, want, what in ((mean, omean, "mean"), (rstd, orstd, "rstd")):
                if want is not None and got is not None:
                    f.check(got.dtype == cd and got.shape == (6,), f"{case}: {what} is {got.dtype} {tuple(got.shape)}")
                    f.close(got, want, f"{case}: {what}", cd, scale=1 / float(orstd.min()) if what == "mean" else 1.0)
            saved = [(s,)]
            if sd in impl.CAPABILITIES.recomputes_stream and residual_dtype is None:
                saved.append((x, r))
            for parts in saved:
                grads = impl.backward(dy, None, parts, w, mean, rstd, rms=rms, has_bias=b is not None)
                what = f"{case}: backward from {'(x, residual)' if len(parts) == 2 else '(s,)'}"
                ok = grads.ds.shape == x.shape and grads.ds.dtype == sd
                f.check(ok, f"{what}: ds is {grads.ds.dtype} {tuple(grads.ds.shape)}, expected {sd} {tuple(x.shape)}")
                f.close(grads.ds.reshape(-1, n), gs, f"{what}: ds", sd)
                for got, want, name in ((grads.dweight, gw, "dweight"), (grads.dbias, gb, "dbias")):
                    f.check(
                        got is None or got.dtype == cd,
                        f"{what}: {name} is {getattr(got, 'dtype', None)}, expected {cd}",
                    )
                    f.close(got, want, f"{what}: {name}", cd, scale=math.sqrt(6))
        # a stream gradient (pre-norm) that is strided too
        y, s, mean, rstd = impl.forward(x, r, w, b, eps=eps, rms=True, residual_dtype=residual_dtype)
        _, _, _, (gs, _, _) = _oracle(s.reshape(-1, n), w, None, dy.reshape(-1, n), dstream.reshape(-1, n), eps, True)
        grads = impl.backward(dy, dstream, (s,), w, mean, rstd, rms=True, has_bias=False)
        f.close(
            grads.ds.reshape(-1, n), gs, f"{dtype} rms strided, stream {sd}: backward ds with a strided dstream", sd
        )


def _batch_invariance(f, impl, dtype, device, g):
    n, m = 1024, 160  # above the CPU kernels' threading threshold
    x, r, w, b = _inputs("offset", m, n, dtype, g, device, residual=True)
    dy = torch.randn(m, n, generator=g).to(dtype).to(device)
    for rms in (False, True):
        bb = None if rms else b
        full = impl.forward(x, r, w, bb, eps=1e-5, rms=rms, residual_dtype=None)
        gfull = impl.backward(dy, None, (full[1],), w, full[2], full[3], rms=rms, has_bias=bb is not None)
        for i in (0, m // 2, m - 1):
            one = impl.forward(x[i : i + 1], r[i : i + 1], w, bb, eps=1e-5, rms=rms, residual_dtype=None)
            what = f"{dtype} {'rms' if rms else 'layer'} row {i} of {m}"
            for label, a, c in zip(("y", "s", "mean", "rstd"), full, one):
                f.same_bits(None if a is None else a[i : i + 1], c, f"{what}: forward {label} alone vs in the batch")
            gone = impl.backward(dy[i : i + 1], None, (one[1],), w, one[2], one[3], rms=rms, has_bias=bb is not None)
            f.same_bits(gfull.ds[i : i + 1], gone.ds, f"{what}: backward ds alone vs in the batch")


def _dropout_bits(f, impl, device, g):
    m, n, p = 33, 200, 0.3
    x = (torch.rand(m, n, generator=g) + 0.5).to(device)  # no zeros: a zero in s is a dropped element
    r = torch.zeros(m, n, device=device)
    seed = torch.tensor(0x1234_5678_9ABC, dtype=torch.int64, device=device)
    branch = backends.Branch(p, seed, None, None)
    y, s, mean, rstd = impl.forward(x, r, None, None, eps=1e-5, rms=False, residual_dtype=None, branch=branch)
    keep = reference.keep_mask(seed, torch.arange(m, device=device), n, p)
    f.same_bits(s != 0, keep, "dropout: the kept elements are reference.keep_mask's")
    f.same_bits(s, reference.stream(x, r, None, branch), "dropout: s is reference.stream's, bit for bit")
    # the branch's backward against the oracle, with a layer scale and a rowscale
    ls, rs = _param(n, torch.float32, g, device), (torch.rand(m, generator=g) + 0.5).to(device)
    branch = backends.Branch(p, seed, ls, rs)
    xr = torch.randn(m, n, generator=g).to(device)
    w = _param(n, torch.float32, g, device)
    y, s, mean, rstd = impl.forward(xr, r, w, None, eps=1e-5, rms=True, residual_dtype=None, branch=branch)
    dy = torch.randn(m, n, generator=g).to(device)
    oy, _, _, (gs, gw, _) = _oracle(s, w, None, dy, None, 1e-5, True)
    f.close(y, oy, "branch: forward y", torch.float32)
    grads = impl.backward(dy, None, (xr, r), w, mean, rstd, rms=True, has_bias=False, branch=branch)
    f.close(grads.ds, gs, "branch: backward ds", torch.float32)
    factor = keep.double() / (1 - p) * rs.double()[:, None]  # d s / d x, without the layer scale
    f.close(grads.dx, gs * factor * ls.double(), "branch: backward dx", torch.float32)
    dls = (gs * xr.double() * factor).sum(0)
    f.close(grads.dlayer_scale, dls, "branch: backward dlayer_scale", torch.float32, scale=math.sqrt(m))
    f.close(grads.dweight, gw, "branch: backward dweight", torch.float32, scale=math.sqrt(m))
    f.same_bits(s, reference.stream(xr, r, None, branch), "branch: s is reference.stream's, bit for bit")


def _second_norm(f, impl, dtype, device, g):
    """A backend with ``Capabilities.second_norm``: ``y1`` is the norm of the same stream with
    ``weight1``/``bias1``, and the backward with ``second=`` gives the gradients of both norms
    (``ds`` their sum: each is linear in its incoming gradient)."""
    m, n = 160, 1024  # above the CPU kernels' threading threshold: several blocks
    for rms in (False, True):
        x, r, w, b = _inputs("offset", m, n, dtype, g, device, residual=True)
        w1, b1 = _param(n, dtype, g, device, shift=0.5), _param(n, dtype, g, device)
        b, b1 = (None, None) if rms else (b, b1)
        dy, dy1 = (torch.randn(m, n, generator=g).to(dtype).to(device) for _ in range(2))
        case = f"second norm: {dtype} {'rms' if rms else 'layer'}"
        y, s, mean, rstd, y1 = impl.forward(x, r, w, b, eps=1e-5, rms=rms, residual_dtype=None, second=(w1, b1))
        oy, _, _, (gs, gw, gb) = _oracle(s, w, b, dy, None, 1e-5, rms)
        oy1, _, _, (gs1, gw1, gb1) = _oracle(s, w1, b1, dy1, None, 1e-5, rms)
        f.close(y, oy, f"{case}: forward y", dtype)
        f.close(y1, oy1, f"{case}: forward y1", dtype)
        f.same_bits(s, reference.stream(x, r, None), f"{case}: forward s = x + residual")
        grads = impl.backward(
            dy, None, (s,), w, mean, rstd, rms=rms, has_bias=b is not None, second=(dy1, w1, b1 is not None)
        )
        cd, rows_scale = reference.stats_dtype(dtype), math.sqrt(m)
        f.close(grads.ds, gs + gs1, f"{case}: backward ds", dtype)
        for got, want, what in (
            (grads.dweight, gw, "dweight"),
            (grads.dbias, gb, "dbias"),
            (grads.dweight1, gw1, "dweight1"),
            (grads.dbias1, gb1, "dbias1"),
        ):
            f.close(got, want, f"{case}: backward {what}", cd, scale=rows_scale)


def _adds_x1(f, impl, dtype, device, g):
    """A backend with ``Capabilities.adds_x1``: ``forward(x1=X1(x1, p, seed))`` gives the bits of
    the same forward on the residual ``residual + dropout(x1)`` summed as the reference does (the
    sum in the statistics dtype, rounded to the stream dtype), with and without dropout, through
    the branch and into a second norm (where declared)."""
    m, n = 160, 1024  # above the CPU kernels' threading threshold: several blocks
    x, r, w, b = _inputs("offset", m, n, dtype, g, device, residual=True)
    x1 = torch.randn(m, n, generator=g).to(dtype).to(device)
    seed = torch.tensor(20260127, dtype=torch.int64, device=device)
    second = {"second": (w.flip(0), b)} if impl.CAPABILITIES.second_norm else {}
    for p, branch in ((0.0, None), (0.25, None), (0.25, backends.Branch(0.5, seed + 1, None, None))):
        case = f"x1: {dtype} dropout_p={p}{' through a branch' if branch else ''}"
        dropout = None if p == 0 else backends.Branch(p, seed, None, None)
        summed = reference.stream(x1, r, None, dropout)  # residual + dropout(x1), rounded once
        kw = dict(eps=1e-5, rms=False, residual_dtype=None, branch=branch, **second)
        want = impl.forward(x, summed, w, b, **kw)
        got = impl.forward(x, r, w, b, x1=backends.X1(x1, p, seed if p else None), **kw)
        for ours, theirs, what in zip(got, want, ("y", "s", "mean", "rstd", "y1")):
            f.same_bits(ours, theirs, f"{case}: forward {what}")


def _plain_forward(f, impl, dtype, device, g):
    """A backend's optional ``plain_forward`` (:mod:`addnorm.shortcut`): the bits of ``forward``
    on the same call, or None (declined), on one row and a few, the rows that break naive code,
    with and without a residual, weight and bias, LayerNorm and RMSNorm, the stream written or
    not, leading dims and strided rows."""
    for kind, m, n in (("normal", 1, 768), ("normal", 8, 768), ("offset", 16, 1000), ("constant", 4, 64)):
        x, r, w, b = _inputs(kind, m, n, dtype, g, device, residual=True)
        calls = (  # (x, residual, weight, bias, rms, write_stream)
            (x, r, w, b, False, True),
            (x, r, w, None, True, False),
            (x, None, None, None, False, False),
            (x.unsqueeze(0), r.unsqueeze(0), w, b, True, True),
            (x.t().contiguous().t(), r, w, b, False, True),
        )
        for x_, r_, w_, b_, rms, write_stream in calls:
            got = impl.plain_forward(x_, r_, w_, b_, 1e-5, rms, write_stream)
            if got is None:  # declined: the general route takes the call
                continue
            kw = dict(eps=1e-5, rms=rms, residual_dtype=None, write_stream=write_stream, write_stats=False)
            y, s, _, _ = impl.forward(x_, r_, w_, b_, **kw)
            case = f"plain_forward: {dtype} {kind} {tuple(x_.shape)} rms={rms} residual={r_ is not None}"
            f.same_bits(got[0], y, f"{case}: y")
            if write_stream and r_ is not None:
                f.same_bits(got[1], s, f"{case}: s")
            else:
                f.check(got[1] is None, f"{case}: s must be None unless the stream is written")


def _zero_rows_and_buffers(f, impl, device):
    n = 16
    x, w, b = torch.empty(0, n, device=device), torch.ones(n, device=device), torch.zeros(n, device=device)
    y, s, mean, rstd = impl.forward(x, x, w, b, eps=1e-5, rms=False, residual_dtype=None)
    f.check(y.shape == (0, n) and rstd.shape == (0,), "zero rows: forward shapes")
    grads = impl.backward(x, None, (x,), w, mean, rstd, rms=False, has_bias=True)
    f.check(grads.ds.shape == (0, n), "zero rows: backward ds shape")
    zero = torch.zeros(n, device=device)
    f.check(grads.dweight is not None and torch.equal(grads.dweight, zero), "zero rows: dweight must be zeros")
    f.check(grads.dbias is not None and torch.equal(grads.dbias, zero), "zero rows: dbias must be zeros")
    x, r = torch.randn(4, n, device=device), torch.randn(4, n, device=device)
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    y, s, _, _ = impl.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None, out=out, residual_out=residual_out)
    f.check(y is out and s is residual_out, "out=/residual_out=: the results are the buffers themselves")
    _, _, mean, rstd = impl.forward(x, None, w, b, eps=1e-5, rms=False, residual_dtype=None)
    grads = impl.backward(x, None, (x,), w, mean, rstd, rms=False, has_bias=True, param_dtype=torch.bfloat16)
    f.check(grads.dweight.dtype == torch.bfloat16, "param_dtype=bfloat16: dweight in bfloat16")


def _bad_input(f, impl, device):
    x = torch.randn(4, 8, device=device)
    _, _, mean, rstd = impl.forward(x, None, None, None, eps=1e-5, rms=False, residual_dtype=None)
    for parts, what in (((x, x[:2]), "of two shapes"), ((x, x, x), "of three tensors")):
        try:
            impl.backward(x, None, parts, None, mean, rstd, rms=False, has_bias=False)
        except ValueError:
            continue
        f.lines.append(f"bad input: backward took s_parts {what} without a ValueError")


def check_backend(
    name: str, *, device: str | torch.device | None = None, dtypes: Iterable[torch.dtype] = DTYPES
) -> None:
    """Run the conformance check on backend ``name`` with tensors on ``device`` (the first of its
    declared device types, else the CPU); ``AssertionError`` listing every check that failed."""
    try:
        impl = backends.load(name)
    except KeyError:
        raise AssertionError(f"backend {name!r} is not registered ({backends.names()})") from None
    except TypeError as err:
        raise AssertionError(str(err)) from None
    except ImportError as err:  # a registered path that does not import
        raise AssertionError(f"backend {name!r} could not be imported: {err}") from None
    if device is None:
        declared = impl.CAPABILITIES.device_types
        device = declared[0] if declared else "cpu"
    device = torch.device(device)
    reason = backends.unavailable_reason(name, torch.empty(1, 4, device=device))
    if reason is not None:
        raise AssertionError(f"backend {name!r} cannot run on {device}: {reason}")
    f = _Failures(name)
    g = torch.Generator().manual_seed(0)
    steps: list[tuple[str, Callable[[], None]]] = []
    for dtype in dtypes:
        for kind, m, n in _CASES:
            for rms in (False, True):
                for residual in (False, True):
                    case = _label(dtype, kind, m, n, rms, residual)
                    steps.append(
                        (case, partial(_forward_backward, f, impl, dtype, kind, m, n, rms, residual, device, g))
                    )
        steps.append(
            (f"{dtype} calls as addnorm makes them", partial(_calls_as_addnorm_makes_them, f, impl, dtype, device, g))
        )
        steps.append((f"{dtype} batch invariance", partial(_batch_invariance, f, impl, dtype, device, g)))
        if impl.CAPABILITIES.second_norm and dtype in (torch.float32, torch.bfloat16):  # direct and 16-bit rows
            steps.append((f"{dtype} second norm", partial(_second_norm, f, impl, dtype, device, g)))
        if impl.CAPABILITIES.adds_x1 and dtype in (torch.float32, torch.bfloat16):
            steps.append((f"{dtype} x1", partial(_adds_x1, f, impl, dtype, device, g)))
        if callable(getattr(impl, "plain_forward", None)):
            steps.append((f"{dtype} plain_forward", partial(_plain_forward, f, impl, dtype, device, g)))
    steps.append(("dropout", partial(_dropout_bits, f, impl, device, g)))
    steps.append(("zero rows and buffers", partial(_zero_rows_and_buffers, f, impl, device)))
    steps.append(("bad input", partial(_bad_input, f, impl, device)))
    for case, step in steps:
        try:
            step()
        except Exception as err:  # a crash is one more failed check, reported with the others
            f.lines.append(f"{case}: raised {type(err).__name__}: {err}")
    f.raise_if_any()
