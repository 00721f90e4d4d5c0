"""Compile addnorm's Triton kernels for an H100 (sm_90) on a machine without a GPU.

Prints, per kernel and the launch that ``config.plan`` picks from the launch table
(``addnorm.kernels.triton.config.TABLE``), the registers per thread and the bytes spilled to the
stack, read from the cubin with the ``cuobjdump`` bundled with Triton. A spill-free kernel at
the widest fused row is the reason for each kind's ``max_fused_n`` and ``bytes_per_thread``.

    python benchmarks/triton_registers.py [--max-fused-n N] [--forward-bytes-per-thread B]
        [--prefetch table|on|off] [N ...]
        (default widths: 1024 4096 8192 16384 65536; the options override the table's fused
        limits, bytes per thread and prefetch, to see what another choice would compile to)
    python benchmarks/triton_registers.py --x1-layouts   # the forward's row sums' layout with x1
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from addnorm.kernels.triton import backward_kernels, config, dropped_kernels, forward_kernels  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float64: "*fp64"}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compiled(fn, signature: dict, constants: dict, num_warps: int, divisible: tuple[str, ...] = ()):
    """``fn`` compiled for :data:`TARGET`, the arguments named in ``divisible`` known to be
    multiples of 16 (as Triton specializes a launch's pointers, widths and strides that are)."""
    nones = {k: None for k, v in signature.items() if v == "constexpr" and k not in constants}
    names = list(signature)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in divisible}
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs={**constants, **nones}, attrs=attrs),
        target=TARGET,
        options={"num_warps": num_warps, "enable_fp_fusion": False},
    )


def resources(fn, signature: dict, constants: dict, num_warps: int) -> str:
    kernel = compiled(fn, signature, constants, num_warps)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True)
        out = out.stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    regs = int(m.group(1))
    # programs resident per SM: 64K registers and 64 warps per SM on sm_90
    per_sm = min(65536 // (regs * 32 * num_warps), 64 // num_warps)
    return f"warps={num_warps:2d} regs={regs:3d} spill_stack={m.group(2):>3} warps/SM={per_sm * num_warps}"


def branch_sig(branch: bool, cd: torch.dtype) -> dict:
    """The sublayer branch's arguments: pointers and the keep threshold, or None constants."""
    kinds = ("*i64", PTR[cd], PTR[cd], PTR[cd], "i64") if branch else ("constexpr",) * 4 + ("i64",)
    return dict(zip(("SEED", "SCALE", "LS", "RSC", "threshold"), kinds, strict=True))


def second_sig(second: bool, names: tuple[str, ...], kinds: tuple[str, ...]) -> dict:
    """A second norm's arguments (parallel blocks): ``kinds``, or None constants."""
    return dict(zip(names, kinds if second else ("constexpr",) * len(names), strict=True))


def forward(
    n: int,
    dtype: torch.dtype,
    stream: torch.dtype,
    rms: bool,
    branch: bool = False,
    second: bool = False,
    x1: bool = False,
    x1_dtype: torch.dtype | None = None,
    layout: bool = False,
    plain: bool = False,
) -> str:
    """The forward kernel's resources; ``x1``: parallel blocks' ``x1`` (of x's dtype, or
    ``x1_dtype``) added as the residual (in the stream dtype) is read, through its dropout when
    ``branch`` (one ``dropout_p`` for both). With ``layout``, the layout of its row sums instead,
    compiled as a launch on rows of 16-aligned widths and strides. ``plain``: the launch of a
    plain call without gradients (``plain_forward``): neither the stream nor the statistics
    written, the stream in ``dtype``."""
    cd = torch.float64 if stream == torch.float64 else torch.float32
    block_m, block_n, warps, chunked = config.plan("forward", n, torch.device("cuda"), dtype.itemsize)
    sig = {
        "X": PTR[dtype],
        "R": PTR[stream] if x1 else PTR[dtype],
        "W": PTR[dtype],
        "B": "constexpr" if rms else PTR[dtype],
        "Y": PTR[dtype],
        "S": "constexpr" if plain else PTR[stream],
        "MEAN": "constexpr" if rms or plain else PTR[cd],
        "RSTD": "constexpr" if plain else PTR[cd],
        "M": "i32",
        "N": "i32",
        "sx": "i64",
        "sr": "i64",
        "EPS": PTR[cd],
        **branch_sig(branch, cd),
        **second_sig(second, ("W1", "B1", "Y1"), (PTR[dtype], "constexpr" if rms else PTR[dtype], PTR[dtype])),
        **second_sig(x1, ("X1", "sx1", "SEED1", "SCALE1"), (PTR[x1_dtype or dtype], "i64", "*i64", PTR[cd])),
        "threshold1": "i64",
    }
    const = {
        "HAS_RESIDUAL": True,
        "HAS_WEIGHT": True,
        "HAS_BIAS": not rms,
        "IS_RMS": rms,
        "CHUNKED": chunked,
        "BRANCH": branch,
        "SECOND": second,
        "HAS_BIAS1": second and not rms,
        "ADDED": x1,
        "DROPPED1": x1 and branch,
        "WRITE_STREAM": not plain,
        "WRITE_STATS": not plain,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
    }
    sig = {**sig, **dict.fromkeys(const, "constexpr")}
    if layout:
        divisible = tuple(k for k, v in sig.items() if v.startswith("*") or k in ("N", "sx", "sr", "sx1"))
        ttgir = compiled(forward_kernels._forward_kernel, sig, const, warps, divisible).asm["ttgir"]
        layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*>)$", ttgir, re.M))
        return layouts[re.search(r"tt\.reduce.*?tensor<[^>]*, (#\w+)>", ttgir, re.S).group(1)]
    return resources(forward_kernels._forward_kernel, sig, const, warps)


def backward(n: int, dtype: torch.dtype, rms: bool, branch: bool = False, second: bool = False) -> str:
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    kind = "branch_backward" if branch or second else "backward"
    block_m, block_n, warps, chunked = config.plan(kind, n, torch.device("cuda"), dtype.itemsize)
    coef = PTR[cd] if chunked else "constexpr"
    sig = {
        "DY": PTR[dtype],
        "DSTREAM": PTR[dtype],
        "S": PTR[dtype],
        "W": PTR[dtype],
        "MEAN": "constexpr" if rms else PTR[cd],
        "RSTD": PTR[cd],
        "K": coef,
        "CORR": coef,
        "C1": coef,
        "C2": coef,
        "DS": PTR[dtype],
        "DW": PTR[cd],
        "DB": "constexpr" if rms else PTR[cd],
        "DX": PTR[dtype] if branch else "constexpr",
        "DLS": PTR[cd] if branch else "constexpr",
        "M": "i32",
        "N": "i32",
        "rows_per_program": "i32",
        "sdy": "i64",
        "sdst": "i64",
        "ss": "i64",
        "sr": "i64",
        "R": PTR[dtype] if branch else "constexpr",
        **branch_sig(branch, cd),
        **second_sig(
            second,
            ("DY1", "W1", "DW1", "DB1", "sdy1"),
            (PTR[dtype], PTR[dtype], PTR[cd], "constexpr" if rms else PTR[cd], "i64"),
        ),
    }
    if not second:
        sig["sdy1"] = "i64"  # (a stride: always an argument)
    const = {
        "HAS_DSTREAM": True,
        "HAS_WEIGHT": True,
        "HAS_BIAS": not rms,
        "IS_RMS": rms,
        "CHUNKED": chunked,
        "BRANCH": branch,
        "LAYER_SCALED": branch,  # the branch with a layer scale: the most registers
        "SECOND": second,
        "HAS_BIAS1": second and not rms,
        "PREFETCH": config.backward_entry(kind, chunked).prefetch,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
    }
    out = resources(backward_kernels._backward_kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const, warps)
    if chunked:
        keys = ("DY", "S", "R", "W", "MEAN", "RSTD", "K", "CORR", "C1", "C2", "M", "N", "sdy", "ss", "sr")
        keys += ("SEED", "SCALE", "LS", "RSC", "threshold", "DY1", "W1", "sdy1")
        cconst = {k: const[k] for k in ("HAS_WEIGHT", "IS_RMS", "BRANCH", "SECOND", "BLOCK_M", "BLOCK_N")}
        out += "  coef: " + resources(
            backward_kernels._coef_kernel,
            {**{k: sig[k] for k in keys}, **dict.fromkeys(cconst, "constexpr")},
            cconst,
            warps,
        )
    return out


def sum_partials(cd: torch.dtype, out: torch.dtype | None = None) -> str:
    """The kernel that sums every parameter gradient's partial rows in one launch; ``out``: the
    parameters' dtype, when they are in another than ``cd`` (a layer scale's stays ``cd``)."""
    outs = (PTR[out or cd],) * 2 + (PTR[cd],) + (PTR[out or cd],) * 2
    sig = {"P": PTR[cd], **dict(zip(("O0", "O1", "O2", "O3", "O4"), outs)), "programs": "i32", "N": "i32"}
    const = {"BLOCK_P": 64, "BLOCK_N": 16}
    return resources(backward_kernels._sum_partials_kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const, 4)


def dropped(dtype: torch.dtype, added: bool) -> str:
    """Parallel blocks' ``x1`` (``addend + dropout(src)``), or its gradient without the addend."""
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    sig = {
        "SRC": PTR[dtype],
        "ADDEND": PTR[dtype] if added else "constexpr",
        "OUT": PTR[dtype],
        "M": "i32",
        "N": "i32",
        "s_src": "i64",
        "s_add": "i64",
        "SEED": "*i64",
        "SCALE": PTR[cd],
        "threshold": "i64",
    }
    const = {"HAS_ADDEND": added, "BLOCK_M": dropped_kernels._BLOCK_M, "BLOCK_N": dropped_kernels._BLOCK_N}
    kernel = dropped_kernels._dropped_kernel
    return resources(kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const, dropped_kernels._WARPS)


def x1_layouts(n: int = 1024) -> None:
    """The layout the forward gives its row sums with and without ``x1`` of each dtype, for fp32
    and bf16 ``x`` on an fp32 stream (compiled as a launch on ``n`` features): the order of the
    sums, and so the last bits of ``y``, follow it (docs/gpu.md, "x1 narrower than the stream")."""
    for dtype in (torch.float32, torch.bfloat16):
        print(f"N={n} x {str(dtype)[6:]:8s} no x1         {forward(n, dtype, torch.float32, False, layout=True)}")
        for x1_dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            with_x1 = forward(n, dtype, torch.float32, False, x1=True, x1_dtype=x1_dtype, layout=True)
            print(f"N={n} x {str(dtype)[6:]:8s} x1 {str(x1_dtype)[6:]:9s}  {with_x1}")


def main(widths: list[int]) -> None:
    print(f"triton {triton.__version__}, target sm_{TARGET.arch}")
    for cd in (torch.float32, torch.float64):
        print(f"  {str(cd)[6:]:8s} sum of partials    {sum_partials(cd)}")
    print(f"  bfloat16 sum of partials    {sum_partials(torch.float32, torch.bfloat16)}")
    print(f"  bfloat16 x1 + dropout      {dropped(torch.bfloat16, True)}")
    print(f"  bfloat16 dropout of dx1    {dropped(torch.bfloat16, False)}")
    for n in widths:
        print(f"N={n}")
        for dtype in (torch.bfloat16, torch.float32):
            stream = torch.float32
            print(f"  {str(dtype)[6:]:8s} fwd add_layer_norm  {forward(n, dtype, stream, False)}")
            print(f"  {str(dtype)[6:]:8s} fwd add_rms_norm    {forward(n, dtype, stream, True)}")
            print(f"  {str(dtype)[6:]:8s} fwd plain call      {forward(n, dtype, dtype, False, plain=True)}")
            print(f"  {str(dtype)[6:]:8s} bwd layer_norm      {backward(n, dtype, False)}")
            print(f"  {str(dtype)[6:]:8s} bwd rms_norm        {backward(n, dtype, True)}")
            print(f"  {str(dtype)[6:]:8s} fwd add_ln+dropout  {forward(n, dtype, stream, False, branch=True)}")
            print(f"  {str(dtype)[6:]:8s} bwd add_ln+dropout  {backward(n, dtype, False, branch=True)}")
            print(f"  {str(dtype)[6:]:8s} fwd parallel block  {forward(n, dtype, stream, False, second=True)}")
            x1 = forward(n, dtype, stream, False, second=True, x1=True)
            print(f"  {str(dtype)[6:]:8s} fwd parallel + x1   {x1}")
            x1 = forward(n, dtype, stream, False, branch=True, second=True, x1=True)
            print(f"  {str(dtype)[6:]:8s} fwd parallel + x1, dropout {x1}")
            print(f"  {str(dtype)[6:]:8s} bwd parallel block  {backward(n, dtype, False, second=True)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("widths", nargs="*", type=int, default=[1024, 4096, 8192, 16384, 65536])
    table = config.TABLE
    parser.add_argument("--max-fused-n", type=int, default=None, help="the forward's and backward's max_fused_n")
    parser.add_argument("--forward-bytes-per-thread", type=int, default=table.forward.bytes_per_thread)
    parser.add_argument("--backward-bytes-per-thread", type=int, default=table.backward.bytes_per_thread)
    parser.add_argument("--branch-backward-bytes-per-thread", type=int, default=table.branch_backward.bytes_per_thread)
    parser.add_argument(
        "--prefetch",
        choices=["table", "on", "off"],
        default="table",
        help="every backward's prefetch of its next tile: as the launch table has it, or on or off",
    )
    parser.add_argument(
        "--x1-layouts", action="store_true", help="print the layout of the forward's row sums with and without x1"
    )
    args = parser.parse_args()
    if args.x1_layouts:
        x1_layouts()
        raise SystemExit(0)
    if args.max_fused_n:
        table = table.updated("forward", max_fused_n=args.max_fused_n)
        table = table.updated("backward", max_fused_n=args.max_fused_n)
    table = table.updated("forward", bytes_per_thread=args.forward_bytes_per_thread)
    table = table.updated("backward", bytes_per_thread=args.backward_bytes_per_thread)
    table = table.updated("branch_backward", bytes_per_thread=args.branch_backward_bytes_per_thread)
    if args.prefetch != "table":
        for kind in ("backward", "branch_backward", "chunked"):
            table = table.updated(kind, prefetch=args.prefetch == "on")
    config.TABLE = table
    main(args.widths)
