"""Tensors that are not plain strided tensors never reach a kernel's raw pointers.

Each kind gets a correct result or a clear error saying what is supported: strided and
expanded views (the results of their contiguous copies), jagged nested tensors (normalized over
their last dim, as torch's layer_norm), FakeTensor, DTensor (sharding rules),
``torch.jit.trace`` and ``torch.jit.script``, a pickled model. Sizes past 2**20 elements where
a size threshold could change the path.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as TF

import addnorm
from conftest import interpreted


def _views(*shape, generator):
    """A tensor of ``shape`` as a view that is not contiguous: every other element of a wider
    tensor (the last dim strided), or for 2-D shapes a transposed one."""
    if len(shape) == 2:
        return torch.randn(*shape[::-1], generator=generator).t()
    return torch.randn(*shape[:-1], 2 * shape[-1], generator=generator)[..., ::2]


@pytest.mark.parametrize("call", ["branch", "parallel"])
def test_strided_and_expanded_inputs_give_the_results_of_contiguous_copies(backend, call):
    """Every tensor argument as a view (strided, transposed, sliced out of a 2-D tensor, a weight
    expanded from one value): the same bits as the call on contiguous copies, outputs and
    gradients; 300x1024 past the threaded-blocks threshold, 6x64 through the interpreter."""
    g = torch.Generator().manual_seed(3)
    m, n = (6, 64) if interpreted(backend) else (300, 1024)
    args = {
        "x": _views(m, n, generator=g),
        "residual": torch.randn(m, 2 * n, generator=g)[:, n:],
        "weight": _views(n, generator=g),
        "bias": torch.randn(1, generator=g).expand(n),
    }
    if call == "branch":
        args["layer_scale"] = _views(n, generator=g)
        args["rowscale"] = torch.rand(m, 2, generator=g)[:, 0]
    else:
        args["x1"] = _views(m, n, generator=g)
        args["weight1"] = torch.ones(1).expand(n)
        args["bias1"] = _views(n, generator=g)
    assert not any(t.is_contiguous() for t in args.values())
    dy = [torch.randn(m, n, generator=g) for _ in range(3)]

    def run(tensors):
        leaves = {k: t.detach().requires_grad_(k != "rowscale") for k, t in tensors.items()}
        kwargs = {k: v for k, v in leaves.items() if k not in ("x", "residual", "weight", "bias")}
        outs = addnorm.add_layer_norm(
            leaves["x"],
            leaves["residual"],
            n,
            leaves["weight"],
            leaves["bias"],
            prenorm=True,
            dropout_p=0.25,
            generator=torch.Generator().manual_seed(5),
            backend=backend,
            **kwargs,
        )
        wanted = [t for k, t in leaves.items() if k != "rowscale"]
        return outs, torch.autograd.grad(outs, wanted, dy[: len(outs)])

    outs, grads = run(args)
    want_outs, want_grads = run({k: t.contiguous() for k, t in args.items()})
    for got, want in zip((*outs, *grads), (*want_outs, *want_grads), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [6, 2100])  # 2100 x 32: past the threaded blocks' threshold
@pytest.mark.parametrize("plan", ["rms", "post", "pre", "branch"])
def test_inputs_made_under_inference_mode_train_the_weights(backend, plan, rows):
    """Inputs made under ``torch.inference_mode`` (cached features), weights that learn: the
    weights' gradients equal those from ordinary copies of the inputs. (torch's RMSNorm takes
    them; an inference tensor cannot be saved for backward, so the op saves a copy.)"""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        x, r = torch.randn(rows, 32, generator=g), torch.randn(rows, 32, generator=g)
    grads = []
    for xs, rs in [(x, r), (x.clone(), r.clone())]:
        w, b = torch.ones(32, requires_grad=True), torch.zeros(32, requires_grad=True)
        if plan == "rms":
            y = addnorm.rms_norm(xs, 32, w, backend=backend)
        else:
            kw = dict(prenorm=plan == "pre", dropout_p=0.2 if plan == "branch" else 0.0)
            kw["generator"] = torch.Generator().manual_seed(1)
            y = addnorm.add_layer_norm(xs, rs, 32, w, b, backend=backend, **kw)
        y = y[0] if isinstance(y, tuple) else y
        grads.append(torch.autograd.grad((y * torch.arange(32.0)).sum(), [w, b], allow_unused=True))
    for a, e in zip(*grads, strict=True):
        assert (a is None and e is None) or torch.equal(a, e)


def test_jagged_nested_tensor_matches_torch_forward_and_backward(backend):
    g = torch.Generator().manual_seed(0)
    pieces = [torch.randn(n, 64, generator=g, dtype=torch.float64) for n in (3, 7, 1)]
    w = torch.randn(64, generator=g, dtype=torch.float64, requires_grad=True)
    outs = []
    for fn in (lambda t: addnorm.layer_norm(t, 64, w, backend=backend), lambda t: TF.layer_norm(t, (64,), w)):
        nt = torch.nested.nested_tensor([p.clone() for p in pieces], layout=torch.jagged, requires_grad=True)
        y = fn(nt)
        assert y.is_nested and y.layout == torch.jagged
        (y.values() * torch.arange(64)).sum().backward()
        outs.append((y.values().detach(), nt.grad.values(), w.grad.clone()))
        w.grad = None
    for ours, theirs in zip(*outs):
        torch.testing.assert_close(ours, theirs)


def test_jagged_nested_add_norm_prenorm():
    pieces = [torch.randn(n, 32) for n in (2, 5)]
    x = torch.nested.nested_tensor(pieces, layout=torch.jagged)
    r = torch.nested.nested_tensor_from_jagged(torch.randn_like(x.values()), x.offsets())
    y, s = addnorm.add_rms_norm(x, r, 32, prenorm=True)
    torch.testing.assert_close(s.values(), x.values() + r.values())
    torch.testing.assert_close(y.values(), TF.rms_norm(s.values(), (32,), eps=torch.finfo(torch.float32).eps))


def test_nested_tensors_other_than_jagged_last_dim_get_a_clear_error():
    strided = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)])
    with pytest.raises(TypeError, match="layout=torch.jagged, normalized over their last"):
        addnorm.layer_norm(strided, 8)


def test_fake_tensors_get_shapes_and_dtypes_without_running_a_kernel(backend):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(1100, 1024, dtype=torch.bfloat16)
        r = torch.empty(1100, 1024, dtype=torch.bfloat16)
        y, s = addnorm.add_layer_norm(x, r, 1024, prenorm=True, residual_dtype=torch.float32, backend=backend)
    assert y.shape == (1100, 1024) and y.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_fake_mode_over_real_tensors_and_make_fx_see_the_op(backend):
    """Under a Python dispatch mode (make_fx, FakeTensorMode over real inputs, FlopCounterMode,
    selective checkpointing) a call goes through the custom op, which the mode sees: make_fx
    records it, FakeTensorMode returns fake results (the CPU kernels ran on real pointers there,
    out of the mode's sight: a wrong graph, or a crash on a fake output)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(8, generator=g)
    gm = make_fx(lambda x, r, w: addnorm.add_layer_norm(x, r, 8, w, backend=backend))(x, r, w)
    assert "addnorm.forward" in gm.code
    assert torch.equal(gm(x, r, w), addnorm.add_layer_norm(x, r, 8, w, backend=backend))
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = addnorm.add_layer_norm(x, r, 8, w, backend=backend)
    assert isinstance(y, FakeTensor) and y.shape == x.shape
    # parallel blocks: x1 and the second norm
    parallel = lambda x, r, w: addnorm.add_layer_norm(  # noqa: E731
        x, r, 8, w, x1=x.flip(0), weight1=w.flip(0), prenorm=True, backend=backend
    )
    gm = make_fx(parallel)(x, r, w)
    assert "addnorm.forward" in gm.code
    assert all(torch.equal(a, b) for a, b in zip(gm(x, r, w), parallel(x, r, w), strict=True))


def test_negated_views_and_zero_tensors_are_read_as_their_values(backend):
    """A lazily negated view (its negation a bit of the tensor, not in memory) and autograd's
    ZeroTensor (no memory at all) give the values they stand for, as torch's ops read them."""
    g = torch.Generator().manual_seed(0)
    x, r, w, b = (torch.randn(*s, generator=g) for s in ((4, 8), (4, 8), (8,), (8,)))
    expected = TF.layer_norm(-x + r, (8,), -w, -b)
    got = addnorm.add_layer_norm(torch._neg_view(x), r, 8, torch._neg_view(w), torch._neg_view(b), backend=backend)
    torch.testing.assert_close(got, expected)
    xg = x.clone().requires_grad_()
    y = addnorm.add_layer_norm(xg, r, 8, w, backend=backend)
    y.backward(torch._efficientzerotensor((4, 8)))
    assert torch.equal(xg.grad, torch.zeros(4, 8))
    zero_weight = torch._efficientzerotensor(8)
    assert torch.equal(addnorm.layer_norm(x, 8, zero_weight, b, backend=backend), b.expand(4, 8))


@pytest.mark.parametrize("rows", [4, pytest.param(1100, marks=pytest.mark.large)])  # 1100 x 96: threaded blocks
def test_a_default_device_changes_no_allocation_of_a_cpu_call(backend, rows):
    """``torch.set_default_device`` (or a ``with torch.device(...)`` block) changes where
    device-less factory calls allocate: a CPU call's outputs, statistics and gradients (the
    threaded backward's partial rows too) stay on the CPU (the kernels wrote through a meta
    tensor's null pointer)."""
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(rows, 96, generator=g, requires_grad=True), torch.randn(rows, 96, generator=g)
    w = torch.randn(96, generator=g, requires_grad=True)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    expected = TF.layer_norm(xd + r.double(), (96,), wd)  # float64: dweight sums 1100 rows
    with torch.device("meta"):
        y = addnorm.add_layer_norm(x, r, 96, w, backend=backend)
        dx, dw = torch.autograd.grad(y, (x, w), torch.ones(rows, 96, device="cpu"))
        plain = addnorm.layer_norm(x.detach(), 96, backend=backend)  # (no weight: a constant row of ones)
    torch.testing.assert_close(y, expected.float())
    oracle = torch.autograd.grad(expected, (xd, wd), torch.ones(rows, 96, dtype=torch.float64))
    torch.testing.assert_close((dx.double(), dw.double()), oracle, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain, TF.layer_norm(x.detach(), (96,)))


def test_a_subclass_buffer_overlapping_its_input_is_refused(backend):
    """A subclass viewing the same memory (``as_subclass``) is checked for overlap as a plain
    tensor is: the kernels would overwrite rows they have yet to read."""

    class Sub(torch.Tensor):
        pass

    base = torch.randn(5, 8)
    with pytest.raises(ValueError, match="out overlaps x"):
        addnorm.layer_norm(base[:-1].as_subclass(Sub), 8, out=base[1:].as_subclass(Sub), backend=backend)


@pytest.mark.parametrize("backend_name", ["cpu", "auto"])
def test_jit_trace_at_size_records_the_custom_op(backend_name):
    """1100 x 1024 (past 2**20 elements): traced shapes never reach a kernel as pointers."""
    ln = addnorm.LayerNorm(1024, backend=backend_name)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    x = torch.randn(1100, 1024)
    with warnings.catch_warnings():  # (the argument checks compare the example's sizes: no TracerWarning)
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(ln, x, check_trace=False)
    assert "addnorm::forward" in str(traced.graph)
    other = torch.randn(300, 1024) * 50 + 1e4  # replayed on another shape and scale
    with torch.no_grad():
        for t in (x, other):
            oracle = TF.layer_norm(t.double(), (1024,), ln.weight.double(), ln.bias.double())
            torch.testing.assert_close(traced(t).double(), oracle, rtol=1.3e-6, atol=1e-5)


class _FxBlock(torch.nn.Module):
    """A pre-norm step, a torch norm (patched below) and a functional call, as a traced model has them."""

    def __init__(self):
        super().__init__()
        self.lin, self.add = torch.nn.Linear(16, 16), addnorm.AddNorm(16, prenorm=True)
        self.rms, self.ln = addnorm.RMSNorm(16), torch.nn.LayerNorm(16)

    def forward(self, x, r):
        y, s = self.add(self.lin(x), r)
        return self.ln(self.rms(y) + addnorm.add_rms_norm(y, s, 16)) + addnorm.functional.layer_norm(s, 16)


def test_fx_symbolic_trace_records_each_norm_as_one_node():
    """torch.fx records torch's norm modules as leaves; addnorm's functions are recorded as one
    call each (the modules and a patched torch norm call them), and the graph computes the
    model's outputs and gradients."""
    model = _FxBlock()
    addnorm.patch(model)
    graph_module = torch.fx.symbolic_trace(model)
    calls = [n.target.__name__ for n in graph_module.graph.nodes if n.op == "call_function" and "norm" in str(n.target)]
    assert calls == ["add_layer_norm", "rms_norm", "add_rms_norm", "layer_norm", "layer_norm"]
    x, r = torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    model, graph_module = model.double(), graph_module.double()
    inputs = [t.clone().requires_grad_() for t in (x, r, x, r)]
    want, got = model(*inputs[:2]), graph_module(*inputs[2:])
    assert torch.equal(got, want)
    ours = torch.autograd.grad(got.sum(), inputs[2:] + list(graph_module.parameters()))
    theirs = torch.autograd.grad(want.sum(), inputs[:2] + list(model.parameters()))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    # an independent oracle: the same model as torch ops
    eps = torch.finfo(torch.float64).eps
    s = x @ model.lin.weight.T + model.lin.bias + r
    y = TF.layer_norm(s, (16,), model.add.norm.weight, model.add.norm.bias, 1e-5)
    z = TF.rms_norm(y, (16,), model.rms.weight, eps) + TF.rms_norm(y + s, (16,), None, eps)
    oracle = TF.layer_norm(z, (16,), model.ln.weight, model.ln.bias, 1e-5) + TF.layer_norm(s, (16,))
    torch.testing.assert_close(got, oracle, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm", "AddNorm"])
def test_a_graph_module_rooted_at_a_module_pickles(module):
    """A GraphModule traced from one of addnorm's modules (as from torch's) pickles and loads,
    with the module's outputs: torch.fx writes forward's annotations into its code."""
    import pickle

    model = getattr(addnorm, module)(16)
    graph_module = pickle.loads(pickle.dumps(torch.fx.symbolic_trace(model)))
    x, r = torch.randn(4, 16), torch.randn(4, 16)
    args = (x, r) if module == "AddNorm" else (x,)
    assert torch.equal(graph_module(*args), model(*args))


def test_a_graph_module_rooted_at_a_patched_norm_pickles():
    """A Hugging Face norm class patched by addnorm (Llama's RMSNorm, its forward addnorm's) as
    the root of a GraphModule: it pickles and loads, with the traced graph's outputs (the model's
    own formula, which a patched norm runs while torch.fx traces it)."""
    import pickle

    transformers = pytest.importorskip("transformers")
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    addnorm.patch(norm)
    assert type(norm).__module__.startswith("addnorm")
    traced = torch.fx.symbolic_trace(norm)
    loaded = pickle.loads(pickle.dumps(traced))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(x), traced(x))
    torch.testing.assert_close(loaded(x), TF.rms_norm(x, (16,), norm.weight, 1e-6), rtol=1e-6, atol=1e-6)


def test_fx_traces_a_patched_hugging_face_norm_as_the_models_own():
    """A norm class patch() made for a model (Llama's, Gemma's) traces as the model's own forward,
    which computes the same."""
    transformers = pytest.importorskip("transformers")
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(16, eps=1e-6)
    gemma = transformers.models.gemma.modeling_gemma.GemmaRMSNorm(16, eps=1e-6)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), norm, gemma)
    with torch.no_grad():
        norm.weight.normal_(), gemma.weight.normal_()
    x = torch.randn(3, 16)
    want = model(x)
    addnorm.patch(model)
    graph_module = torch.fx.symbolic_trace(model)
    torch.testing.assert_close(graph_module(x), want)
    torch.testing.assert_close(model(x), want)


def test_fx_traces_a_fused_block_as_the_models_own():
    """A block patch(fuse_residual=True) gave a fused forward traces as its own forward."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=1)
    bert = transformers.BertModel(config).eval()

    class Holder(torch.nn.Module):  # (a fused block's forward takes *args: it is traced inside a model)
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x, r):
            return self.block(x, r)

    model = Holder(bert.encoder.layer[0].attention.output)  # dense, dropout, LayerNorm(h + input)
    x, r = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    want = model(x, r)
    addnorm.patch(bert, fuse_residual=True)
    assert type(model.block).__name__.startswith("Addnorm")
    torch.testing.assert_close(torch.fx.symbolic_trace(model)(x, r), want)


def test_fx_proxy_reaching_the_checks_says_what_to_do():
    from addnorm import layer_norm  # (a name bound outside addnorm's namespaces: traced into)

    class Model(torch.nn.Module):
        def forward(self, x):
            return layer_norm(x, 8)

    with pytest.raises(TypeError, match=r"x is a torch.fx Proxy.*torch.fx.wrap"):
        torch.fx.symbolic_trace(Model())


def test_layer_norm_takes_its_input_by_torchs_keyword():
    x = torch.randn(3, 8)
    norm = torch.nn.LayerNorm(8)
    want = norm(input=x)
    addnorm.patch(norm)
    torch.testing.assert_close(norm(input=x), want)
    torch.testing.assert_close(addnorm.LayerNorm(8)(input=x), TF.layer_norm(x, (8,)))


def test_jit_script_points_to_torch_compile():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), addnorm.LayerNorm(8))
    with pytest.raises(TypeError, match="torch.jit.script.*torch.compile"):
        torch.jit.script(model)


def test_pickled_model_round_trips(tmp_path):
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 16), addnorm.RMSNorm(16, backend="cpu"), addnorm.AddNorm(16, prenorm=True)
    )
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    again = pickle.loads(pickle.dumps(model))
    x, r = torch.randn(4, 16), torch.randn(4, 16)
    for m in (loaded, again):
        torch.testing.assert_close(m[1](m[0](x)), model[1](model[0](x)), rtol=0, atol=0)
        torch.testing.assert_close(m[2](x, r), model[2](x, r), rtol=0, atol=0)


_DTENSOR = textwrap.dedent("""
    import copy, os, torch, torch.distributed as dist, addnorm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_module, distribute_tensor, Shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    ln = addnorm.LayerNorm(1024)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    # first compiled (the rules then get registered while torch.compile traces), then eager
    add_norm = addnorm.AddNorm(1024, norm="rms", prenorm=True)
    compiled = torch.compile(distribute_module(copy.deepcopy(add_norm), mesh), fullgraph=True, backend="aot_eager")
    x, r, dy = torch.randn(1100, 1024), torch.randn(1100, 1024), torch.randn(1100, 1024)
    sharded = [distribute_tensor(t, mesh, [Shard(0)]) for t in (x, r)]
    for ours, plain in zip(compiled(*sharded), add_norm(x, r)):
        assert ours.placements == (Shard(0),)
        torch.testing.assert_close(ours.full_tensor(), plain)
    grads = []
    for sharded in (False, True):
        norm = distribute_module(copy.deepcopy(ln), mesh) if sharded else ln  # parameters replicated
        t = distribute_tensor(x, mesh, [Shard(0)]) if sharded else x.clone()
        y = norm(t.requires_grad_())
        y.backward(distribute_tensor(dy, mesh, y.placements) if sharded else dy)
        grads.append([y.detach(), t.grad, norm.weight.grad, norm.bias.grad])
    print("RESULT", type(y).__name__, y.placements)
    for ours, plain in zip(grads[1], grads[0]):
        torch.testing.assert_close(ours.full_tensor(), plain)
    try:
        addnorm.layer_norm(y.detach(), 1024, out=torch.empty(1100, 1024))
    except ValueError as err:
        print("ERROR", err)
    dist.destroy_process_group()
""")


def test_dtensor_runs_the_sharding_rules_never_the_raw_pointer_path():
    """A DTensor goes through the custom op, where DTensor's dispatch applies addnorm's sharding
    rules (addnorm.sharding) and runs the kernels on the local shard, never a kernel reading the
    DTensor's own pointers: the result is a DTensor of the input's placement, with the plain
    tensor's values and gradients. In a child process, so that a crash fails this test instead
    of the run (tests/test_distributed.py runs the rules across ranks)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PORT": str(port), "PYTHONPATH": str(Path(addnorm.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", _DTENSOR], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("RESULT", "ERROR"))]
    assert lines == ["RESULT DTensor (Shard(dim=0),)", "ERROR out= and residual_out= take plain tensors, not DTensors"]
