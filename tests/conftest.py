"""Shared test helpers: the per-dtype tolerance table, the fp64 oracle, the backends to test."""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

# pytest-xdist's workers share the cores: OpenMP threads that spin after each parallel region
# (libgomp's default wait policy) take the cores the other workers need, which made the suite
# several times slower on two cores. Passive threads sleep instead. Read when torch loads libgomp.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings

# ADDNORM_TEST_DEVICE=cuda runs the suite on CUDA tensors: tensors and generators made without an
# explicit device then default to it. Without it, the Triton kernels run on CPU tensors through
# Triton's interpreter, which triton.jit selects when our kernels module is imported (lazily, by
# the backend registry below), so TRITON_INTERPRET is set before that.
TEST_DEVICE = torch.device(os.environ.get("ADDNORM_TEST_DEVICE", "cpu"))
if TEST_DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        from interpreter import skip_repatching

        skip_repatching()
else:
    torch.set_default_device(TEST_DEVICE)

    class _DefaultDeviceGenerator(torch.Generator):
        """``torch.Generator()`` on the default device (the test device, or the CPU inside
        ``with torch.device("cpu")``) unless a device is named; still a ``torch.Generator`` to
        every isinstance check and annotation."""

        def __new__(cls, device=None):
            return super().__new__(cls, torch.get_default_device() if device is None else device)

    torch.Generator = _DefaultDeviceGenerator

# On CPU tensors torch's own reductions and the reference backend's sum a row in the same order,
# and a model's fused and unfused paths give the same bits; on a GPU torch picks a reduction's
# order from the shape (docs/reliability.md, "the reduction contract"), so tests that compare with
# torch's own ops hold them to float32's rounding there instead.
SAME_BITS_AS_TORCH = TEST_DEVICE.type == "cpu"

from addnorm import backend as backends  # noqa: E402

# (rtol, atol) per dtype, seeded from torch.testing.assert_close's defaults. fp16/bf16 use
# flash-attn's rule instead (see assert_matches_oracle): the error against the fp64 oracle
# may be at most twice torch's own error in that dtype, plus atol.
TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}
# Hypothesis: "ci" (default) is reproducible and quick; HYPOTHESIS_PROFILE=long for local runs.
# The backend fixture only names a backend, so reusing it across examples is safe.
_QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
settings.register_profile(
    "ci", derandomize=True, max_examples=25, deadline=None, suppress_health_check=_QUIET, print_blob=True
)
settings.register_profile("long", max_examples=1000, deadline=None, suppress_health_check=_QUIET)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

LOW_PRECISION = (torch.float16, torch.bfloat16)
DTYPES = list(TOLERANCES)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> types.ModuleType:
    """``benchmarks/<name>.py`` imported as a module of that name (the scripts are not a package),
    for the tests of its functions."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def usable_backends() -> list[str]:
    """Every registered backend that can run on the test device here (CI installs them all)."""
    probe = torch.empty(1, 4, device=TEST_DEVICE)
    return [name for name in backends.REGISTRY if backends.unavailable_reason(name, probe) is None]


# "auto" too: what most users call goes through its own dispatch (on the CPU, to the numba kernels)
@pytest.fixture(params=["auto", *usable_backends()])
def backend(request) -> str:
    return request.param


def interpreted(backend: str) -> bool:
    """Whether ``backend`` runs through an interpreter here (Triton on CPU tensors): ~1 ms per op."""
    return backend == "triton" and TEST_DEVICE.type == "cpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "large: too slow for interpreted backends; deselected for them")


def pytest_collection_modifyitems(config, items):
    """Deselect ``large`` cases of interpreted backends; smaller cases cover the same code paths."""
    slow = [
        item
        for item in items
        if item.get_closest_marker("large")
        and hasattr(item, "callspec")
        and interpreted(item.callspec.params.get("backend", ""))
    ]
    if slow:
        config.hook.pytest_deselected(items=slow)
        gone = {id(item) for item in slow}
        items[:] = [item for item in items if id(item) not in gone]


def assert_matches_oracle(
    ours: torch.Tensor, oracle: torch.Tensor, torch_same_dtype: torch.Tensor | None = None, *, scale: float = 1.0
) -> None:
    """``ours`` (any dtype) against an fp64 ``oracle``, with the tolerance of ``ours.dtype``.

    ``torch_same_dtype`` is torch's own result in the dtype of ``ours``, computed from the
    same inputs. fp16/bf16 (flash-attn's rule): our max error may be at most twice torch's
    max error, plus atol. fp32/fp64: each element within ``atol + rtol*|oracle|``, plus twice
    torch's own max error in that row (ill-conditioned rows, e.g. 3 near-equal features,
    amplify rounding for every implementation). ``scale`` widens atol for quantities whose
    magnitude grows with the number of rows (dweight, dbias).
    """
    assert oracle.dtype == torch.float64
    rtol, atol = TOLERANCES[ours.dtype]
    if ours.numel() == 0:
        assert ours.shape == oracle.shape
        return
    err = (ours.double() - oracle).abs()
    if ours.dtype in LOW_PRECISION and torch_same_dtype is not None:
        ref_err = (torch_same_dtype.double() - oracle).abs().max().item()
        assert err.max().item() <= 2 * ref_err + atol * scale, (
            f"error {err.max().item():.3g} vs torch's {ref_err:.3g} in {ours.dtype}"
        )
        return
    allowed = atol * scale + rtol * oracle.abs()
    if torch_same_dtype is not None:
        ref_err = (torch_same_dtype.double() - oracle).abs()
        row_err = ref_err.amax(dim=-1, keepdim=True) if ref_err.dim() > 1 else ref_err.max()
        allowed = allowed + 2 * row_err
    worst = (err - allowed).argmax()
    assert bool((err <= allowed).all()), (
        f"{int((err > allowed).sum())} elements off; worst at flat index {int(worst)}: "
        f"ours {ours.flatten()[worst].item():.8g}, oracle {oracle.flatten()[worst].item():.8g}"
    )


_BLOCKS = importlib.import_module("addnorm.patch.blocks")
INFERENCE_FUSE_MIN_ELEMENTS = _BLOCKS.INFERENCE_FUSE_MIN_ELEMENTS  # the shipped value


@pytest.fixture(autouse=True)
def fuse_every_size(monkeypatch):
    """Fused blocks take their fused forward in inference calls of any size: the tests' models
    are tiny, and would otherwise run their blocks' own forward there
    (``INFERENCE_FUSE_MIN_ELEMENTS``; its own tests set it back)."""
    monkeypatch.setattr(_BLOCKS, "INFERENCE_FUSE_MIN_ELEMENTS", 0)


@pytest.fixture
def parallel_cpu_kernels(monkeypatch):
    """Split even small inputs over threads in the CPU kernels (normally only inputs of
    ``parallel_min_elements`` and more are), so that small tests cover the threaded path."""
    try:
        from addnorm.kernels import cpu
    except ImportError:  # numba missing: the cpu backend is not tested at all
        return
    monkeypatch.setattr(cpu.config, "SETTINGS", cpu.config.SETTINGS.updated(parallel_min_elements=1))


@pytest.fixture
def on_cpu():
    """For tests of backends that run on CPU tensors alone (``cpu``, the toy backends): tensors
    and generators made without a device are on the CPU, whatever ``ADDNORM_TEST_DEVICE`` says."""
    with torch.device("cpu"):
        yield
