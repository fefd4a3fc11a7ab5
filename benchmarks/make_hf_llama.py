"""Write a tiny random Llama-shaped Hugging Face folder (the workload of issue 7's benchmark).

    pip install -e ".[bench]"
    python benchmarks/make_hf_llama.py /tmp/tiny-hf-llama     # 3 layers, hidden 96, 16 q / 4 KV heads, vocab 640

transformers writes config.json and model.safetensors exactly as a hub model has them,
so both dcpjax and transformers load the same folder.
"""

from __future__ import annotations

import argparse
import sys


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The model-shape flags (shared with make_cycle_llama.py)."""
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--vocab", type=int, default=640)
    p.add_argument("--max-position-embeddings", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)


def random_llama(args: argparse.Namespace):
    """A float32 transformers Llama of `args`' shape with random weights (seeded)."""
    import torch
    import transformers

    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=args.max_position_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).to(torch.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    args = p.parse_args(argv)
    model = random_llama(args)
    model.save_pretrained(args.out, safe_serialization=True)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
