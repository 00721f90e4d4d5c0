"""The timing harness: interleaved samples, quantiles, bytes moved and the copy bandwidth.

:func:`measure` times any set of no-argument callables side by side in one process, interleaved
round by round in a shuffled order, so that noise from other processes hits all of them alike;
each sample times enough calls to last ``min_sample_s``. :func:`bytes_moved` is the one count of
the bytes a call of an op moves, and :func:`copy_bandwidth` the yardstick GB/s are compared to.
Every script in ``benchmarks/`` times through these, as ``addnorm bench`` does.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Hashable

import torch

from ... import reference


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def seconds_per_call(run: Callable[[], object], reps: int, device: str) -> float:
    """Wall time of ``reps`` calls of ``run`` divided by ``reps``, the device synchronized."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    sync(device)
    return (time.perf_counter() - t0) / reps


def kernel_seconds(run: Callable[[], object], device: str) -> float:
    """Device time per call of ``run``, the host's share left out: on CUDA a CUDA graph of the
    call replayed between CUDA events (Triton's ``do_bench_cudagraph``; its ``do_bench``, events
    around each call, where the call cannot be captured). On the CPU, where the host is the
    device, the wall time of a call. :func:`measure` times calls whole, host included."""
    run()  # compile and allocate outside the timing
    if device != "cuda":
        return seconds_per_call(run, 2, device)
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(run, rep=50) / 1e3
    except Exception:  # noqa: BLE001 - not capturable: events around each call instead
        return triton.testing.do_bench(run, warmup=10, rep=50) / 1e3


def quantile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile of ascending ``sorted_values``, linearly interpolated."""
    k = (len(sorted_values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def measure(
    runs: dict[Hashable, Callable[[], object]], rounds: int, device: str = "cpu", min_sample_s: float = 1e-3
) -> dict[Hashable, tuple[float, float, float]]:
    """Interleaved timing of every callable in ``runs``: name -> (median, p20, p80) seconds per call.

    Each callable is called once first (compile, allocate, warm the caches); then ``rounds``
    samples each, every round in a new shuffled order (no callable always runs right after the
    same one), a sample timing as many calls (at most 1000) as last ``min_sample_s``.
    """
    reps = {}
    for name, run in runs.items():
        run()
        t = seconds_per_call(run, 1, device)
        reps[name] = max(1, min(1000, math.ceil(min_sample_s / max(t, 1e-7))))
    samples: dict[Hashable, list[float]] = {name: [] for name in runs}
    order = list(runs)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            samples[name].append(seconds_per_call(runs[name], reps[name], device))
    out = {}
    for name, values in samples.items():
        values.sort()
        out[name] = (quantile(values, 0.5), quantile(values, 0.2), quantile(values, 0.8))
    return out


class Copy:
    """``dst.copy_(src)`` on two ``mib`` MiB buffers, made once: the yardstick, callable, to time
    beside the implementations of a configuration (:func:`measure`); :meth:`gbps` turns its time
    per call into GB/s (bytes read + bytes written)."""

    def __init__(self, device: str, mib: int = 64):
        self.src = torch.ones(mib * 2**20 // 4, device=device)
        self.dst = torch.empty_like(self.src)

    def __call__(self):
        return self.dst.copy_(self.src)

    def gbps(self, seconds_per_call: float) -> float:
        return 2 * self.src.numel() * 4 / seconds_per_call / 1e9


def copy_bandwidth(device: str, mib: int = 64, rounds: int = 15) -> float:
    """GB/s of ``dst.copy_(src)`` on a ``mib`` MiB buffer (bytes read + bytes written)."""
    copy = Copy(device, mib)
    return copy.gbps(measure({"copy": copy}, rounds, device)["copy"][0])


def kernel_copy_bandwidth(device: str, mib: int = 64) -> float:
    """GB/s of ``dst.copy_(src)`` on a ``mib`` MiB buffer timed by :func:`kernel_seconds` (host
    left out): the yardstick for kernel times."""
    copy = Copy(device, mib)
    return copy.gbps(kernel_seconds(copy, device))


def bytes_moved(
    op: str,
    rows: int,
    cols: int,
    dtype: torch.dtype,
    pass_: str,
    *,
    recomputes_stream: bool = False,
    writes_unused: bool = False,
    writes_stream: bool = False,
) -> int:
    """Bytes one post-norm call of ``op`` reads and writes, each tensor once, following addnorm's
    plan (:func:`addnorm.ops.plan`). Row-sized tensors (``x``, ``residual``, ``s``, ``y``,
    ``dy``, ``dx``) have ``rows x cols`` elements of ``dtype``; parameters (the weight, and the
    bias for LayerNorm) ``cols``; the statistics (``rstd``, and ``mean`` for LayerNorm) one per
    row in the statistics dtype (float32; float64 for float64).

    By default, the least a call must move:

    - ``fwd`` (inference, under ``no_grad``): reads ``x`` (and ``residual``) and the parameters,
      writes ``y``. A post-norm call returns neither the stream ``s`` nor the statistics.
    - the forward of training (the first half of ``fwd+bwd``): the same, and writes the
      statistics and, with a residual, ``s``, which it saves for the backward.
    - ``bwd``: reads ``dy``, the saved tensor (``x``, or ``s``), the statistics and the weight;
      writes ``dx`` (the residual's gradient is the same tensor) and the parameters' gradients.
    - with dropout (``*_dropout``) every backend saves ``x`` and ``residual`` instead of ``s``
      (the keep mask is recomputed from the seed), and the backward writes the residual's
      gradient as a second tensor besides ``dx``.

    What a given implementation moves besides (:func:`addnorm.tools.bench.impls.traffic`):
    ``recomputes_stream``: training saves ``x`` and ``residual`` and the backward recomputes
    ``s`` from them (a backend with ``Capabilities.recomputes_stream``, such as ``cpu``): the
    forward writes no ``s``, the backward reads two tensors for it; ``fwd+bwd`` moves the same
    bytes either way. ``writes_unused``: every forward writes ``s`` and the statistics, used or
    not (the ``reference`` backend, and torch's add then norm). ``writes_stream``:
    the call fills a ``residual_out`` buffer (``--out-buffers``).

    Left out: the 8-byte dropout seed, and what a kernel keeps in its own buffers (per-thread
    partial sums of the parameters' gradients).
    """
    if pass_ not in ("fwd", "bwd", "fwd+bwd"):
        raise ValueError(f"pass_ must be fwd, bwd or fwd+bwd, got {pass_!r}")
    add, dropout, rms = op.startswith("add_"), op.endswith("_dropout"), "rms" in op
    tensor = rows * cols
    params = cols * (1 if rms else 2)
    inputs = tensor * (2 if add else 1)  # x and residual
    stats = rows * (1 if rms else 2) * torch.empty((), dtype=reference.stats_dtype(dtype)).element_size()
    stream_saved = add and not dropout and not recomputes_stream
    elements = stat_bytes = 0
    if pass_ == "fwd":
        elements = inputs + params + tensor + (tensor if add and (writes_stream or writes_unused) else 0)
        stat_bytes = stats if writes_unused else 0
    if pass_ == "fwd+bwd":
        elements = inputs + params + tensor + (tensor if stream_saved or (add and writes_unused) else 0)
        stat_bytes = stats
    if pass_ in ("bwd", "fwd+bwd"):
        saved = tensor if stream_saved or not add else inputs
        grads = tensor * (2 if dropout else 1) + params
        elements += tensor + saved + cols + grads  # dy, saved, weight; dx (and dresidual), dparams
        stat_bytes += stats
    return elements * torch.empty((), dtype=dtype).element_size() + stat_bytes
