"""``out=`` / ``residual_out=``: inference into preallocated buffers, on every backend."""

from __future__ import annotations

import pytest
import torch

import addnorm


def _inputs(dtype=torch.float32, rows=37, n=96):
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, rows, n, generator=g).to(dtype), torch.randn(3, rows, n, generator=g).to(dtype)
    w, b = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    return x, r, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms", [False, True])
def test_results_equal_the_allocating_call(backend, dtype, rms):
    x, r, w, b = _inputs(dtype)
    n = x.shape[-1]
    fn, params = (addnorm.add_rms_norm, (w,)) if rms else (addnorm.add_layer_norm, (w, b))
    y_ref, s_ref = fn(x, r, n, *params, prenorm=True, backend=backend)
    out, stream = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    y, s = fn(x, r, n, *params, prenorm=True, backend=backend, out=out, residual_out=stream)
    assert y is out and s is stream
    assert torch.equal(out, y_ref) and torch.equal(stream, s_ref)
    # post-norm with only out=: the stream is not returned, y still lands in the buffer
    out.fill_(float("nan"))
    assert fn(x, r, n, *params, backend=backend, out=out) is out and torch.equal(out, y_ref)
    plain = addnorm.rms_norm if rms else addnorm.layer_norm
    assert torch.equal(plain(x, n, *params, backend=backend, out=out), plain(x, n, *params, backend=backend))


def test_mixed_stream_dtype_into_buffers(backend):
    x, r, w, b = _inputs(torch.bfloat16)
    r = r.float()
    y_ref, s_ref = addnorm.add_layer_norm(x, r, 96, w, b, prenorm=True, residual_dtype=torch.float32, backend=backend)
    out, stream = torch.empty_like(x), torch.empty_like(r)
    addnorm.add_layer_norm(
        x, r, 96, w, b, prenorm=True, residual_dtype=torch.float32, backend=backend, out=out, residual_out=stream
    )
    assert torch.equal(out, y_ref) and torch.equal(stream, s_ref)


def test_requires_grad_is_refused_but_no_grad_is_fine():
    x, r, w, b = _inputs()
    w.requires_grad_()
    with pytest.raises(ValueError, match="out= and residual_out= do not support autograd"):
        addnorm.add_layer_norm(x, r, 96, w, b, out=torch.empty_like(x))
    with torch.no_grad():
        out = addnorm.add_layer_norm(x, r, 96, w, b, out=torch.empty_like(x))
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x + r, (96,), w.detach(), b))


@pytest.mark.parametrize("buffer", ["out", "residual_out"])
def test_a_buffer_written_counts_as_changed_in_place(backend, buffer):
    """A buffer a kernel writes through its pointer counts up its version, as an in-place op does:
    a graph that saved it before refuses to run on the new values (it ran silently, with a wrong
    gradient, on the CPU kernels)."""
    x, r, w, b = _inputs()
    a = torch.randn(x.shape, requires_grad=True)
    buf = torch.randn(x.shape)
    z = a * buf  # saves buf for a's gradient
    with torch.no_grad():
        addnorm.add_layer_norm(x, r, 96, w, b, prenorm=True, backend=backend, **{buffer: buf})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_buffers_torch_would_not_write_are_refused(backend):
    """An inference tensor outside inference mode, and a buffer that requires grad under grad
    mode: torch refuses to write either in place, and so does addnorm, by name."""
    x, r, w, b = _inputs()
    with torch.inference_mode():
        frozen = torch.empty_like(x)
    with pytest.raises(ValueError, match="out is an inference tensor"):
        addnorm.add_layer_norm(x, r, 96, w, b, out=frozen, backend=backend)
    with torch.inference_mode():  # where it may be written
        out = addnorm.add_layer_norm(x, r, 96, w, b, out=frozen, backend=backend)
    assert out is frozen
    leaf = torch.empty_like(x).requires_grad_()
    with pytest.raises(ValueError, match="residual_out requires grad"):
        addnorm.add_layer_norm(x, r, 96, w, b, residual_out=leaf, backend=backend)
    with torch.no_grad():
        addnorm.add_layer_norm(x, r, 96, w, b, residual_out=leaf, backend=backend)
    assert torch.equal(leaf.detach(), x + r)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda x: torch.empty(3, 37, 95), r"out must be a contiguous torch.float32 tensor of shape \(3, 37, 96\)"),
        (lambda x: torch.empty_like(x, dtype=torch.float64), "got torch.float64"),
        (lambda x: torch.empty(96, 37, 3).permute(2, 1, 0), "got non-contiguous"),
        (lambda x: torch.empty_like(x, device="meta"), "on meta"),
    ],
)
def test_bad_out_buffer_is_a_clear_error(bad, match):
    x, r, w, b = _inputs()
    with pytest.raises(ValueError, match=match):
        addnorm.add_layer_norm(x, r, 96, w, b, out=bad(x))
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        addnorm.layer_norm(x, 96, out=[1.0])


def test_residual_out_takes_the_stream_and_its_dtype():
    x, r, w, b = _inputs(torch.bfloat16)
    with torch.no_grad():  # no residual: the stream starts here, written into the buffer
        buffer = torch.empty_like(x, dtype=torch.float32)
        y, s = addnorm.add_layer_norm(
            x, None, 96, w, b, prenorm=True, residual_dtype=torch.float32, residual_out=buffer
        )
    assert s is buffer and torch.equal(s, x.float())
    assert torch.equal(y, addnorm.layer_norm(x, 96, w, b))
    with pytest.raises(ValueError, match="residual_out must be a contiguous torch.float32"):
        addnorm.add_layer_norm(x, r, 96, w, b, residual_dtype=torch.float32, residual_out=torch.empty_like(x))


def test_a_buffer_that_is_an_input_is_written_in_place(backend):
    """``out=x`` and ``residual_out=residual``: each input is read before it is overwritten."""
    x, r, w, b = _inputs()
    y_ref, s_ref = addnorm.add_layer_norm(x, r, 96, w, b, prenorm=True, backend=backend)
    xs, rs = x.clone(), r.clone()
    y, s = addnorm.add_layer_norm(xs, rs, 96, w, b, prenorm=True, backend=backend, out=xs, residual_out=rs)
    assert y is xs and s is rs and torch.equal(y, y_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("rows", [37, 1100])  # 3 x 1100 x 96 rows: past the threaded blocks' threshold
@pytest.mark.parametrize("rms", [False, True])
def test_out_x_without_a_residual_keeps_the_stream(backend, rms, rows):
    """Pre-norm without a residual returns ``x`` itself as the stream; with ``out=x`` that would be
    ``y``: the stream is then a copy of ``x``, written by the same call."""
    x, _, w, b = _inputs(rows=rows)
    call = addnorm.add_rms_norm if rms else addnorm.add_layer_norm
    args = (w,) if rms else (w, b)
    y_ref = call(x, None, 96, *args, backend=backend)
    xs = x.clone()
    y, s = call(xs, None, 96, *args, prenorm=True, backend=backend, out=xs)
    assert y is xs and torch.equal(y, y_ref) and torch.equal(s, x)
    xs = x.clone()
    y, s = call(xs, None, 96, *args, prenorm=True, backend=backend, out=xs[:])  # a view of x
    assert torch.equal(y, y_ref) and torch.equal(s, x)


@pytest.mark.parametrize("buffer", ["out", "residual_out"])
@pytest.mark.parametrize("shared", ["x", "residual"])
def test_a_buffer_overlapping_an_input_is_refused(backend, buffer, shared):
    """A buffer that shares part of an input's memory (here the input shifted by one row: the
    kernels would overwrite rows not yet read) is an error, as in torch's own ``out=`` ops."""
    shape, n = (3, 37, 96), 3 * 37 * 96
    storage = torch.randn(n + 96)
    inputs = {"x": torch.randn(shape), "residual": torch.randn(shape)}
    inputs[shared] = storage[:n].view(shape)
    shifted = storage[96:].view(shape)
    with pytest.raises(ValueError, match=f"^{buffer} overlaps {shared} without being {shared} itself"):
        addnorm.add_layer_norm(inputs["x"], inputs["residual"], 96, prenorm=True, backend=backend, **{buffer: shifted})


def test_out_and_residual_out_must_be_two_buffers(backend):
    x, r, w, b = _inputs()
    buffer = torch.empty_like(x)
    with pytest.raises(ValueError, match="^residual_out and out share memory"):
        addnorm.add_layer_norm(x, r, 96, w, b, prenorm=True, backend=backend, out=buffer, residual_out=buffer)


def test_buffers_over_several_normalized_dims_are_checked_and_returned(backend):
    """``normalized_shape`` of two dims: the buffers are checked as given (not a reshaped copy,
    which would be written instead of the buffer) and returned themselves."""
    x, r, w, b = _inputs(n=16)
    w2, b2 = torch.randn(37, 16), torch.randn(37, 16)
    y_ref, s_ref = addnorm.add_layer_norm(x, r, (37, 16), w2, b2, prenorm=True, backend=backend)
    out, stream = torch.empty_like(x), torch.empty_like(x)
    y, s = addnorm.add_layer_norm(x, r, (37, 16), w2, b2, prenorm=True, backend=backend, out=out, residual_out=stream)
    assert y is out and s is stream and torch.equal(out, y_ref) and torch.equal(stream, s_ref)
    for bad in (torch.empty(3, 16, 37).transpose(1, 2), torch.empty(3, 74, 8), torch.empty(3, 592)):
        with pytest.raises(ValueError, match=r"^out must be a contiguous torch.float32 tensor of shape \(3, 37, 16\)"):
            addnorm.add_layer_norm(x, r, (37, 16), w2, b2, backend=backend, out=bad)
