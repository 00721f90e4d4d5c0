"""Triton kernels for every addnorm op: the contract of :mod:`addnorm.reference` on GPU rows.

The backend contract the registry reads (:mod:`addnorm.backend`): :data:`CAPABILITIES`,
:func:`unavailable_reason`, :func:`forward` and :func:`backward`, and the optional
:func:`plain_forward`. The package holds:

- :mod:`.forward_kernels`: the forward kernel (fused and chunked rows) and its launcher;
- :mod:`.backward_kernels`: the coefficient, backward and partial-sum kernels and their launcher;
- :mod:`.dropped_kernels`: parallel blocks' ``x1`` with dropout (and its gradient), one launch;
- :mod:`.common`: the Triton helpers both passes call and the launchers' tensor plumbing;
- :mod:`.config`: the launch table (fused limits, tile shapes, warps, program counts) and how a
  launch is planned from it.

Limits and why. Statistics and arithmetic are fp32 for fp16/bf16/fp32 and fp64 for fp64, as
the reference. Row offsets are int64 (tensors over 2**31 elements are safe); rows may have any
stride (a copy is made only when the last dim is not contiguous, as the kernels need unit
column stride for coalesced loads). Results are rounded to nearest even: compiled, by the cast
itself; in Triton's interpreter, which truncates fp32 -> bf16, by hand from the bits
(``common._round``), to the same bits.

The kernels are compiled by ``triton.jit``, which reads ``TRITON_INTERPRET`` when this package
is imported: with ``TRITON_INTERPRET=1`` set before then, they run on CPU tensors through
Triton's interpreter (that is how CI tests them), otherwise they need CUDA tensors.
"""

from __future__ import annotations

from torch import Tensor

from ...backend import Capabilities
from .backward_kernels import backward
from .common import _INTERPRETED
from .forward_kernels import forward, plain_forward

__all__ = ["CAPABILITIES", "backward", "forward", "plain_forward", "unavailable_reason"]


# CUDA tensors; CPU tensors only through Triton's interpreter (how CI runs these kernels)
CAPABILITIES = Capabilities(device_types=("cuda", "cpu"), second_norm=True, adds_x1=True)


def unavailable_reason(x: Tensor | None) -> str | None:
    """Why these kernels cannot run on ``x`` (``None`` if they can)."""
    if x is not None and x.device.type == "cpu" and not _INTERPRETED:
        return "CPU tensors need TRITON_INTERPRET=1 (set before addnorm's triton kernels are imported)"
    return None
