"""The Triton kernels at the real row widths CI never reaches, on a CUDA device.

    python benchmarks/gpu_widths.py            # fused widths, the fused limits, the chunked path
    python benchmarks/gpu_widths.py --huge     # also one tensor over 2**31 elements (~10 GB)

For each width and dtype: add_layer_norm and add_rms_norm forward against an fp64 torch oracle
(max error of y, in units of the dtype's eps), the backward's dx against the oracle's gradient,
and dweight bit-identical over two runs. Exits 1 if an error exceeds its bound.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import addnorm

WIDTHS = (768, 4096, 8192, 8193, 16384, 65536, 262144)
# bound on max|error| / (eps * max|oracle|): rounding of the output plus fp32 statistics
BOUND = {torch.bfloat16: 2.0, torch.float16: 2.0, torch.float32: 64.0}


def _oracle(op, x, r, w, b, dtype):
    s = x + r.double()
    s = s + (s.to(dtype).double() - s).detach()  # the stream rounded to dtype, as the kernels store it
    n = x.shape[-1]
    if op == "add_layer_norm":
        return F.layer_norm(s, (n,), w.double(), b.double(), 1e-5)
    return F.rms_norm(s, (n,), w.double(), torch.finfo(torch.float32).eps)


def _run(op, x, r, w, b):
    n = x.shape[-1]
    if op == "add_layer_norm":
        return addnorm.add_layer_norm(x, r, n, w, b, backend="triton")
    return addnorm.add_rms_norm(x, r, n, w, backend="triton")


def check(op: str, rows: int, n: int, dtype: torch.dtype) -> bool:
    g = torch.Generator(device="cuda").manual_seed(n)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(dtype)
    x, r, w, b = mk(rows, n), mk(rows, n), mk(n), mk(n)
    x[0] += 1000.0  # a row with a large mean offset
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    dy = mk(rows, n)
    y = _run(op, xs, r, ws, bs)
    y.backward(dy)
    dx, dw1 = xs.grad.clone(), ws.grad.clone()
    ws.grad = None
    _run(op, xs, r, ws, bs).backward(dy)
    same = torch.equal(dw1, ws.grad)

    xo, wo, bo = (t.double().requires_grad_() for t in (x, w, b))
    ref = _oracle(op, xo, r, wo, bo, dtype)
    ref.backward(dy.double())
    eps = torch.finfo(dtype).eps
    err_y = ((y.double() - ref).abs().max() / (eps * ref.abs().max())).item()
    err_dx = ((dx.double() - xo.grad).abs().max() / (eps * xo.grad.abs().max())).item()
    ok = err_y <= BOUND[dtype] and err_dx <= 4 * BOUND[dtype] and same
    print(
        f"{op:15s} {rows:6d}x{n:<7d} {str(dtype):15s} y {err_y:7.3f} eps  dx {err_dx:7.3f} eps  "
        f"dweight bit-identical {same}  {'ok' if ok else 'FAIL'}",
        flush=True,
    )
    return ok


def huge() -> bool:
    """One bf16 tensor of 2**31 + 65536 elements: the last rows sit past int32 offsets."""
    x = torch.randn(32769, 65536, device="cuda", dtype=torch.bfloat16)
    y = addnorm.layer_norm(x, 65536, backend="triton")
    ref = F.layer_norm(x[-2:].double(), (65536,))
    err = ((y[-2:].double() - ref).abs().max() / torch.finfo(torch.bfloat16).eps).item()
    ok = err <= 2 * ref.abs().max().item()
    print(
        f"layer_norm      32769x65536  bf16 (2**31 + 65536 elements): last rows {err:.3f} eps  "
        f"{'ok' if ok else 'FAIL'}",
        flush=True,
    )
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--huge", action="store_true", help="also a tensor over 2**31 elements")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    ok = True
    for n in WIDTHS:
        rows = max(4, min(256, 2**22 // n))
        for dtype in (torch.bfloat16, torch.float32):
            for op in ("add_layer_norm", "add_rms_norm"):
                ok &= check(op, rows, n, dtype)
    if args.huge:
        ok &= huge()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
