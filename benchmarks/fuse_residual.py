"""What patching and fusing the residual adds into the norms gain on a training step.

Times forward + backward of Hugging Face models (GPT-2 or Llama layout, random weights, no
download) of a small and a larger size, each in three variants, all side by side in one process,
interleaved round by round so that machine load hits them alike (addnorm's harness,
``addnorm.tools.bench.measure``): the model as is ("hf"), with its norms patched ("patched"),
and patched with ``fuse_residual=True`` ("fused"). Prints the median and p20/p80 per variant
and the ratio to "hf" of the same size. With ``--generate N``: cached greedy generation of N new
tokens from one prompt of ``--seq`` tokens, in eval mode, per generated token (a decode step
runs every norm on one row: the Python around each call, not its kernel, sets its cost).

    PYTHONPATH=src python benchmarks/fuse_residual.py --model llama --threads 1
    PYTHONPATH=src python benchmarks/fuse_residual.py --model llama --sizes 768x12 --generate 32 --seq 16
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
    parser.add_argument(
        "--sizes", default="128x2,512x4", help="comma-separated WIDTHxLAYERS, timed together (default: %(default)s)"
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--backend", default="auto")
    parser.add_argument(
        "--generate", type=int, default=0, metavar="N", help="time greedy generation of N tokens (batch 1) instead"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    batch = 1 if args.generate else args.batch
    ids = torch.randint(0, 1024, (batch, args.seq), generator=torch.Generator().manual_seed(1))
    new = dict(max_new_tokens=args.generate, min_new_tokens=args.generate, do_sample=False, pad_token_id=0)

    def step(model):
        if args.generate:
            with torch.no_grad():
                model.generate(ids, **new)
            return
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    runs = {}
    for width, layers in sizes:
        hf = build(args.model, width, layers, args.seq + args.generate)
        hf.train(not args.generate)
        patched, fused = copy.deepcopy(hf), copy.deepcopy(hf)
        addnorm.patch(patched, backend=args.backend)
        report = addnorm.patch(fused, fuse_residual=True, backend=args.backend)
        assert len(report.fused_adds) == 2 * layers, report
        for name, model in {"hf": hf, "patched": patched, "fused": fused}.items():
            step(model)  # warm-up beyond measure's first call
            runs[width, layers, name] = lambda model=model: step(model)
    times = measure(runs, args.rounds)

    what = f"greedy generation of {args.generate} tokens, per token" if args.generate else "forward+backward"
    print(
        f"{args.model} batch={batch} seq={args.seq} fp32 threads={args.threads} backend={args.backend} "
        f"rounds={args.rounds}, {what}, all sizes interleaved"
    )
    per = max(args.generate, 1)
    for (width, layers, name), (med, p20, p80) in times.items():
        base = times[width, layers, "hf"][0]
        print(
            f"  width={width:<4d} layers={layers}  {name:8s} median {med / per * 1e3:8.2f} ms  "
            f"p20 {p20 / per * 1e3:8.2f}  p80 {p80 / per * 1e3:8.2f}  x{base / med:.3f} speed of hf"
        )


if __name__ == "__main__":
    main()
