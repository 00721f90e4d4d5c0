"""DDP and FSDP2 (fully_shard) on gloo, 2 CPU processes: parameters equal a single-process run."""

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
WORLD, DEADLINE_S = 2, 120


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(out_dir) -> None:
    """Spawn the ranks and wait, killing them all past DEADLINE_S so that a hang cannot block CI."""
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
        if not all((Path(out_dir) / f"rank{r}.done").exists() for r in range(WORLD)):
            raise


def test_ddp_and_fsdp2_match_single_process(tmp_path):
    run_ranks(tmp_path)
    results = torch.load(tmp_path / "results.pt")
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
