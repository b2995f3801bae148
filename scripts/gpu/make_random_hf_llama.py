#!/usr/bin/env python3
"""Writes a Hugging Face Llama directory with random weights through transformers itself, for the
context-extension configs (configs/extend-tinyllama-64k-*.yaml) on a machine that cannot download
a real model. The shape is TinyLlama-1.1B's (hidden 2048, 22 layers, 32 query heads over 4 KV heads,
head dim 64, intermediate 5632, vocab 32000, 2048 positions, rope_theta 10000, tied embeddings off),
the weights transformers' own initialisation (normal, std initializer_range = 0.02), saved as
bf16 safetensors in shards with model.safetensors.index.json, exactly as save_pretrained writes a
model on the Hub. There is no tokenizer. The configs train on the demo corpus with the demo's 4096-piece
tokenizer, and longtrain requires the model's vocabulary to be the one the shards were prepared with,
so they use --vocab-size 4096 (0.97B parameters; everything else is TinyLlama's shape).

Usage: python3 scripts/gpu/make_random_hf_llama.py OUT_DIR [--vocab-size 32000] [--seed N] [--shard-size 1GB]
"""
import argparse
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-size", default="1GB")
    args = ap.parse_args()
    if os.path.exists(os.path.join(args.out, "config.json")):
        sys.exit("make_random_hf_llama: %s already holds a model; remove it first" % args.out)
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True, max_shard_size=args.shard_size)
    n = sum(p.numel() for p in model.parameters())
    print("make_random_hf_llama: wrote %s: %.3fB parameters, files %s" % (args.out, n / 1e9, sorted(os.listdir(args.out))))


if __name__ == "__main__":
    main()
