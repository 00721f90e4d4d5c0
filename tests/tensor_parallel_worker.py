"""Tensor and sequence parallelism for tests/test_distributed.py: addnorm's ops and modules on
DTensors (torch's ``parallelize_module``), alone and with FSDP2 on a 2-D mesh.

Each rank checks its results itself against a single-process run of the same model (every rank
builds it from the same seed) within tests/conftest.py's tolerances, so that a failure names the
case and the tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as TF
from torch import nn

import addnorm
from addnorm.sharding import SequenceParallel as AddNormSequenceParallel
from conftest import TOLERANCES

WIDTH, HEADS, BATCH, SEQ = 32, 4, 2, 8


class Attention(nn.Module):
    """Causal self-attention; under tensor parallelism each rank holds whole heads (the -1 below)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        q, k, v = (w(x).unflatten(-1, (-1, WIDTH // HEADS)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(TF.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))


def norm(kind: str) -> nn.Module:
    return addnorm.LayerNorm(WIDTH) if kind == "layer" else addnorm.RMSNorm(WIDTH)


class PreNormBlock(nn.Module):
    """GPT-2's order, the add before the second norm fused: ``h, x = norm2(x + attn(norm1(x)))``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.norm1, self.attn, self.mlp = norm(kind), Attention(), mlp()
        self.add_norm = addnorm.AddNorm(WIDTH, norm=kind, prenorm=True)

    def forward(self, x):
        h, x = self.add_norm(self.attn(self.norm1(x)), x)
        return x + self.mlp(h)


class PostNormBlock(nn.Module):
    """The original Transformer's order: ``x = norm(x + sublayer(x))`` twice."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.attn, self.mlp = Attention(), mlp()
        self.add_norm1 = addnorm.AddNorm(WIDTH, norm=kind)
        self.add_norm2 = addnorm.AddNorm(WIDTH, norm=kind)

    def forward(self, x):
        x = self.add_norm1(self.attn(x), x)
        return self.add_norm2(self.mlp(x), x)


class Model(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.blocks = nn.Sequential(PreNormBlock(kind), PostNormBlock(kind))
        self.norm = norm(kind)

    def forward(self, x):
        return self.norm(self.blocks(x))


def new_model(kind: str) -> Model:
    torch.manual_seed(0)
    model = Model(kind)
    with torch.no_grad():  # norm weights and biases away from 1 and 0: a wrong one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, WIDTH, generator=g), torch.randn(BATCH, SEQ, WIDTH, generator=g)


def plan(model: Model, sequence_parallel: bool, local_output: bool) -> dict:
    """torchtitan's plan for Llama, on this model: column-parallel q/k/v and first MLP linear,
    row-parallel output linears; with sequence parallelism the norms run on sequence shards
    (``SequenceParallel``) and the attention and MLP inputs are gathered first. ``local_output``:
    the residual stream between the norms is local shards (torchtitan's way) or DTensors (without
    sequence parallelism it is a plain tensor, the same on every rank)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    rows = Shard(1) if sequence_parallel else Replicate()
    local_output = local_output or not sequence_parallel
    styles = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            styles |= {f"{name}.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
            styles[f"{name}.wo"] = RowwiseParallel(output_layouts=rows, use_local_output=local_output)
        elif name.endswith("mlp"):
            styles[f"{name}.0"] = ColwiseParallel()
            styles[f"{name}.2"] = RowwiseParallel(output_layouts=rows, use_local_output=local_output)
        if not sequence_parallel:
            continue  # the norms then see replicated plain tensors: nothing to parallelize
        if isinstance(module, Attention) or name.endswith("mlp"):
            styles[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        elif isinstance(module, addnorm.AddNorm):  # two inputs and nested parameters: addnorm's style
            styles[name] = AddNormSequenceParallel(use_local_output=local_output)
        elif isinstance(module, (addnorm.LayerNorm, addnorm.RMSNorm)) and not isinstance(
            model.get_submodule(name.rpartition(".")[0]),
            addnorm.AddNorm,  # whose style covers it
        ):
            styles[name] = SequenceParallel()  # torch's own style
    return styles


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def check(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCES.get(expected.dtype, (0, 0))  # exact for masks
    torch.testing.assert_close(full(got), expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def reference(kind: str, scale: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and parameter gradients of the model in one process, loss ``scale * (out * target).sum()``."""
    model = new_model(kind)
    x, target = data()
    out = model(x)
    (scale * (out * target).sum()).backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def tensor_parallel(mesh) -> None:
    """The model under a tensor-parallel plan, with and without sequence parallelism, for
    LayerNorm and RMSNorm: output, every parameter gradient and the parameters after an SGD step
    equal one process's."""
    from torch.distributed.tensor.parallel import parallelize_module

    for kind in ("layer", "rms"):
        expected_out, expected_grads = reference(kind)
        expected_params = dict(new_model(kind).named_parameters())
        x, target = data()
        for sequence_parallel in (False, True):
            model = new_model(kind)
            # both ways of holding the residual stream, one per norm kind (each case costs seconds)
            model = parallelize_module(model, mesh, plan(model, sequence_parallel, local_output=kind == "rms"))
            out = model(x.chunk(mesh.size(), dim=1)[mesh.get_local_rank()] if sequence_parallel else x)
            (full(out) * target).sum().backward()
            case = f"{kind} {'sequence' if sequence_parallel else 'tensor'} parallel"
            check(f"{case}: output", out, expected_out)
            for name, p in model.named_parameters():
                check(f"{case}: {name}.grad", p.grad, expected_grads[name])
            # the optimizer reduces the norms' partial gradients itself (DTensor's add)
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            for name, p in model.named_parameters():
                check(f"{case}: {name} after a step", p.detach(), expected_params[name] - 0.1 * expected_grads[name])


def fsdp_and_tensor_parallel(grid) -> None:
    """FSDP2 over the data-parallel mesh dim and sequence parallelism over the other."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    dp, tp = grid["dp"], grid["tp"]
    kind = "rms"
    expected_out, expected_grads = reference(kind, scale=1 / dp.size())  # FSDP averages over dp
    model = new_model(kind)
    model = parallelize_module(model, tp, plan(model, True, local_output=True))
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    x, target = data()
    batch, tokens = dp.get_local_rank(), tp.get_local_rank()
    out = model(x.chunk(dp.size())[batch].chunk(tp.size(), dim=1)[tokens])
    (full(out) * target.chunk(dp.size())[batch]).sum().backward()
    check("2-D: output", full(out), expected_out.chunk(dp.size())[batch])
    for name, p in model.named_parameters():
        check(f"2-D: {name}.grad", p.grad, expected_grads[name])


def placements(mesh, grid) -> None:
    """The ops on DTensors of each placement pair, on a 1-D and a 2-D mesh: values, gradients and
    the placements the outputs get (module docstring of addnorm.sharding). The LayerNorm cases
    carry the sublayer branch's ``layer_scale`` (replicated, its gradient a sum over the rows) and
    ``rowscale`` (per row, placed as x where it can be, else replicated)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    cases = [  # (x, residual) placements -> the outputs' placements
        (mesh, (Shard(0),), (Shard(0),), (Shard(0),)),  # batch
        (mesh, (Shard(1),), (Shard(1),), (Shard(1),)),  # sequence (6 rows over 4 ranks: uneven, one empty)
        (mesh, (Replicate(),), (Replicate(),), (Replicate(),)),
        (mesh, (Shard(1),), (Shard(0),), (Shard(1),)),  # different dims: x's, on a tie
        (mesh, (Replicate(),), (Shard(1),), (Shard(1),)),  # splitting a replicated tensor costs nothing
        (mesh, (Shard(2),), (Shard(1),), (Shard(1),)),  # the normalized dim: gathered to whole rows
        (mesh, (Shard(2),), (Shard(2),), (Replicate(),)),
        (mesh, (Partial(),), (Shard(0),), (Shard(0),)),  # a pending sum: reduced first
        (grid, (Shard(0), Shard(1)), (Shard(0), Shard(1)), (Shard(0), Shard(1))),
        (grid, (Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(0), Shard(1))),
        (grid, (Shard(0), Shard(2)), (Shard(0), Shard(1)), (Shard(0), Shard(1))),
    ]
    g = torch.Generator().manual_seed(2)
    x, r, dy, ds = (torch.randn(4, 6, WIDTH, generator=g) for _ in range(4))
    w, b, ls = (torch.randn(WIDTH, generator=g) for _ in range(3))
    rs = torch.rand(4, 6, generator=g)
    for on, px, pr, expected in cases:
        for rms in (False, True):
            case = f"x {px}, residual {pr}, rms={rms}"
            fn = addnorm.add_rms_norm if rms else addnorm.add_layer_norm
            norm_params = (w,) if rms else (w, b)
            params = norm_params + (() if rms else (ls,))  # layer_scale last
            plain = [t.clone().requires_grad_() for t in (x, r, *params)]
            spread = [_distribute(x, on, px), _distribute(r, on, pr)]
            spread += [_distribute(t, on, (Replicate(),) * on.ndim) for t in params]
            rs_spread = _distribute(rs, on, tuple(p if p in (Shard(0), Shard(1)) else Replicate() for p in px))
            results = []
            for ins, rowscale in ((plain, rs), (spread, rs_spread.detach())):
                branch = {} if rms else dict(layer_scale=ins[-1], rowscale=rowscale)
                y, s = fn(ins[0], ins[1], WIDTH, *ins[2 : 2 + len(norm_params)], prenorm=True, **branch)
                torch.autograd.backward((y, s), (_like(dy, y), _like(ds, s)))
                results.append([y, s, *(t.grad for t in ins)])
            y, s = results[1][:2]
            assert y.placements == s.placements == expected, f"{case}: {y.placements}, {s.placements}"
            for i, (got, want) in enumerate(zip(results[1], results[0])):
                check(f"{case}: result {i}", got, want.detach())


def dropout(mesh) -> None:
    """Fused dropout on DTensors: on replicated rows, the mask and results of a plain call with
    the same generator; on rows sharded over ranks, whose mask a shard cannot draw, a clear error."""
    from torch.distributed.tensor import Replicate, Shard

    g = torch.Generator().manual_seed(3)
    x, r, dy = (torch.randn(4, 6, WIDTH, generator=g) for _ in range(3))
    w = torch.randn(WIDTH, generator=g)
    results = []
    for distributed in (False, True):
        ins = [_distribute(t, mesh, (Replicate(),)) if distributed else t.clone().requires_grad_() for t in (x, r, w)]
        y, mask = addnorm.add_rms_norm(
            *ins[:2], WIDTH, ins[2], dropout_p=0.5, generator=torch.Generator().manual_seed(4), return_dropout_mask=True
        )
        # a sharded gradient: the backward must still draw the masks of all the rows
        y.backward(_distribute(dy, mesh, (Shard(1),)) if distributed else dy)
        results.append([y, mask, *(t.grad for t in ins)])
    for i, (got, want) in enumerate(zip(results[1], results[0])):
        check(f"dropout on replicated DTensors: result {i}", got, want.detach())
    _parallel_block_dropout(mesh, x, r, dy, w)
    sharded = [_distribute(t, mesh, (Shard(1),)) for t in (x, r)]
    for kwargs in ({}, {"x1": sharded[1]}, {"x1": sharded[1], "weight1": w}):
        try:
            addnorm.add_rms_norm(*sharded, WIDTH, _distribute(w, mesh, (Replicate(),)), dropout_p=0.5, **kwargs)
        except ValueError as err:
            assert "dropout_p > 0 needs x and residual replicated" in str(err), err
        else:
            raise AssertionError(f"dropout on sequence-sharded DTensors ran ({', '.join(kwargs)})")


def _parallel_block_dropout(mesh, x, r, dy, w) -> None:
    """Parallel blocks' ``x1`` dropped out on replicated DTensors, with and without a residual:
    the results, both masks and every gradient of a plain call with the same generator."""
    from torch.distributed.tensor import Replicate, Shard

    x1 = x.flip(0) * 2
    for residual in (r, None):
        results = []
        for distributed in (False, True):
            given = (x, x1, w, w.flip(0)) + (() if residual is None else (residual,))
            ins = [_distribute(t, mesh, (Replicate(),)) if distributed else t.clone().requires_grad_() for t in given]
            out = addnorm.add_layer_norm(
                ins[0], None if residual is None else ins[4], WIDTH, ins[2], x1=ins[1], weight1=ins[3],
                prenorm=True, dropout_p=0.3, generator=torch.Generator().manual_seed(5), return_dropout_mask=True,
            )  # fmt: skip
            y, y1, s = out[:3]
            grad = _distribute(dy, mesh, (Shard(1),)) if distributed else dy
            torch.autograd.backward((y, y1, s), (grad, grad * 0.5, grad * 0.25))
            results.append([*out, *(t.grad for t in ins)])
        for i, (got, want) in enumerate(zip(results[1], results[0])):
            check(f"x1 dropped out on replicated DTensors (residual {residual is not None}): result {i}", got, want)


def _distribute(t: torch.Tensor, mesh, placements: tuple) -> torch.Tensor:
    """``t`` as a leaf DTensor of ``placements``; a ``Partial`` holds ``t / size`` on each rank."""
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    if placements == (Partial(),):
        return DTensor.from_local(t.detach() / mesh.size(), mesh, placements, run_check=False).requires_grad_()
    return distribute_tensor(t.detach(), mesh, placements).requires_grad_()


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    return distribute_tensor(t, ref.device_mesh, ref.placements) if isinstance(ref, DTensor) else t
