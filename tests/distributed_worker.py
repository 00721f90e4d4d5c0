"""Training runs for tests/test_distributed.py: single-process, or one rank of DDP / FSDP2 on gloo."""

from __future__ import annotations

import datetime
import os
import sys

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


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: DDP, then FSDP2 (fully_shard per block, then the root); rank 0 saves full weights."""
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
        # this rank's work is complete; past the barrier, so is every other rank's
        open(os.path.join(out_dir, f"rank{rank}.done"), "w").close()
        dist.barrier()
    finally:
        dist.destroy_process_group()
