"""``benchmarks/cpu_backward_parts.py``: the loops it times compute the backward they stand for
(against the CPU kernel's own backward), and the script runs."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from addnorm.kernels import cpu
from conftest import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_backward_parts.py"
parts = load_benchmark("cpu_backward_parts")


def test_the_rebuilt_loops_compute_the_kernels_backward():
    m, n = 7, 96  # an odd row count: the paired loop's last row is its own
    g = torch.Generator().manual_seed(0)
    x, r, dy = (torch.randn(m, n, generator=g) for _ in range(3))
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    _, _, mean, rstd = cpu.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None, write_stream=False)
    want = cpu.backward(dy, None, (x, r), w, mean, rstd, rms=False, has_bias=True)
    arrays = [t.numpy() for t in (x, r, dy, w, mean, rstd)]
    for name in ("no dweight/dbias", "backward", "backward, rows paired", "backward, next row's sums"):
        ds, dw, db = np.empty((m, n), np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
        parts.VARIANTS[name](*arrays, ds, dw, db, 0, m)
        rows = m - m % 2 if name.endswith("paired") else m  # the pair loop leaves an odd last row
        torch.testing.assert_close(torch.from_numpy(ds[:rows]), want.ds[:rows], rtol=1e-4, atol=1e-5)
        if name != "no dweight/dbias":
            last = slice(0, rows)
            ref_dw = (dy[last] * ((x + r)[last] - mean[last, None]) * rstd[last, None]).sum(0)
            torch.testing.assert_close(torch.from_numpy(dw), ref_dw, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(torch.from_numpy(db), dy[last].sum(0), rtol=1e-4, atol=1e-4)
    ds = np.empty((m, n), np.float32)
    parts.VARIANTS["stream"](*arrays, ds, None, None, 0, m)
    torch.testing.assert_close(torch.from_numpy(ds), dy + x + r)


def test_calls_time_every_variant_and_the_kernel():
    with ThreadPoolExecutor(max_workers=2) as pool:
        calls = parts.calls(8, 64, 2, pool)
        assert set(calls) == {*parts.VARIANTS, "addnorm cpu.backward"}
        for fn in calls.values():
            fn()


def test_a_bad_shape_is_a_usage_error():
    done = subprocess.run([sys.executable, str(SCRIPT), "4096"], capture_output=True, text=True)
    assert done.returncode == 2 and "4096" in done.stderr and "Traceback" not in done.stderr
