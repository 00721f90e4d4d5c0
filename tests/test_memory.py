"""Memory: what autograd saves, and the peak CPU memory of forward + backward.

Saved tensors are seen through ``torch.autograd.graph.saved_tensors_hooks`` (every tensor
autograd keeps for backward goes through its pack hook). Peak memory is measured with
:func:`peak_bytes`, from the CPU allocator's own record of every allocation and free.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF
from torch.autograd.graph import saved_tensors_hooks
from torch.profiler import ProfilerActivity, profile

import addnorm
from addnorm import backend as backends


def peak_bytes(fn) -> int:
    """Peak of live CPU tensor memory allocated while ``fn()`` runs, in bytes.

    ``torch.profiler`` with ``profile_memory=True`` records one ``[memory]`` event per
    allocation (+bytes) and free (-bytes) made by torch's CPU allocator, with a timestamp; the
    running sum in time order is the memory held by tensors created inside ``fn``, and its
    maximum the peak. Tensors that exist before the call (the inputs) count as zero. Memory
    that does not come from torch's allocator (numpy or numba scratch arrays) is not seen.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_peak_bytes_measures_allocations():
    """The meter itself: two live 4 MB tensors peak at 8 MB, then free."""

    def fn():
        a = torch.empty(1000, 1000)
        b = torch.empty(1000, 1000)
        del a, b
        torch.empty(1000, 1000)

    assert 8_000_000 <= peak_bytes(fn) < 8_100_000


def _inputs(m, n, dtype, rms):
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    return make(m, n), make(m, n), make(n), None if rms else make(n)


def _call(x, r, w, b, *, rms, prenorm, backend):
    n = x.shape[-1]
    if rms:
        return addnorm.add_rms_norm(x, r, n, w, prenorm=prenorm, backend=backend)
    return addnorm.add_layer_norm(x, r, n, w, b, prenorm=prenorm, backend=backend)


class SavedTensors:
    """Records every tensor autograd saves for backward while active."""

    def __init__(self):
        self.saved: list[torch.Tensor] = []

    def __enter__(self):
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self.saved

    def _pack(self, t):
        self.saved.append(t)
        return t

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def recomputes_stream(backend: str, dtype: torch.dtype) -> bool:
    return dtype in backends.resolve(backend, torch.empty(1, 4)).CAPABILITIES.recomputes_stream


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("prenorm", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("residual", [False, True], ids=["no-residual", "residual"])
def test_training_saves_only_stream_mean_rstd(backend, rms, prenorm, residual, dtype):
    m, n = 8, 64
    x, r, w, b = _inputs(m, n, dtype, rms)
    with SavedTensors() as saved:
        if residual:
            out = _call(x, r, w, b, rms=rms, prenorm=prenorm, backend=backend)
        else:
            out = addnorm.rms_norm(x, n, w, backend=backend) if rms else addnorm.layer_norm(x, n, w, b, backend=backend)
    y = out[0] if isinstance(out, tuple) else out
    big = [t for t in saved if t.numel() == m * n]
    stats = [t for t in saved if t.shape == (m,)]
    params = [t for t in saved if t.shape == (n,)]
    assert len(saved) == len(big) + len(stats) + len(params), [t.shape for t in saved]
    if residual and not prenorm and recomputes_stream(backend, x.dtype):
        # post-norm: the stream is recomputed in backward from x and residual themselves
        assert [t.data_ptr() for t in big] == [x.data_ptr(), r.data_ptr()], "x and residual, not copies"
    else:
        assert len(big) == 1, "exactly one (M, N) tensor: s, or x without a residual"
        stream = big[0]
        if residual:
            torch.testing.assert_close(stream.float(), x.float() + r.float(), rtol=1e-2, atol=1e-2)
        else:
            assert stream.data_ptr() == x.data_ptr(), "x itself is saved, not a copy"
    assert all(t.dtype == torch.float32 for t in stats), "mean and rstd in float32"
    assert len(stats) == (1 if rms else 2), "rstd (and mean for LayerNorm)"
    assert len(params) == 1 and params[0].data_ptr() == w.data_ptr(), "the weight parameter, not a copy"
    assert all(t.data_ptr() != y.data_ptr() for t in saved), "the output is not saved"


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_inference_saves_nothing(backend, mode):
    x, r, w, b = _inputs(8, 64, torch.float32, rms=False)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with SavedTensors() as saved, ctx:
        y = _call(x, r, w, b, rms=False, prenorm=True, backend=backend)[0]
        addnorm.RMSNorm(64, backend=backend)(x)
        addnorm.LayerNorm(64, backend=backend)(x)
    assert saved == []
    assert not y.requires_grad and y.grad_fn is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prenorm", [False, True], ids=["post", "pre"])
def test_peak_memory_of_training_step_at_most_torch_eager(backend, dtype, prenorm):
    """add_layer_norm forward + backward holds no more than torch eager's ``x + r`` then
    ``layer_norm``: s, y and the gradient, plus a working buffer that does not grow with the
    input (here one (M, N) tensor is 2-4 MiB; a copy of it would show at once). Few, wide
    rows keep the test cheap for backends that run one program per row in an interpreter."""
    m, n = 64, 16384
    x, r, w, b = _inputs(m, n, dtype, rms=False)
    g = torch.Generator().manual_seed(1)
    dy, dstream = (torch.randn(m, n, generator=g).to(dtype) for _ in range(2))

    def ours():
        out = _call(x, r, w, b, rms=False, prenorm=prenorm, backend=backend)
        torch.autograd.grad(out, (x, r, w, b), (dy, dstream) if prenorm else dy)

    def eager():
        s = x + r
        y = TF.layer_norm(s, (n,), w, b)
        torch.autograd.grad((y, s) if prenorm else y, (x, r, w, b), (dy, dstream) if prenorm else dy)

    ours(), eager()  # warm up: first calls allocate one-off buffers
    working_buffer = 1 << 20
    assert peak_bytes(ours) <= peak_bytes(eager) + working_buffer


@pytest.mark.parametrize("kernels", ["cpu", "auto"])
def test_beyond_eager_the_cpu_kernels_hold_the_partial_rows_alone(kernels):
    """From 1024 rows the CPU backward sums dweight and dbias in 64 partial rows of N float32
    each (the reduction contract): all the memory a bf16 post-norm step holds beyond eager's, its
    tree summed in place (docs/reliability.md, section 4)."""
    m, n = 2048, 2048
    x, r, w, b = _inputs(m, n, torch.bfloat16, rms=False)
    dy = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def ours():
        torch.autograd.grad(_call(x, r, w, b, rms=False, prenorm=False, backend=kernels), (x, r, w, b), dy)

    def eager():
        torch.autograd.grad(TF.layer_norm(x + r, (n,), w, b), (x, r, w, b), dy)

    ours(), eager()
    partial_rows = 2 * 64 * n * 4  # dweight's and dbias's
    assert peak_bytes(ours) <= peak_bytes(eager) + partial_rows + (1 << 17)


def test_post_norm_catches_inputs_changed_in_place_before_backward(backend):
    """Where post-norm keeps x and residual (not their sum) for backward, changing either in
    place afterwards is autograd's error, never a silently wrong gradient."""
    x, r, w, b = _inputs(8, 64, torch.float32, rms=False)
    x2, r2 = x.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
    ya = addnorm.add_layer_norm(x * 1, r * 1, 64, w, b, backend=backend)
    xs, rs = x2 * 1, r2 * 1
    yb = addnorm.add_layer_norm(xs, rs, 64, w, b, backend=backend)
    with torch.no_grad():
        xs.add_(1.0)
    if recomputes_stream(backend, x.dtype):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            yb.sum().backward()
    else:  # the saved sum does not change: the gradient is that of the call
        yb.sum().backward()
        ya.sum().backward()
        torch.testing.assert_close(x2.grad, x.grad)
