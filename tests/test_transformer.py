"""The hand-written Transformer: positional encoding, shapes, where each norm sits, causality.

The oracle for the wiring is the textbook composition written here with plain torch ops in
float64 (explicit softmax attention, torch's layer_norm / a hand RMSNorm), never our modules.
"""

from __future__ import annotations

import math

import pytest
import torch

import addnorm.nn
from addnorm.transformer import (
    DecoderLayer,
    EncoderLayer,
    PositionalEncoding,
    Seq2SeqTransformer,
    residual_stack,
    sinusoidal_table,
)

D, H, FF = 8, 2, 16


def test_sinusoidal_table_matches_the_formula():
    max_len, d = 5, 6
    pe = sinusoidal_table(max_len, d)
    for p in range(max_len):
        for i in range(d // 2):
            angle = p / 10000 ** (2 * i / d)
            assert pe[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_positional_encoding_reproduces_the_seed_example():
    # seed 003: PositionalEncoding(max_len=2, d_model=2) on the book's source sequence
    source = torch.tensor([[[1.0349, 0.9661], [0.8055, -0.9169]]])
    out = PositionalEncoding(2, 2)(source)
    torch.testing.assert_close(out, torch.tensor([[[1.4636, 2.3663], [1.9806, -0.7564]]]), atol=1e-4, rtol=0)


def test_learned_positional_encoding_is_trained():
    pe = PositionalEncoding(4, D, "learned")
    assert isinstance(pe.pe, torch.nn.Parameter)
    pe(torch.randn(2, 3, D)).sum().backward()
    assert pe.pe.grad[:3].abs().sum() > 0 and pe.pe.grad[3].abs().sum() == 0
    with pytest.raises(ValueError, match="max_len"):
        pe(torch.randn(1, 5, D))


@pytest.mark.parametrize("position", ["post", "pre", "none"])
@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_model_shapes(position, positional):
    model = Seq2SeqTransformer(3, D, H, FF, 2, 2, norm_position=position, positional=positional)
    src, tgt = torch.randn(5, 2, 3), torch.randn(5, 4, 3)
    assert model(src, tgt).shape == (5, 4, 3)
    assert model.predict(src, 3).shape == (5, 3, 3)
    norms = [m for m in model.modules() if isinstance(m, addnorm.nn.AddNorm)]
    # 2 per encoder layer, 3 per decoder layer, plus one final norm per stack in pre-norm
    assert len(norms) == {"post": 10, "pre": 12, "none": 0}[position]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(norm_position="middle"), "norm_position"),
        (dict(norm="batch"), "norm"),
        (dict(positional="rotary"), "positional"),
    ],
)
def test_bad_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Seq2SeqTransformer(2, D, H, FF, 1, 1, **kwargs)


def test_heads_must_divide_d_model():
    with pytest.raises(ValueError, match="divisible"):
        Seq2SeqTransformer(2, 10, 4, FF, 1, 1)


# --------------------------------------------------------------------------- the oracle


def hand_attention(mha, query, memory, causal=False):
    q = query @ mha.q.weight.T + mha.q.bias
    k, v = (memory @ mha.kv.weight.T + mha.kv.bias).chunk(2, dim=-1)
    n, lq, d = q.shape
    dh = d // mha.n_heads
    split = lambda t: t.reshape(n, t.shape[1], mha.n_heads, dh).transpose(1, 2)
    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(dh)
    if causal:
        scores = scores.masked_fill(torch.ones(lq, k.shape[1]).triu(1).bool(), -math.inf)
    o = (torch.softmax(scores, dim=-1) @ split(v)).transpose(1, 2).reshape(n, lq, d)
    return o @ mha.out.weight.T + mha.out.bias


def hand_ffn(ffn, x):
    return torch.relu(x @ ffn[0].weight.T + ffn[0].bias) @ ffn[2].weight.T + ffn[2].bias


def hand_norm(add_norm, x):
    n = add_norm.norm
    if add_norm.kind == "layer":
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), n.weight, n.bias, n.eps)
    eps = torch.finfo(x.dtype).eps if n.eps is None else n.eps  # torch's RMSNorm default
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * n.weight


def textbook(x, fns, norms, position, final=None):
    """post: x = N(x + f(x)); pre: x = x + f(N(x)), then the final norm; none: x = x + f(x)."""
    for f, norm in zip(fns, norms, strict=True):
        if position == "post":
            x = hand_norm(norm, x + f(x))
        elif position == "pre":
            x = x + f(hand_norm(norm, x))
        else:
            x = x + f(x)
    return hand_norm(final, x) if final is not None else x


def _randomize(module):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():  # norms away from identity, so a misplaced norm shows
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return module.double()


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("position", ["post", "pre", "none"])
def test_encoder_stack_wires_the_norms_as_claimed(position, norm):
    layers = [_randomize(EncoderLayer(D, H, FF, norm_position=position, norm=norm)) for _ in range(2)]
    final = _randomize(addnorm.nn.AddNorm(D, norm=norm, prenorm=True)) if position == "pre" else None
    x = torch.randn(3, 4, D, dtype=torch.float64)
    ours = residual_stack(x, [s for layer in layers for s in layer.sublayers()], position, final)
    fns, norms = [], []
    for layer in layers:
        fns += [lambda h, m=layer.self_attn: hand_attention(m, h, h), lambda h, m=layer.ffn: hand_ffn(m, h)]
        norms += list(layer.norms) or [None, None]
    torch.testing.assert_close(ours, textbook(x, fns, norms, position, final), rtol=1e-10, atol=1e-10)
    # a single layer alone: pre-norm gives back the residual stream (no final norm)
    alone = textbook(x, fns[:2], norms[:2], position)
    torch.testing.assert_close(layers[0](x), alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("position", ["post", "pre", "none"])
def test_decoder_layer_wires_the_norms_as_claimed(position, norm):
    layer = _randomize(DecoderLayer(D, H, FF, norm_position=position, norm=norm))
    final = _randomize(addnorm.nn.AddNorm(D, norm=norm, prenorm=True)) if position == "pre" else None
    x = torch.randn(3, 4, D, dtype=torch.float64)
    memory = torch.randn(3, 2, D, dtype=torch.float64)
    fns = [
        lambda h: hand_attention(layer.self_attn, h, h, causal=True),
        lambda h: hand_attention(layer.cross_attn, h, memory),
        lambda h: hand_ffn(layer.ffn, h),
    ]
    norms = list(layer.norms) or [None] * 3
    ours = residual_stack(x, layer.sublayers(memory), position, final)
    torch.testing.assert_close(ours, textbook(x, fns, norms, position, final), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm, fused_name", [("layer", "add_layer_norm"), ("rms", "add_rms_norm")])
@pytest.mark.parametrize("position", ["post", "pre", "none"])
def test_adds_and_norms_go_through_the_fused_op(monkeypatch, position, norm, fused_name):
    calls = []
    original = getattr(addnorm.nn.F, fused_name)

    def spy(*args, **kwargs):
        calls.append(kwargs["prenorm"])
        return original(*args, **kwargs)

    monkeypatch.setattr(addnorm.nn.F, fused_name, spy)
    model = Seq2SeqTransformer(2, D, H, FF, 2, 3, norm_position=position, norm=norm)
    model(torch.randn(2, 2, 2), torch.randn(2, 2, 2))
    # one fused add+norm per sublayer (2 per encoder layer, 3 per decoder layer); in pre-norm the
    # last one of each stack is the final norm
    expected = {"post": [False] * 13, "pre": [True] * 13, "none": []}[position]
    assert calls == expected


def test_model_pre_norm_ends_with_the_final_norm():
    model = Seq2SeqTransformer(2, D, H, FF, 1, 1, norm_position="pre").double()
    with torch.no_grad():
        model.decoder_norm.norm.weight.zero_()
        model.decoder_norm.norm.bias.fill_(0.5)
    out = model(torch.randn(2, 2, 2, dtype=torch.float64), torch.randn(2, 2, 2, dtype=torch.float64))
    # the head sees the final norm's output (all 0.5), so every prediction is the same
    expected = model.head(torch.full((D,), 0.5, dtype=torch.float64))
    torch.testing.assert_close(out, expected.expand_as(out))


@pytest.mark.parametrize("position", ["post", "pre", "none"])
def test_decoder_is_causal(position):
    torch.manual_seed(0)
    model = Seq2SeqTransformer(2, D, H, FF, 1, 2, norm_position=position).double()
    src = torch.randn(2, 2, 2, dtype=torch.float64)
    tgt = torch.randn(2, 5, 2, dtype=torch.float64)
    changed = tgt.clone()
    changed[:, 3:] += 1.0
    a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, :3], b[:, :3], rtol=1e-12, atol=1e-12)
    assert (a[:, 3:] - b[:, 3:]).abs().amin() > 0


def test_predict_feeds_back_its_own_outputs():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(2, D, H, FF, 1, 1).double().eval()
    src = torch.randn(3, 2, 2, dtype=torch.float64)
    pred = model.predict(src, 2)
    first = model(src, src[:, -1:])
    second = model(src, torch.cat([src[:, -1:], first], dim=1))[:, 1:]
    torch.testing.assert_close(pred, torch.cat([first, second], dim=1))


@pytest.mark.parametrize("position", ["post", "pre", "none"])
def test_residual_dropout_is_fused_into_each_add_and_off_in_eval(monkeypatch, position):
    """dropout= reaches every Add & Norm call (in train mode only); eval() gives bitwise the
    model without dropout, train() a different output on each call."""
    p_seen = []
    original = addnorm.nn.F.add_layer_norm

    def spy(*args, **kwargs):
        p_seen.append(kwargs["dropout_p"])
        return original(*args, **kwargs)

    monkeypatch.setattr(addnorm.nn.F, "add_layer_norm", spy)
    torch.manual_seed(0)
    model = Seq2SeqTransformer(2, D, H, FF, 2, 2, norm_position=position, dropout=0.1)
    torch.manual_seed(0)
    plain = Seq2SeqTransformer(2, D, H, FF, 2, 2, norm_position=position)
    src, tgt = torch.randn(2, 5, 2), torch.randn(2, 4, 2)
    model.eval()
    plain.eval()
    assert torch.equal(model(src, tgt), plain(src, tgt))
    assert set(p_seen) <= {0.0}
    p_seen.clear()
    model.train()
    assert not torch.equal(model(src, tgt), model(src, tgt))
    assert set(p_seen) == ({0.1} if position != "none" else set())
