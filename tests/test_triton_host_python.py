"""``benchmarks/triton_host_python.py``: the calls it times compute what they stand for (the same
``y`` by every route, torch's within rounding), the ``backend="auto"`` call is the shortcut to
``plain_forward``, the stopped launches reach the launch key, and bad input is refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as TF

from conftest import load_benchmark

pytest.importorskip("triton")  # the optional [gpu] extra; CI installs it
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_host_python.py"
host = load_benchmark("triton_host_python")


def test_every_timed_call_computes_the_same_y(monkeypatch):
    plain = []
    real = host.K.plain_forward

    def counting(*args):
        plain.append(args[0].shape)
        return real(*args)

    counting.__module__ = real.__module__  # (a plain_forward is taken from its forward's module alone)
    monkeypatch.setattr(host.K, "plain_forward", counting)
    m, n = 3, 40
    with host.triton_as_auto(), torch.no_grad():
        runs = host.calls(m, n, torch.bfloat16)
        host.addnorm.layer_norm(torch.zeros(1, n), n)  # ("auto" chooses its backend)
        plain.clear()
        ys = {name: call() for name, call in runs.items()}
    assert set(ys) == {
        "add_layer_norm, backend='triton'",
        "backend forward",
        "add_layer_norm, backend='auto'",
        "backend plain_forward",
    }
    assert plain == [(m, n), (m, n)]  # the "auto" call is the shortcut's, and the direct call
    first = next(iter(ys.values()))
    assert all(torch.equal(y, first) for y in ys.values())
    g = torch.Generator().manual_seed(0)
    x, r, w, b = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in ((m, n), (m, n), (n,), (n,)))
    want = TF.layer_norm((x + r).double(), (n,), w.double(), b.double())
    torch.testing.assert_close(first.double(), want, rtol=0, atol=3e-2)


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_the_training_call_gives_torch_s_gradients(on_cpu, monkeypatch, backend):
    """Either route runs the triton backend's forward and backward, with torch's results."""
    ran = []
    for name in ("forward", "backward"):
        real = getattr(host.K, name)
        monkeypatch.setattr(host.K, name, lambda *a, _real=real, _name=name, **k: ran.append(_name) or _real(*a, **k))
    m, n = 3, 40
    with host.triton_as_auto():
        host.addnorm.layer_norm(torch.zeros(1, n), n)  # ("auto" chooses its backend)
        ran.clear()
        y, grads = host.training_call(m, n, torch.float32, backend)()
    assert ran == ["forward", "backward"]
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(*s, generator=g).double().requires_grad_() for s in ((m, n), (m, n), (n,), (n,))]
    dy = torch.randn(m, n, generator=g).double()
    want = TF.layer_norm(leaves[0] + leaves[1], (n,), leaves[2], leaves[3])
    torch.testing.assert_close(y.double(), want.detach(), rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, torch.autograd.grad(want, leaves, dy), strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_stopped_launches_reach_the_launch_key(on_cpu, monkeypatch):
    """Every launch of the timed calls, training's backward kernels included, stops at its key:
    no kernel runs."""
    from addnorm.kernels.triton import backward_kernels

    keys = []
    real = host.common._key
    monkeypatch.setattr(host.common, "_key", lambda *a: keys.append(a[0]) or real(*a))
    ran = []
    kernels = (host.K.forward_kernels._forward_kernel, backward_kernels._backward_kernel)
    kernels += (backward_kernels._sum_partials_kernel,)
    for kernel in kernels:
        monkeypatch.setattr(kernel, "run", lambda *a, **k: ran.append(1))
    with host.launches_stopped():
        for call in (*host.calls(2, 16, torch.float32).values(), host.training_call(2, 16, torch.float32)):
            call()
    assert set(keys) == set(kernels) and not ran
    assert host.K.forward_kernels.launch is backward_kernels.launch is host.common.launch  # (put back)


@pytest.mark.parametrize("argv", [["--shape", "8by768"], ["--shape", "0x768"], ["--rounds", "0"]])
def test_bad_input_is_refused_by_name(argv):
    bad = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert ("--shape" if argv[0] == "--shape" else "--rounds") in bad.stderr.splitlines()[-1]
