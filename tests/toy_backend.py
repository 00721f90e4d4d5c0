"""A backend written outside the package, as a third party would: it registers under its own
name and runs the reference formulas, counting its calls (tests/test_backend_contract.py)."""

from __future__ import annotations

from addnorm.backend import Capabilities
from addnorm.kernels import torch as formulas

CAPABILITIES = Capabilities(device_types=("cpu",))
calls = {"forward": 0, "backward": 0}


def unavailable_reason(x):
    return None


def forward(x, residual, weight, bias, **kwargs):
    calls["forward"] += 1
    return formulas.forward(x, residual, weight, bias, **kwargs)


def backward(dy, dstream, s_parts, weight, mean, rstd, **kwargs):
    calls["backward"] += 1
    return formulas.backward(dy, dstream, s_parts, weight, mean, rstd, **kwargs)
