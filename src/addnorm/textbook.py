"""LayerNorm and RMSNorm as a learner first writes them (the seed tutorials' class, llm.c's
``layernorm.py``): forward and hand-derived backward, in the input's dtype, with no guards.

Right on ordinary rows; wrong on some others. ``addnorm explain --textbook`` shows which, and
the step of :mod:`addnorm.reference` (the exact form every backend runs) that prevents each.
Rows are the trailing ``w.dim()`` dims of ``x``; the library never calls this module.
"""


def layer_norm_forward(x, w, b, eps=1e-5):  # x: [..., *w.shape]; w, b: the normalized shape
    dims = [-(i + 1) for i in range(w.dim())]  # the last w.dim() dims, as the seeds
    mean = x.mean(dim=dims, keepdim=True)  # [..., 1, 1]
    var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)  # [..., 1, 1], biased (÷N)
    rstd = (var + eps) ** -0.5  # [..., 1, 1], 1 / std
    norm = (x - mean) * rstd  # [..., *w.shape]
    return w * norm + b, (x, w, mean, rstd)


def layer_norm_backward(dout, cache):  # dout: [..., *w.shape], the gradient of the output
    x, w, mean, rstd = cache
    dims = [-(i + 1) for i in range(w.dim())]
    norm = (x - mean) * rstd  # recomputed: mean and rstd are cheaper to keep than norm
    db = dout.reshape(-1, *w.shape).sum(0)  # w.shape, summed over the rows
    dw = (dout * norm).reshape(-1, *w.shape).sum(0)  # w.shape
    dnorm = dout * w  # [..., *w.shape]
    dx = dnorm - dnorm.mean(dims, keepdim=True) - norm * (dnorm * norm).mean(dims, keepdim=True)
    return dx * rstd, dw, db  # [..., *w.shape], w.shape, w.shape


def rms_norm_forward(x, w, eps=1e-6):  # x: [..., *w.shape]; w: the normalized shape
    dims = [-(i + 1) for i in range(w.dim())]
    rstd = ((x**2).mean(dim=dims, keepdim=True) + eps) ** -0.5  # [..., 1, 1], 1 / rms
    return w * (x * rstd), (x, w, rstd)  # [..., *w.shape]


def rms_norm_backward(dout, cache):
    x, w, rstd = cache
    dims = [-(i + 1) for i in range(w.dim())]
    norm = x * rstd  # [..., *w.shape]
    dw = (dout * norm).reshape(-1, *w.shape).sum(0)  # w.shape
    dnorm = dout * w
    dx = dnorm - norm * (dnorm * norm).mean(dims, keepdim=True)  # no mean, no mean(dnorm) term
    return dx * rstd, dw  # [..., *w.shape], w.shape
