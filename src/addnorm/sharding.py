"""addnorm under torch's tensor and sequence parallelism: DTensor sharding rules for its ops.

A norm treats every row (one position of ``x``'s leading dims: a token) on its own, over all the
features of the last dim. So its ops run unchanged on each rank's local shard as long as every
rank holds whole rows: the rules below shard the row-like tensors (``x``, ``residual``, the
outputs, the saved statistics, the gradients) alike, on one leading dim per mesh dim (batch or
sequence) or not at all, keep the per-feature tensors (``weight``, ``bias``) replicated, and
return the gradients of the per-feature tensors, sums over the rows, as ``Partial("sum")``
wherever the rows are split: DTensor reduces them when they are used.

DTensor's dispatch picks, among the placements these rules allow, the one its cost model finds
cheapest to reach from the inputs' placements, redistributes the inputs that differ and calls
the op on the local shards (which runs the usual backend, the numba kernels on CPU):

- ``x`` and ``residual`` on different leading dims: both move to one (on a tie in cost, ``x``'s);
- ``Replicate`` and ``Shard(d)``: the replicated one is split locally (no communication);
- ``Partial`` (a sum not reduced yet, e.g. a row-parallel linear's output): reduced first (an
  all-reduce, or a reduce-scatter to a sharded placement);
- sharded on the last (normalized) dim: gathered to whole rows, then normalized, as DTensor does
  for torch's own ``layer_norm``/``rms_norm`` (a drop-in does not fail where torch works); the
  output is then sharded on the rows or replicated, not on the features;
- fused dropout (``dropout_p > 0``): its keep mask is a function of each row's index in the call,
  which a shard of the rows does not know, so the rows are replicated (:mod:`addnorm.ops` refuses
  row-sharded inputs in eager mode rather than gather them unasked).

Each op's tensor arguments and outputs have one role in :data:`ROLES`, the one place to extend
when an op gains a tensor argument or output: one entry each (``register`` refuses an op with a
tensor argument that has none). Scalar arguments need no entry: :func:`_schema_info` makes every
one of them part of DTensor's cache key.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo, TupleStrategy
from torch.distributed.tensor._ops.utils import generate_redistribute_costs, is_tensor_shardable
from torch.distributed.tensor.parallel import ParallelStyle

ROWS = "rows"  # x's leading dims (a row, an entry per row): placed as x, on a leading dim or replicated
REPLICATED = "replicated"  # per feature (shape (N,)) or one scalar (the dropout seed): on every rank
SUMMED = "summed"  # an output summed over the rows (dweight): Partial("sum") where the rows are split


class Roles(NamedTuple):
    inputs: dict[str, str]  # tensor argument name -> role (a list argument: the role of each entry)
    outputs: tuple[str, ...]  # per output, in order


_BRANCH = {"seed": REPLICATED, "layer_scale": REPLICATED, "rowscale": ROWS}  # s = residual + rowscale*ls*dropout(x)
ROLES = {
    "forward": Roles(
        inputs={"x": ROWS, "residual": ROWS, "weight": REPLICATED, "bias": REPLICATED, **_BRANCH},
        outputs=(ROWS, ROWS, ROWS, ROWS),  # y, s, mean, rstd (statistics of shape x.shape[:-1])
    ),
    "backward": Roles(
        inputs={"dy": ROWS, "dstream": ROWS, "s_parts": ROWS, "weight": REPLICATED, "mean": ROWS, "rstd": ROWS}
        | _BRANCH,
        outputs=(ROWS, SUMMED, SUMMED, ROWS, SUMMED),  # ds, dweight, dbias, dx, dlayer_scale
    ),
}


def _placements(role: str, rows: tuple) -> tuple:
    """The placements of a tensor of ``role`` when the rows are placed ``rows`` (one per mesh dim)."""
    if role == ROWS:
        return rows
    if role == REPLICATED:
        return (Replicate(),) * len(rows)
    return tuple(Partial() if isinstance(p, Shard) else Replicate() for p in rows)  # SUMMED


def _is_tensor(arg: torch._C.Argument) -> bool:
    return "Tensor" in str(arg.type)  # Tensor, Tensor?, Tensor[]


def _entries(roles: Roles, name: str, value: object) -> list[tuple[str, OpStrategy]]:
    """``(role, strategy)`` per DTensor in argument ``name`` (each entry of a list)."""
    entries = value.children if isinstance(value, TupleStrategy) else [value]
    return [(roles.inputs[name], e) for e in entries if isinstance(e, OpStrategy)]


def _strategy(roles: Roles, op_schema: OpSchema) -> OpStrategy:
    """Every placement of the rows over the mesh (replicated or on a leading dim, per mesh dim),
    as DTensor's :class:`OpStrategy`: the specs each input must have and the outputs then get."""
    # (torch.library allows no keyword-only tensor: every tensor comes positionally, which DTensor
    # redistributes; keyword arguments are scalars)
    inputs = [
        e for a, v in zip(op_schema.op._schema.arguments, op_schema.args_schema) for e in _entries(roles, a.name, v)
    ]
    first = inputs[0][1]  # x (forward) or dy (backward): every tensor is a DTensor, as DTensor requires
    mesh, ndim = first.mesh, first.ndim
    choices = [Replicate(), *(Shard(d) for d in range(ndim - 1))]  # never the normalized (last) dim
    scalars = {a.name: v for a, v in zip(op_schema.op._schema.arguments, op_schema.args_schema)}
    if scalars.get("dropout_p", 0.0) > 0:  # the keep mask is a function of each row's index in the
        choices = [Replicate()]  # call: every rank holds all the rows (addnorm.ops asks for them)
    current = first.strategies[0].output_spec.placements
    specs = []
    for rows in itertools.product(choices, repeat=mesh.ndim):
        wanted = [
            DTensorSpec(mesh, _placements(role, rows), tensor_meta=s.strategies[0].output_spec.tensor_meta)
            for role, s in inputs
        ]
        if not all(is_tensor_shardable(spec.tensor_meta.shape, spec) for spec in wanted):
            continue
        outputs = tuple(DTensorSpec(mesh, _placements(role, rows)) for role in roles.outputs)
        costs = [generate_redistribute_costs(s, spec) for (_, s), spec in zip(inputs, wanted)]
        specs.append(OpSpec(outputs, wanted, costs))
    specs.sort(key=lambda spec: spec.input_specs[0].placements != current)  # a tie in cost: x's placement
    return OpStrategy(specs)


def _schema_info(op: torch._ops.OpOverload) -> RuntimeSchemaInfo:
    """Which arguments key DTensor's cache of sharding decisions: every scalar (``eps``, ``rms``,
    ``prenorm``, ... change the outputs' shapes or count) and every keyword argument."""
    arguments = op._schema.arguments
    positional = [i for i, a in enumerate(arguments) if not a.kwarg_only and not _is_tensor(a)]
    return RuntimeSchemaInfo(
        static_argnum=min(positional, default=len(arguments)),
        static_kwargkey=[a.name for a in arguments if a.kwarg_only] or None,
        needs_pytree=True,  # s_parts is a list of tensors
    )


_registered = False


def register() -> None:
    """Register the rules of :data:`ROLES` with DTensor (once; :mod:`addnorm.ops` calls this when
    it first sees a DTensor). A tensor argument without a role is an error here, not a wrong
    placement later."""
    global _registered
    if _registered:
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name, roles in ROLES.items():
        op = getattr(torch.ops.addnorm, name).default
        missing = [a.name for a in op._schema.arguments if _is_tensor(a) and a.name not in roles.inputs]
        if missing or len(op._schema.returns) != len(roles.outputs):
            raise TypeError(f"addnorm.sharding.ROLES[{name!r}] lacks a role for {missing or 'some outputs'}")
        propagator.register_op_strategy(op, partial(_strategy, roles), _schema_info(op))
    _registered = True


class SequenceParallel(ParallelStyle):
    """torch's :class:`~torch.distributed.tensor.parallel.SequenceParallel` for any of addnorm's
    modules, :class:`addnorm.AddNorm` included: every positional tensor input (``x`` and
    ``residual``) is taken as sharded on ``sequence_dim`` (a local tensor is wrapped as that
    shard, a DTensor redistributed to it), the parameters are replicated on the mesh (broadcast
    from the first rank, so any initialization is kept), and every output (``(y, s)`` for
    pre-norm) stays a DTensor sharded on ``sequence_dim``, or its local shard with
    ``use_local_output=True``. (torch's style takes the first input alone and replicates the
    module's direct parameters only: it suits :class:`addnorm.LayerNorm` and
    :class:`addnorm.RMSNorm`, not AddNorm.)"""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__()
        self.sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _inputs(self, module: torch.nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        def shard(t: object) -> object:
            if isinstance(t, DTensor):
                return t if t.placements == self.sharding else t.redistribute(mesh, self.sharding)
            if isinstance(t, torch.Tensor):
                return DTensor.from_local(t, mesh, self.sharding, run_check=False)
            return t

        return tuple(shard(t) for t in inputs)

    def _outputs(self, module: torch.nn.Module, outputs: object, mesh: DeviceMesh) -> object:
        if not self.use_local_output:
            return outputs
        return tuple(t.to_local() for t in outputs) if isinstance(outputs, tuple) else outputs.to_local()

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        # no partition function: distribute_module replicates every parameter (distribute_tensor)
        return distribute_module(module, device_mesh, None, self._inputs, self._outputs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_dim={self.sharding[0].dim}, use_local_output={self.use_local_output})"
