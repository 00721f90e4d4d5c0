"""Tiny randomly initialised models for integration tests: no downloads, a few ms per step."""

from __future__ import annotations

import torch
from torch import nn

import addnorm

VOCAB, SEQ, WIDTH = 64, 8, 32


def hf_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """A 2-layer Hugging Face model (no dropout), with its norm weights moved away from their init
    so that a wrong weight, offset or bias shows in the outputs."""
    import transformers as tf

    torch.manual_seed(seed)
    small = dict(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4)
    if name == "gpt2":
        config = tf.GPT2Config(
            n_layer=2,
            n_embd=WIDTH,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = tf.GPT2LMHeadModel(config)
    elif name == "bert":
        config = tf.BertConfig(
            **small,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model = tf.BertForMaskedLM(config)
    elif name == "vit":
        config = tf.ViTConfig(
            **small,
            image_size=8,
            patch_size=4,
            num_channels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=5,
        )
        model = tf.ViTForImageClassification(config)
    elif name in ("llama", "gemma"):
        cls_config, cls_model = (
            (tf.LlamaConfig, tf.LlamaForCausalLM) if name == "llama" else (tf.GemmaConfig, tf.GemmaForCausalLM)
        )
        config = cls_config(
            **small,
            num_key_value_heads=2,
            head_dim=WIDTH // 4,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        model = cls_model(config)
    else:
        raise ValueError(name)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model.to(dtype).train()


def hf_inputs(name: str, dtype: torch.dtype = torch.float32, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    if name == "vit":
        return dict(
            pixel_values=torch.randn(2, 3, 8, 8, generator=g).to(dtype), labels=torch.randint(0, 5, (2,), generator=g)
        )
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return dict(input_ids=ids, labels=ids)


class Block(nn.Module):
    """A pre-norm Transformer block built from plain torch layers and ``norm`` modules."""

    def __init__(self, width: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm(width), norm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Embedding, two pre-norm blocks (LayerNorm and RMSNorm), an Add & Norm and a head."""

    def __init__(self, width: int = WIDTH, vocab: int = VOCAB, *, layer=addnorm.LayerNorm, rms=addnorm.RMSNorm):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width, layer), Block(width, rms)])
        self.add_norm = addnorm.AddNorm(width, norm="rms", eps=1e-6)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        h = x
        for block in self.blocks:
            h = block(h)
        return self.head(self.add_norm(h, x))
