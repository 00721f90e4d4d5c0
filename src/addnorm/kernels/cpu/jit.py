"""numba's ``njit``, ``cfunc`` and ``overload`` for the CPU kernels, asking LLVM for vectors of
VECTOR_BITS.

LLVM's x86 tuning for Intel CPUs with AVX-512 (Skylake server to Emerald Rapids) prefers 256-bit
vectors, a guard against the clock drop of the first AVX-512 CPUs, so numba's loops use half
the registers' width there. Every function of the kernels is compiled with the function
attribute ``"prefer-vector-width"`` (clang's ``-mprefer-vector-width``) instead: on the Intel
Xeon (Emerald Rapids) 512 bits made the bf16 kernels faster and the fp32 ones no slower
(docs/performance-log.md, "CPU: 512-bit vectors"). Measured there alone: on Skylake or Cascade Lake
servers, whose clocks drop with 512-bit code, and on the AMD EPYC it was not timed. On a CPU
without AVX-512 the attribute changes nothing: the vectors stay the widest it has.

The attribute goes on each function as numba lowers it (a lowering pass of numba's own
pipeline, subclassed): LLVM vectorizes a loop in the function that holds it. ``inline=
"always"`` functions are lowered into their callers; ``@overload`` implementations are
optimized in libraries of their own before their callers inline them, so they take the
pipeline too (:func:`overload`). The width changes the order of a row sum's
lanes, so results differ in the last bits from a build with another width, as they do between
CPU kinds (docs/reliability.md); every path of a build uses the same width, so the bitwise
promises (thread counts, batch sizes, plain against non-temporal stores) are unchanged.
"""

from __future__ import annotations

import numba
from numba import extending
from numba.core import compiler, lowering, typed_passes
from numba.core.compiler_machinery import register_pass

VECTOR_BITS = 512  # a compile-time constant: the entries' disk cache is keyed by this file


class _Lower(lowering.Lower):
    def post_lower(self):
        super().post_lower()
        # llvmlite's attribute set takes only the attributes it knows by name; LLVM's IR takes
        # a quoted key and value on any function
        set.add(self.function.attributes, f'"prefer-vector-width"="{VECTOR_BITS}"')


@register_pass(mutates_CFG=True, analysis_only=False)
class _Lowering(typed_passes.NativeLowering):
    _name = "addnorm_cpu_lowering"

    @property
    def lowering_class(self):
        return _Lower


class Pipeline(compiler.CompilerBase):
    """numba's nopython pipeline with :class:`_Lowering` in place of its native lowering."""

    def define_pipelines(self):
        pm = compiler.DefaultPassBuilder.define_nopython_pipeline(self.state)
        pm.passes = [(_Lowering if p is typed_passes.NativeLowering else p, d) for p, d in pm.passes]
        if not any(p is _Lowering for p, _ in pm.passes):
            raise RuntimeError("numba's nopython pipeline has no NativeLowering pass to replace")
        pm.finalize()
        return [pm]


def njit(fn=None, **options):
    """``numba.njit`` through :class:`Pipeline`: ``@njit`` or ``@njit(inline="always", ...)``."""
    if fn is None:
        return lambda f: numba.njit(f, pipeline_class=Pipeline, **options)
    return numba.njit(fn, pipeline_class=Pipeline, **options)


def cfunc(sig, **options):
    """``numba.cfunc`` through :class:`Pipeline`."""
    return numba.cfunc(sig, pipeline_class=Pipeline, **options)


def overload(func, **options):
    """``numba.extending.overload`` whose implementations compile through :class:`Pipeline`."""
    return extending.overload(func, jit_options={"pipeline_class": Pipeline}, **options)
