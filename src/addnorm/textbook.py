"""LayerNorm and RMSNorm as a learner first writes them (the seed tutorials' class, llm.c's
``layernorm.py``): forward and hand-derived backward, in the input's dtype, with no guards.

Right on ordinary rows; wrong on some others. ``addnorm explain --textbook`` shows which, and
the step of :mod:`addnorm.reference` (the exact form every backend runs) that prevents each.
Shapes are the seeds': ``x`` is ``[S, B, E]``, normalized over the trailing dims of ``w``,
here ``[B, E]`` (any number of trailing dims works). The library never calls this module.
"""


def layer_norm_forward(x, w, b, eps=1e-5):  # x: [S, B, E]; w, b: [B, E]
    dims = [-(i + 1) for i in range(w.dim())]  # [-1, -2]: the dims of w
    mean = x.mean(dim=dims, keepdim=True)  # [S, 1, 1]
    var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)  # [S, 1, 1], biased (÷N)
    rstd = (var + eps) ** -0.5  # [S, 1, 1], 1 / std
    norm = (x - mean) * rstd  # [S, B, E]
    return w * norm + b, (x, w, mean, rstd)  # out: [S, B, E]


def layer_norm_backward(dout, cache):  # dout: [S, B, E], the gradient of out
    x, w, mean, rstd = cache
    dims = [-(i + 1) for i in range(w.dim())]
    norm = (x - mean) * rstd  # [S, B, E], recomputed: mean and rstd are cheaper to keep
    db = dout.reshape(-1, *w.shape).sum(0)  # [B, E], summed over the rows
    dw = (dout * norm).reshape(-1, *w.shape).sum(0)  # [B, E]
    dnorm = dout * w  # [S, B, E]
    dx = dnorm - dnorm.mean(dims, keepdim=True) - norm * (dnorm * norm).mean(dims, keepdim=True)
    return dx * rstd, dw, db  # [S, B, E], [B, E], [B, E]


def rms_norm_forward(x, w, eps=1e-6):  # x: [S, B, E]; w: [B, E]
    dims = [-(i + 1) for i in range(w.dim())]
    rstd = ((x**2).mean(dim=dims, keepdim=True) + eps) ** -0.5  # [S, 1, 1], 1 / rms: no mean
    return w * (x * rstd), (x, w, rstd)  # out: [S, B, E]


def rms_norm_backward(dout, cache):  # dout: [S, B, E]
    x, w, rstd = cache
    dims = [-(i + 1) for i in range(w.dim())]
    norm = x * rstd  # [S, B, E]
    dw = (dout * norm).reshape(-1, *w.shape).sum(0)  # [B, E]
    dnorm = dout * w  # [S, B, E]
    dx = dnorm - norm * (dnorm * norm).mean(dims, keepdim=True)  # no mean(dnorm) term: no mean
    return dx * rstd, dw  # [S, B, E], [B, E]
