"""addnorm.patch / unpatch on Hugging Face and plain torch models, against the unpatched model."""

from __future__ import annotations

import copy
import importlib
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import addnorm
from addnorm.patch import HF_NORMS, norm_style
from addnorm.patch.hf_norms import hf_path, pairs
from addnorm.patch.norms import MEAN_STYLES
from conftest import SAME_BITS_AS_TORCH
from tiny_models import WIDTH, TinyTransformer, assert_same_step, hf_inputs, hf_model, round_trip, step

patch_module = sys.modules["addnorm.patch"]  # addnorm.patch is the function
norms_module = sys.modules["addnorm.patch.norms"]

pytest.importorskip("transformers")

NORM_COUNTS = {"gpt2": 5, "bert": 6, "vit": 5, "llama": 5, "gemma": 5}  # counted in each model's code


@pytest.mark.parametrize("name", list(NORM_COUNTS))
def test_hf_model_logits_and_grads_match(backend, name):
    original = hf_model(name)
    patched = copy.deepcopy(original)
    params = list(patched.parameters())
    report = addnorm.patch(patched, backend=backend)
    assert len(report.replaced) == NORM_COUNTS[name] and not report.skipped
    assert [p for p in patched.parameters()] == params  # the same Parameter objects
    assert all(norm_style(patched.get_submodule(n)) == s for n, _, s in report.replaced)
    assert_same_step(original, patched, hf_inputs(name))


@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma"])
def test_bf16_logits_bitwise_equal_with_reference(name):
    # the reference does torch's float32 ops in the model's order, so a cast in the wrong
    # place (LlamaRMSNorm casts before the weight, Gemma after 1 + w) changes the bits
    original = hf_model(name, torch.bfloat16)
    patched = copy.deepcopy(original)
    addnorm.patch(patched, backend="reference")
    inputs = hf_inputs(name)
    with torch.no_grad():
        assert torch.equal(patched(**inputs).logits, original(**inputs).logits)


def _hf_class(path):
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # a model the installed transformers does not have
        return None


# the table's entries the installed transformers has (patch never matches the others); the
# classes of transformers 5.0 must all be there
PRESENT = [p for p in sorted(HF_NORMS) if _hf_class(p) is not None]
SINCE_5_0 = ["llama.LlamaRMSNorm", "gemma3.Gemma3RMSNorm", "olmo2.Olmo2RMSNorm", "t5.T5LayerNorm"]
SINCE_5_0 += ["cohere.CohereLayerNorm", "olmo.OlmoLayerNorm", "deepseek_v3.DeepseekV3RMSNorm", "gpt_oss.GptOssRMSNorm"]
# weight dtype, input dtype: the styles differ in where they cast when the two differ
DTYPES = [(d, d) for d in (torch.float32, torch.bfloat16, torch.float16)]
DTYPES += [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]


def test_the_norm_table_s_classes_are_installed():
    for m, c in pairs(" ".join(SINCE_5_0)):
        assert hf_path(m, c) in PRESENT, (m, c)


@pytest.mark.parametrize("path", PRESENT)
def test_every_known_hf_norm_matches_its_class(path):
    style = HF_NORMS[path]
    unweighted = style in ("olmo", "nanochat")  # (no parameters)
    norm = (
        _hf_class(path)(48)
        if style in ("olmo", "moonshine")  # (MoonshineStreamingLayerNorm's eps: its LayerNorm's default)
        else _hf_class(path)(eps=1e-6)
        if unweighted
        else _hf_class(path)(48, eps=1e-6)
    )
    weight = "gamma" if style == "moonshine" else "weight"
    if not unweighted:
        with torch.no_grad():
            getattr(norm, weight).normal_(0.2, 0.5)
            if style in ("deberta", "nemotron"):
                norm.bias.normal_(0.0, 0.5)
    ours = copy.deepcopy(norm)
    report = addnorm.patch(ours, backend="reference")
    assert report.replaced == [("", type(norm).__name__, style)]
    x = torch.randn(5, 7, 48) * 3 + 1
    for weight_dtype, x_dtype in DTYPES:
        a, b = norm.to(weight_dtype), ours.to(weight_dtype)
        try:
            want = a(x.to(x_dtype))
        except RuntimeError:  # torch's layer_norm refuses some mixes (CPU: a bf16 weight on a float32
            assert style in ("nemotron", "layer") and weight_dtype != x_dtype  # input; CUDA: either): nothing to match
            continue
        got = b(x.to(x_dtype))
        assert got.dtype == want.dtype, (weight_dtype, x_dtype)
        if style in MEAN_STYLES or not SAME_BITS_AS_TORCH:  # torch's mean and variance, summed in
            # another order: where a 16-bit rounding follows (the output's, or a 16-bit LayerNorm's
            # inside the class), it may flip by an ulp of that dtype
            ulp = max(torch.finfo(d).eps for d in (weight_dtype, x_dtype))
            tol = {} if ulp < 1e-6 else dict(rtol=2 * ulp, atol=2 * ulp)
            torch.testing.assert_close(got, want, **tol, msg=lambda m, d=(weight_dtype, x_dtype): f"{d}: {m}")
        else:  # the reference's float32 ops are the class's own, in its order: the same bits
            assert torch.equal(got, want), (weight_dtype, x_dtype)
    norm.float(), ours.float()
    xa, xb = (x.clone().requires_grad_() for _ in range(2))
    dy = torch.randn_like(x)
    norm(xa).backward(dy)
    ours(xb).backward(dy)
    torch.testing.assert_close(xb.grad, xa.grad)
    if not unweighted:
        torch.testing.assert_close(getattr(ours, weight).grad, getattr(norm, weight).grad)
    if style in ("deberta", "nemotron"):
        torch.testing.assert_close(ours.bias.grad, norm.bias.grad)


def test_unpatch_restores_classes_and_outputs():
    original = hf_model("llama")
    model = copy.deepcopy(original)
    classes = {n: type(m) for n, m in model.named_modules()}
    report = addnorm.patch(model, fuse_residual=True)
    assert len(report.fused) == 2
    assert addnorm.unpatch(model) == len(report.replaced) + len(report.fused)
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert not any("backend" in m.__dict__ for m in model.modules())
    assert_same_step(original, model, hf_inputs("llama"), exact=True)


def test_unpatch_keeps_a_parametrization_made_after_patching():
    """torch's parametrize gives the module a class of its own made from the patched one: unpatch
    makes the same from the original class, so the parametrized weight stays (and can be removed)."""
    import torch.nn.utils.parametrize as parametrize

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    original = hf_model("llama")
    model = copy.deepcopy(original)
    addnorm.patch(model)
    for m in (original, model):
        parametrize.register_parametrization(m.model.norm, "weight", Doubled())
    addnorm.unpatch(model)
    norm = model.model.norm
    assert type(norm).__name__ == "ParametrizedLlamaRMSNorm" and parametrize.is_parametrized(norm, "weight")
    assert_same_step(original, model, hf_inputs("llama"), exact=True)
    parametrize.remove_parametrizations(norm, "weight")
    assert type(norm) is type(original.model.layers[0].input_layernorm)


def test_patch_is_idempotent_and_keeps_optimizer_working():
    model = hf_model("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = addnorm.patch(model)
    assert addnorm.patch(model).replaced == [] and len(first.replaced) == 5
    again = addnorm.patch(model, backend="reference")  # another backend: the norms take it
    assert again.replaced == first.replaced and {m.backend for m in model.modules() if "backend" in vars(m)} == {
        "reference"
    }
    addnorm.patch(model)
    before = model.transformer.ln_f.weight.detach().clone()
    step(model, hf_inputs("gpt2"))
    opt.step()  # the optimizer built before patching updates the norms' weights
    assert not torch.equal(model.transformer.ln_f.weight, before)


def test_plain_torch_model_norms_device_dtype_and_state_dict():
    torch.manual_seed(0)
    original = TinyTransformer(layer=nn.LayerNorm, rms=lambda n: nn.RMSNorm(n, eps=1e-6)).double()
    model = copy.deepcopy(original)
    report = addnorm.patch(model)
    assert sorted(s for _, _, s in report.replaced) == ["layer", "layer", "rms", "rms"]
    assert type(model.blocks[0].norm1) is addnorm.LayerNorm and type(model.blocks[1].norm1) is addnorm.RMSNorm
    assert model.blocks[1].norm2.weight.dtype == torch.float64
    assert model.state_dict().keys() == original.state_dict().keys()
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model(ids), original(ids), rtol=1e-12, atol=1e-12)


class MyRMSNorm(nn.Module):
    """A Llama-style norm addnorm does not know (at module level: models holding it pickle)."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)
        self.variance_epsilon = 1e-6

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def test_norm_types_selects_and_extends():
    model = nn.Sequential(nn.LayerNorm(16), nn.RMSNorm(16), MyRMSNorm(16))
    report = addnorm.patch(copy.deepcopy(model))
    assert [n for n, _, _ in report.replaced] == ["0", "1"]
    assert report.skipped == [("2", "MyRMSNorm", "unknown norm class; see norm_types")]
    only_rms = copy.deepcopy(model)
    assert [n for n, _, _ in addnorm.patch(only_rms, norm_types=[nn.RMSNorm]).replaced] == ["1"]
    assert type(only_rms[0]) is nn.LayerNorm
    custom = copy.deepcopy(model)
    report = addnorm.patch(custom, norm_types={MyRMSNorm: "llama"})
    assert report.replaced == [("2", "MyRMSNorm", "llama")] and isinstance(custom[2], MyRMSNorm)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(custom[2].to(torch.bfloat16)(x), model[2].to(torch.bfloat16)(x))


class OptionNorm(MyRMSNorm):
    """MyRMSNorm with the options some Hugging Face norms of the table have: by default it computes
    the Llama style; with any of them set, something else (here: the option is simply refused)."""

    def __init__(self, n, *, group_size=None, bias=False, force_float32_reductions=True):
        super().__init__(n)
        self.group_size, self.force_float32_reductions = group_size, force_float32_reductions
        self.bias = nn.Parameter(torch.zeros(n)) if bias is True else None
        if bias == "buffer":
            self.register_buffer("offset", torch.zeros(n))


@pytest.mark.parametrize(
    "options, why",
    [
        (dict(group_size=4), "group_size=4 changes what it computes"),
        (dict(force_float32_reductions=False), "force_float32_reductions=False changes what it computes"),
        (dict(bias=True), "has 'bias' besides 'weight', which style 'llama' does not compute with"),
        (dict(bias="buffer"), "has 'offset' besides 'weight', which style 'llama' does not compute with"),
    ],
)
def test_norms_with_options_no_style_computes_are_left_alone(options, why):
    model = nn.Sequential(OptionNorm(16), OptionNorm(16, **options))
    report = addnorm.patch(model, norm_types={OptionNorm: "llama"})
    assert [n for n, _, _ in report.replaced] == ["0"] and report.skipped == [("1", "OptionNorm", why)]
    assert type(model[1]) is OptionNorm


def test_olmo_style_takes_olmo_s_epsilon_only():
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    class EpsNorm(OlmoLayerNorm):
        eps = 1e-6

    model = nn.Sequential(OlmoLayerNorm(8), EpsNorm(8))
    report = addnorm.patch(model, norm_types={OlmoLayerNorm: "olmo", EpsNorm: "olmo"})
    assert [n for n, _, _ in report.replaced] == ["0"]
    assert report.skipped == [
        ("1", "EpsNorm", "style 'olmo' computes with eps 1e-05 (OlmoLayerNorm's), the module's is 1e-06")
    ]


def test_the_parameterless_rms_style_refuses_a_norm_with_parameters_or_buffers():
    """Style "nanochat" (NanoChatRMSNorm: no weight) computes no parameter and no buffer: a norm
    holding one (Falcon-Mamba's weightless norm keeps a buffer of ones) is left alone, by name."""
    from transformers.models.nanochat.modeling_nanochat import NanoChatRMSNorm

    class Weighted(NanoChatRMSNorm):
        def __init__(self):
            super().__init__(eps=1e-6)
            self.weight = nn.Parameter(torch.ones(8))

    class Buffered(NanoChatRMSNorm):
        def __init__(self):
            super().__init__(eps=1e-6)
            self.register_buffer("ones", torch.ones(8), persistent=False)

    model = nn.Sequential(NanoChatRMSNorm(eps=1e-6), Weighted(), Buffered())
    report = addnorm.patch(model, norm_types={NanoChatRMSNorm: "nanochat", Weighted: "nanochat", Buffered: "nanochat"})
    assert [n for n, _, _ in report.replaced] == ["0"]
    why = "expected a float 'eps' and no parameters or buffers"
    assert report.skipped == [("1", "Weighted", why), ("2", "Buffered", why)]
    x = torch.randn(3, 8)
    torch.testing.assert_close(model[0](x), x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize(
    "path", ["gemma4.Gemma4RMSNorm", "gemma4_unified.Gemma4UnifiedRMSNorm", "gemma3n.Gemma3nRMSNorm"]
)
def test_a_gemma_norm_built_without_its_weight_runs_the_parameterless_style(path):
    """Gemma 4's and Gemma 3n's RMSNorm with ``with_scale=False`` (Gemma 4's ``v_norm``) has no
    weight: it runs style "nanochat", ``x̂.to(x.dtype)``, in every dtype, its gradient torch's."""
    cls = _hf_class(hf_path(*path.split(".")))
    if cls is None:
        pytest.skip(f"this transformers has no {path}")
    norm = cls(48, eps=1e-6, with_scale=False)
    ours = copy.deepcopy(norm)
    assert addnorm.patch(ours).replaced == [("", cls.__name__, "nanochat")]
    x = torch.randn(5, 7, 48) * 3 + 1
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want, got = norm(x.to(dtype)), ours(x.to(dtype))
        assert got.dtype == dtype
        torch.testing.assert_close(got, want)
    xa, xb = (x.clone().requires_grad_() for _ in range(2))
    dy = torch.randn_like(x)
    norm(xa).backward(dy)
    ours(xb).backward(dy)
    torch.testing.assert_close(xb.grad, xa.grad)


def _wrap_forward(module: nn.Module, calls: list) -> None:
    """Set a forward on the module itself, as accelerate's hooks do (to load offloaded weights
    before the class's forward runs)."""
    original = module.forward

    def forward(*args, **kwargs):
        calls.append(module)
        return original(*args, **kwargs)

    module.forward = forward


def test_modules_with_a_forward_of_their_own_are_left_alone():
    """A module wrapped before patching: changing its class would change nothing, so it is reported."""
    model = hf_model("llama")
    calls = []
    for m in model.modules():
        if type(m).__name__ in ("LlamaRMSNorm", "LlamaDecoderLayer"):
            _wrap_forward(m, calls)
    report = addnorm.patch(model, fuse_residual=True)
    assert report.replaced == [] and report.fused == []
    assert len(report.skipped) == 7 and all("replaced on the module itself" in why for _, _, why in report.skipped)


def test_a_norm_wrapped_after_patching_is_called_not_fused():
    """A norm wrapped after fuse_residual=True (accelerate's offloading) is called, its wrapper
    first, instead of computed inside the block or handed its output."""
    original = hf_model("llama")
    model = copy.deepcopy(original)
    addnorm.patch(model, fuse_residual=True)
    calls = []
    norms = [m for n, m in model.named_modules() if n.endswith("norm")]
    for norm in norms:
        _wrap_forward(norm, calls)
    assert_same_step(original, model, hf_inputs("llama"))
    assert sorted(map(id, calls)) == sorted(map(id, norms))  # each norm called once, through its wrapper


class ScaledNorm(nn.LayerNorm):
    """A subclass of torch's LayerNorm with its own forward, and no "LayerNorm" in its name."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_known_norms_left_out_by_norm_types_keep_their_blocks_as_they_are():
    """A norm addnorm knows but ``norm_types`` leaves out is reported as such, not as unknown;
    blocks none of whose adds can then be fused keep their own forward."""
    model = hf_model("llama")
    report = addnorm.patch(model, norm_types=[nn.LayerNorm], fuse_residual=True)
    assert report.replaced == [] and report.fused == [] and report.skipped
    assert {why for _, _, why in report.skipped} == {"a norm addnorm knows, left out by norm_types"}
    assert report.adds and not report.fused_adds
    assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in model.model.layers)


def test_a_second_patch_reports_what_the_first_did_and_an_empty_model_warns():
    model = hf_model("gpt2")
    first = addnorm.patch(model, fuse_residual=True)
    again = addnorm.patch(model, fuse_residual=True)
    assert not again.replaced and not again.adds
    assert len(again.already) == len(first.replaced) + len(first.fused)
    assert f"{len(again.already)} module(s) patched by an earlier call" in str(again)
    with pytest.warns(UserWarning, match="no norm found in the Sequential"):
        addnorm.patch(nn.Sequential(nn.Linear(4, 4)))


def test_a_layer_list_patched_itself_fuses_each_layer_s_last_add_into_the_next():
    """patch() on a ModuleList (the layers of a model, no final norm above them): each layer's last
    add runs in the next layer's first norm, the last layer's stays plain; T5's block list, whose
    items hold lists of their own, too."""
    model = hf_model("llama")
    layers = model.model.layers
    report = addnorm.patch(layers, fuse_residual=True)
    assert [(a.block, a.add, a.norm) for a in report.adds if a.add == "mlp"] == [
        ("0", "mlp", "1.input_layernorm"),
        ("1", "mlp", None),
    ]
    t5 = hf_model("t5")
    original = copy.deepcopy(t5)
    report = addnorm.patch(t5.encoder.block, fuse_residual=True)
    assert ("0.layer.1", "DenseReluDense", "1.layer.0.layer_norm") in [(a.block, a.add, a.norm) for a in report.adds]
    assert_same_step(original, t5, hf_inputs("t5"))


def test_a_channels_first_layer_norm_is_refused_whatever_norm_types_says():
    """ConvNeXt's LayerNorm with ``data_format="channels_first"`` normalizes the channel dim of an
    image: no style computes that, so asking for style "layer" leaves it alone and says why."""
    from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm

    model = nn.Sequential(ConvNextLayerNorm(8, data_format="channels_first"), ConvNextLayerNorm(8))
    report = addnorm.patch(model, norm_types={ConvNextLayerNorm: "layer"})
    assert [n for n, _, _ in report.replaced] == ["1"]
    assert report.skipped == [
        ("0", "ConvNextLayerNorm", "data_format='channels_first' normalizes another dim than the last")
    ]
    x = torch.randn(2, 8, 8, 8)
    assert torch.equal(model[0](x), ConvNextLayerNorm(8, data_format="channels_first")(x))


def test_layers_named_after_their_norms_are_not_reported_as_norms():
    """wav2vec 2.0's stable-layer-norm layout has an encoder, layers and conv layers named
    "...LayerNorm...": only its norms are reported, each once."""
    import transformers as tf

    config = tf.Wav2Vec2Config(
        hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * WIDTH,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), vocab_size=16, num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4, do_stable_layer_norm=True, feat_extract_norm="layer",
    )  # fmt: skip
    report = addnorm.patch(tf.Wav2Vec2ForCTC(config), fuse_residual=True)
    assert not [s for s in report.skipped if "norm_types" in s[2]]
    assert len({name for name, _, _ in report.skipped}) == len(report.skipped)


def test_subclasses_of_torch_norms_are_reported_as_skipped():
    model = nn.Sequential(nn.LayerNorm(8), ScaledNorm(8), nn.Linear(8, 8))
    report = addnorm.patch(model)
    assert [n for n, _, _ in report.replaced] == ["0"]
    assert report.skipped == [("1", "ScaledNorm", "unknown norm class; see norm_types")]


def test_patched_models_pickle():
    llama = hf_model("llama").eval()
    report = addnorm.patch(llama, fuse_residual=True)
    assert len(report.fused) == 2
    loaded = round_trip(llama)
    inputs = hf_inputs("llama")
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, llama(**inputs).logits)
    layer = loaded.model.layers[0]
    assert type(layer).__name__ == "AddnormLlamaDecoderLayer" and type(layer) is not type(llama.model.layers[0])
    assert norm_style(layer.post_attention_layernorm) == "llama"
    assert addnorm.unpatch(loaded) == len(report.replaced) + len(report.fused)
    assert type(loaded.model.layers[0]).__name__ == "LlamaDecoderLayer"

    custom = nn.Sequential(nn.Linear(16, 16), MyRMSNorm(16), nn.LayerNorm(16))
    addnorm.patch(custom, norm_types={MyRMSNorm: "llama", nn.LayerNorm: "layer"})
    loaded = round_trip(custom)
    x = torch.randn(3, 16)
    assert torch.equal(loaded(x), custom(x)) and isinstance(loaded[1], MyRMSNorm)
    assert norm_style(loaded[1]) == "llama" and loaded[1].backend == "auto"


def test_bad_arguments():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        addnorm.patch("gpt2")
    with pytest.raises(ValueError, match="backend must be one of"):
        addnorm.patch(nn.LayerNorm(4), backend="cuda")
    with pytest.raises(ValueError, match=r"norm_types\[Linear\] must be one of"):
        addnorm.patch(nn.Linear(2, 2), norm_types={nn.Linear: "batch"})
    with pytest.raises(ValueError, match="not a norm addnorm knows"):
        addnorm.patch(nn.Linear(2, 2), norm_types=[nn.Linear])
    with pytest.raises(TypeError, match="norm_types must be"):
        addnorm.patch(nn.Linear(2, 2), norm_types="LayerNorm")
    with pytest.raises(TypeError, match="fuse_residual must be a bool"):
        addnorm.patch(nn.Linear(2, 2), fuse_residual="yes")


# --------------------------------------------------------------------------- residual fusion


@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_gives_identical_outputs(name, dtype, monkeypatch):
    unfused = hf_model(name, dtype)
    addnorm.patch(unfused, backend="reference")
    fused = copy.deepcopy(unfused)
    report = addnorm.patch(fused, fuse_residual=True, backend="reference")
    assert len(report.fused) == 2 and not report.skipped
    calls = []
    real = norms_module.add_norm
    spy = lambda x, r, *a, **k: calls.append(r is not None) or real(x, r, *a, **k)
    monkeypatch.setattr(norms_module, "add_norm", spy)
    # the fused backward adds the norm's and the stream's gradients in float32 and rounds once,
    # where the unfused graph rounds each to bf16 first: bf16 gradients may differ in the last bit
    assert_same_step(unfused, fused, hf_inputs(name), exact=True, exact_grads=dtype == torch.float32)
    assert calls.count(True) == 4  # both adds of each block, the last into the final norm, forward only


def test_generation_fuses_the_prompt_and_runs_decode_steps_unfused(monkeypatch):
    """With ``INFERENCE_FUSE_MIN_ELEMENTS`` between a prompt's stream and a decode step's, cached
    greedy generation fuses the prompt's adds and runs each decode step through the blocks' own
    forward: the unpatched model's tokens either way."""
    blocks = sys.modules["addnorm.patch.blocks"]
    norms = sys.modules["addnorm.patch.norms"]
    llama = hf_model("llama").eval()
    fused = copy.deepcopy(llama)
    addnorm.patch(fused, fuse_residual=True)
    prompt = hf_inputs("llama")["input_ids"][:, :5]  # a stream of 2 x 5 x 32 elements; a step's, 2 x 1 x 32
    monkeypatch.setattr(blocks, "INFERENCE_FUSE_MIN_ELEMENTS", 2 * 5 * 32)
    calls, real = [], norms.add_norm

    def spy(x, residual, *args, **kwargs):  # (the fused adds: the calls with a residual)
        if residual is not None:
            calls.append(x.shape)
        return real(x, residual, *args, **kwargs)

    monkeypatch.setattr(norms, "add_norm", spy)
    kwargs = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(fused.generate(prompt, **kwargs), llama.generate(prompt, **kwargs))
    assert calls and all(shape[1] == 5 for shape in calls)  # (the prompt's rows alone)


def test_fused_blocks_generate_with_cache_and_cross_attention():
    import transformers as tf

    llama = hf_model("llama").eval()
    fused = copy.deepcopy(llama)
    addnorm.patch(fused, fuse_residual=True)
    prompt = hf_inputs("llama")["input_ids"][:, :4]
    kwargs = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(fused.generate(prompt, **kwargs), llama.generate(prompt, **kwargs))

    # GPT-2 with cross-attention: the fused block falls back to the original forward
    torch.manual_seed(0)
    config = tf.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=4,
        vocab_size=64,
        n_positions=8,
        add_cross_attention=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    gpt2 = tf.GPT2LMHeadModel(config)
    fused = copy.deepcopy(gpt2)
    report = addnorm.patch(fused, fuse_residual=True)
    assert report.fused == ["transformer.h.0"] and len(report.replaced) == 4
    ids, memory = torch.randint(0, 64, (2, 8)), torch.randn(2, 5, 32)
    torch.testing.assert_close(
        fused(input_ids=ids, encoder_hidden_states=memory).logits,
        gpt2(input_ids=ids, encoder_hidden_states=memory).logits,
    )


@pytest.mark.parametrize("name", ["falcon_h1", "nemotron_h", "bamba", "glm_moe_dsa"])
def test_fused_layers_give_the_model_s_logits_for_a_padded_batch(name):
    """A left-padded batch: each layer's mask reaches the mixer that reads it (the blocks whose
    first sublayer is a function of their own, :attr:`addnorm.patch.layout.Step.run`, pass it on)."""
    model = hf_model(name).eval()
    fused = copy.deepcopy(model)
    assert addnorm.patch(fused, fuse_residual=True).fused_adds
    ids = hf_inputs(name)["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        unmasked = model(input_ids=ids).logits
        got = fused(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(want[0], unmasked[0], atol=1e-4)  # the mask matters to the model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name",
    [
        "t5gemma",
        "gemma4_ple",
        "gemma4_moe",
        "bamba",
        "chameleon",
        "falcon_h1",
        "minimax",
        "glm_moe_dsa",
        "nemotron_h",
        "recurrent_gemma",
        "mpt",
        "dbrx",
        "longcat_flash",
        "mvp",
        "nllb_moe",
        "seamless_m4t",
        "bigbird_pegasus",
    ],
)
def test_fused_layers_generate_the_model_s_tokens_from_a_padded_batch(name):
    """Cached greedy generation from a left-padded batch: T5Gemma's decoder (its self-attention
    given the self-attention part of the cache, its cross-attention the whole), Gemma 4 with
    per-layer inputs and in its MoE layout, Bamba's Mamba and attention layers, Falcon-H1's
    side by side, MiniMax's lightning attention, GLM-5's sparse attention (a layer reusing the top-k
    indices the layer before it returns), Nemotron-H's mixers (each called as its kind is), DBRX's
    attention inside its norms' module, Longcat-Flash's shortcut MoE; encoder-decoders: MVP's
    prompts, NLLB-MoE's experts, SeamlessM4T's and BigBird-Pegasus's layers."""
    model = hf_model(name).eval()
    fused = copy.deepcopy(model)
    assert addnorm.patch(fused, fuse_residual=True).fused_adds
    prompt = hf_inputs(name)["input_ids"][:, :5]
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)

    def generate(m):  # the tokens, or the error the model itself raises on this device
        try:
            with torch.no_grad():
                return m.generate(prompt, **kwargs)
        except RuntimeError as err:
            return f"{type(err).__name__}: {err}"

    # (on a GPU, SDPA refuses MiniMax's padded mask: "(*bias): last dimension must be contiguous")
    want, got = generate(model), generate(fused)
    assert got == want if isinstance(want, str) else torch.equal(got, want)


@pytest.mark.parametrize("name", ["chameleon", "chameleon_swin"])
def test_a_fused_layer_returns_the_attention_weights_only_when_asked(name):
    """Chameleon's layers return ``(stream,)``, and ``(stream, attention weights)`` with
    ``output_attentions=True``: so do the fused ones, with the same values."""
    model = hf_model(name).eval()
    fused = copy.deepcopy(model)
    addnorm.patch(fused, fuse_residual=True)
    x = torch.randn(2, 8, WIDTH)
    positions = model.model.rotary_emb(x, torch.arange(8)[None])
    with torch.no_grad():
        for asked in (False, True):
            want = model.model.layers[0](x, position_embeddings=positions, output_attentions=asked)
            got = fused.model.layers[0](x, position_embeddings=positions, output_attentions=asked)
            assert type(got) is tuple and len(got) == len(want) == 1 + asked
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_nemotron_norm_casts_to_the_autocast_dtype_as_its_class_does(monkeypatch, on_cpu):
    """NemotronLayerNorm1P casts its input, ``w + 1`` and bias to the autocast dtype where
    ``torch.is_autocast_enabled()`` (CUDA's autocast) says so, then normalizes with autocast off:
    so does its style, and an add before it is then not fused (the norm reads the rounded stream).
    Here CPU autocast stands in for CUDA's."""
    original = hf_model("nemotron")
    patched = copy.deepcopy(original)
    report = addnorm.patch(patched, fuse_residual=True, backend="reference")
    assert {style for _, _, style in report.replaced} == {"nemotron"} and len(report.fused_adds) == 4
    inputs = hf_inputs("nemotron")
    calls = []
    real = sys.modules["addnorm.patch.norms"].add_norm
    monkeypatch.setattr(
        sys.modules["addnorm.patch.norms"], "add_norm", lambda x, r, *a, **k: calls.append(r) or real(x, r, *a, **k)
    )
    enabled = torch.is_autocast_enabled
    for cuda_autocast in (False, True):  # (asked with no device, as the class asks: CUDA's)
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a, on=cuda_autocast: enabled(*a) if a else on)
        calls.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = original(**inputs).logits, patched(**inputs).logits
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        assert any(r is not None for r in calls) is not cuda_autocast  # fused adds only without the cast
        if cuda_autocast:
            norm = patched.model.norm
            x = torch.randn(3, original.config.hidden_size)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert torch.equal(norm(x), original.model.norm(x))  # the class's own casts, bit for bit
            # autocast's own rule: a float64 tensor is not cast, so neither is a float64 norm's input
            norm64, original64 = copy.deepcopy(norm).double(), copy.deepcopy(original.model.norm).double()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = original64(x.double())
                got = norm64(x.double())
            assert got.dtype == want.dtype == torch.float64  # (a cast to bf16 would be off by 1e-2)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_norm_class_of_style_nemotron_needs_only_what_the_other_styles_need():
    """``norm_types={MyNorm: "nemotron"}`` on a class with a 1-D weight, an ``eps`` or
    ``variance_epsilon`` and an optional bias (no ``normalized_shape``) computes ``LN(x) * (w + 1) +
    b``; a bias of another shape is refused by name."""

    class MyLayerNorm1P(nn.Module):
        def __init__(self, n, bias):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n) * 0.1)
            self.bias = nn.Parameter(torch.randn(n)) if bias else None
            self.variance_epsilon = 1e-5

        def forward(self, x):
            return F.layer_norm(x, x.shape[-1:], self.weight + 1, self.bias, self.variance_epsilon)

    x = torch.randn(4, 5, 24)
    for bias in (False, True):
        norm = MyLayerNorm1P(24, bias)
        ours = copy.deepcopy(norm)
        report = addnorm.patch(ours, norm_types={MyLayerNorm1P: "nemotron"})
        assert report.replaced == [("", "MyLayerNorm1P", "nemotron")]
        torch.testing.assert_close(ours(x), norm(x))
    odd = MyLayerNorm1P(24, True)
    odd.bias = nn.Parameter(torch.randn(12))
    report = addnorm.patch(odd, norm_types={MyLayerNorm1P: "nemotron"})
    assert report.skipped == [("", "MyLayerNorm1P", "expected a 'bias' of the weight's shape, or None")]


def test_a_moonshine_norm_whose_ln_is_hooked_is_left_alone():
    """The "moonshine" style computes its ``ln`` itself: a hook on it (or a forward set on it)
    would be skipped, so such a norm is left as it is and reported."""
    from transformers.models.moonshine_streaming.modeling_moonshine_streaming import MoonshineStreamingLayerNorm

    norm = MoonshineStreamingLayerNorm(16)
    calls = []
    norm.ln.register_forward_hook(lambda m, args, out: calls.append(1) or out * 2)
    report = addnorm.patch(norm)
    assert report.skipped == [
        (
            "",
            "MoonshineStreamingLayerNorm",
            "its 'ln' has hooks or a forward of its own, which style 'moonshine' would skip",
        )
    ]
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x), 2 * F.layer_norm(x, (16,)) * (norm.gamma + norm.unit_offset))
    assert calls == [1]
