"""What fusing the residual add into the norm saves on a small model's training step.

Times forward + backward of a small Hugging Face model (GPT-2 or Llama layout, random
weights, no download) in three variants side by side in one process, interleaved round
by round so that machine load hits them alike (addnorm's harness,
``addnorm.tools.bench.measure``): the model as is ("hf"), with its norms patched ("patched"),
and patched with ``fuse_residual=True`` ("fused"). Prints the median and p20/p80 per variant
and the ratio to "hf".

    PYTHONPATH=src python benchmarks/fuse_residual.py --model llama --threads 1
"""

from __future__ import annotations

import argparse
import copy

import torch

import addnorm
from addnorm.tools.bench import measure


def build(name: str, width: int, layers: int, seq: int):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        num_hidden_layers=layers,
        hidden_size=width,
        intermediate_size=4 * width,
        num_attention_heads=width // 64,
        vocab_size=1024,
        max_position_embeddings=seq,
    )
    if name == "gpt2":
        config = tf.GPT2Config(
            n_layer=layers,
            n_embd=width,
            n_head=width // 64,
            vocab_size=1024,
            n_positions=seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return tf.GPT2LMHeadModel(config)
    config = tf.LlamaConfig(**common, num_key_value_heads=width // 64, bos_token_id=0, eos_token_id=0)
    return tf.LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt2", "llama"], default="llama")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    hf = build(args.model, args.width, args.layers, args.seq).train()
    patched, fused = copy.deepcopy(hf), copy.deepcopy(hf)
    addnorm.patch(patched, backend=args.backend)
    report = addnorm.patch(fused, fuse_residual=True, backend=args.backend)
    assert len(report.fused) == args.layers, report
    variants = {"hf": hf, "patched": patched, "fused": fused}
    ids = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))

    def step(model):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    for model in variants.values():  # warm-up beyond measure's first call
        for _ in range(2):
            step(model)
    times = measure({name: lambda model=model: step(model) for name, model in variants.items()}, args.rounds)

    base = times["hf"][0]
    print(
        f"{args.model} width={args.width} layers={args.layers} batch={args.batch} seq={args.seq} "
        f"fp32 threads={args.threads} backend={args.backend} rounds={args.rounds}, forward+backward"
    )
    for name, (med, p20, p80) in times.items():
        print(
            f"  {name:8s} median {med * 1e3:8.2f} ms  p20 {p20 * 1e3:8.2f}  p80 {p80 * 1e3:8.2f}  "
            f"x{med / base:.3f} of hf"
        )


if __name__ == "__main__":
    main()
