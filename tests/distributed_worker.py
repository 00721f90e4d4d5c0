"""The ranks of tests/test_distributed.py on gloo: DDP / FSDP2 training runs against a single
process, then the tensor-parallel checks of tensor_parallel_worker.py."""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as TF

from tiny_models import VOCAB, TinyTransformer

STEPS, BATCH, SEQ = 3, 4, 8


def batches():
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def new_model():
    torch.manual_seed(0)
    return TinyTransformer()


def train(model, rank: int = 0, world: int = 1) -> None:
    """A few SGD steps of next-token prediction; rank ``r`` of ``world`` takes its slice of each batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for batch in batches():
        shard = batch.chunk(world)[rank]
        logits = model(shard[:, :-1])
        loss = TF.cross_entropy(logits.reshape(-1, VOCAB), shard[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def single_process() -> dict[str, torch.Tensor]:
    model = new_model()
    train(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ddp_and_fsdp(rank: int, world: int, out_dir: str) -> None:
    """DDP, then FSDP2 (fully_shard per block, then the root); rank 0 saves the full weights."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(new_model())
    train(ddp, rank, world)
    results = {"ddp": {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}}

    model = new_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    train(model, rank, world)
    results["fsdp"] = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of every distributed check, in one process group: starting the processes costs
    more than the checks on CI's 2 cores. A check that fails leaves ``<check>.rank<r>.failed``
    (its traceback) and the next one runs; ``rank<r>.done`` says the rank got through them all."""
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh

        import tensor_parallel_worker as tp

        mesh = init_device_mesh("cpu", (world,))
        grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        checks = {
            "ddp_fsdp": lambda: ddp_and_fsdp(rank, world, out_dir),
            "placements": lambda: tp.placements(mesh, grid),
            "dropout": lambda: tp.dropout(mesh),
            "tensor_parallel": lambda: tp.tensor_parallel(mesh),
            "fsdp_tensor_parallel": lambda: tp.fsdp_and_tensor_parallel(grid),
        }
        for name, check in checks.items():
            try:
                check()
            except Exception:
                Path(out_dir, f"{name}.rank{rank}.failed").write_text(traceback.format_exc())
        # this rank's work is complete; past the barrier, so is every other rank's
        Path(out_dir, f"rank{rank}.done").touch()
        dist.barrier()
    finally:
        dist.destroy_process_group()
