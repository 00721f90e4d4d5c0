"""Distributed training on gloo, 4 CPU processes started once for every test here (starting them
costs more than the checks): DDP and FSDP2 (fully_shard) train to a single-process run's
parameters; under tensor and sequence parallelism (DTensor, parallelize_module), alone and with
FSDP2 on a 2 x 2 mesh, addnorm's ops and modules give a single process's outputs and gradients."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed_worker as worker

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo"
)
WORLD, DEADLINE_S = 4, 150


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    """Spawn the ranks and wait, killing them all past DEADLINE_S so that a hang cannot block CI;
    the folder of what they left."""
    out_dir = tmp_path_factory.mktemp("ranks")
    ctx = mp.start_processes(
        worker.run_rank, args=(WORLD, free_port(), str(out_dir)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1):  # raises ProcessRaisedException if a rank failed
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"distributed ranks still running after {DEADLINE_S} s")
    except mp.ProcessExitedException:
        # gloo's threads can abort a rank at teardown ("terminate called without an active
        # exception"), after all the work is done: only a rank that died before that fails
        if not all((out_dir / f"rank{r}.done").exists() for r in range(WORLD)):
            raise
    return out_dir


def passed(out_dir: Path, check: str) -> None:
    """Fail with the traceback of the first rank where ``check`` failed."""
    for failed in sorted(out_dir.glob(f"{check}.rank*.failed")):
        pytest.fail(f"{failed.name}:\n{failed.read_text()}", pytrace=False)


def test_ddp_and_fsdp2_match_single_process(ranks):
    passed(ranks, "ddp_fsdp")
    results = torch.load(ranks / "results.pt")
    expected = worker.single_process()
    initial = worker.new_model().state_dict()
    for norm_weight in ("blocks.0.norm1.weight", "blocks.1.norm2.weight", "add_norm.norm.weight"):
        assert not torch.equal(expected[norm_weight], initial[norm_weight])  # the norms did train
    for kind in ("ddp", "fsdp"):
        got = results[kind]
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(
                got[name], expected[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name, k=kind: f"{k} {n}: {m}"
            )


def test_dtensor_placements_give_single_process_values_and_gradients(ranks):
    """x and residual on every pair of placements tried (batch, sequence, replicated, different
    dims, the normalized dim, a pending sum; 1-D and 2-D mesh), with and without layer_scale and
    rowscale: values and gradients as one process, outputs placed as addnorm.sharding says."""
    passed(ranks, "placements")


def test_fused_dropout_on_dtensors_needs_replicated_rows(ranks):
    passed(ranks, "dropout")


def test_tensor_and_sequence_parallel_blocks_match_single_process(ranks):
    """A pre-norm (fused add) and a post-norm block, attention + MLP, under a tensor-parallel plan
    with and without sequence parallelism, LayerNorm and RMSNorm, float32: output and every
    parameter gradient as one process."""
    passed(ranks, "tensor_parallel")


def test_fsdp2_with_sequence_parallel_on_a_2d_mesh(ranks):
    passed(ranks, "fsdp_tensor_parallel")
