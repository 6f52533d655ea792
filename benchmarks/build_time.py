"""Build time of a 32-layer Llama-3-8B-shaped decoder graph through every pass (CPU only).

    python benchmarks/build_time.py [--layers 32]

Prints the build report (pass, ms, nodes before/after, what fused) and the total build time.
Target: under 3 s.
"""
from __future__ import annotations

import argparse
import time

import torch

from graphdsl import Dim, Network, Tensor
from graphdsl import functional as F

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, BLOCK, NUM_BLOCKS = 4096, 32, 8, 128, 14336, 128256, 16, 2048


def build_decoder(num_layers: int = 32, dtype=torch.bfloat16) -> Network:
    """Prefill graph of a Llama-3-8B-shaped decoder over a paged KV cache."""
    n = Dim("num_tokens", max=8192)
    with Network(f"llama8b_{num_layers}l") as net:
        ids = Tensor("input_ids", (n,), torch.int64)
        cos, sin = Tensor("cos", (n, HEAD_DIM // 2), torch.float32), Tensor("sin", (n, HEAD_DIM // 2), torch.float32)
        slots = Tensor("slot_mapping", (n,), torch.int64)
        bt = Tensor("block_tables", (1, NUM_BLOCKS), torch.int32)
        seq_lens, qsl = Tensor("seq_lens", (1,), torch.int32), Tensor("query_start_loc", (2,), torch.int32)
        x = F.embedding(ids, Tensor("embed", (VOCAB, HIDDEN), dtype))
        qkv_sizes = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
        for i in range(num_layers):
            p = f"layers.{i}."
            kc = Tensor(p + "k_cache", (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), dtype)
            vc = Tensor(p + "v_cache", (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), dtype)
            h = F.rms_norm(x, Tensor(p + "input_layernorm", (HIDDEN,), dtype), eps=1e-5)
            qkv = F.linear(h, Tensor(p + "qkv_proj", (sum(qkv_sizes), HIDDEN), dtype), transpose_b=True)
            q, k, v = F.split(qkv, qkv_sizes, -1)
            q, k = F.rope(q.reshape(-1, HEADS, HEAD_DIM), k.reshape(-1, KV_HEADS, HEAD_DIM), cos, sin)
            kc, vc = F.reshape_and_cache(k, v.reshape(-1, KV_HEADS, HEAD_DIM), kc, vc, slots)
            a = F.paged_attention(q, kc, vc, bt, seq_lens, qsl)
            x = x + F.linear(a.reshape(-1, HEADS * HEAD_DIM), Tensor(p + "o_proj", (HIDDEN, HEADS * HEAD_DIM), dtype),
                             transpose_b=True)
            h = F.rms_norm(x, Tensor(p + "post_attention_layernorm", (HIDDEN,), dtype), eps=1e-5)
            gu = F.linear(h, Tensor(p + "gate_up_proj", (2 * INTER, HIDDEN), dtype), transpose_b=True)
            x = x + F.linear(F.activation(gu, F.ActType.SWIGLU), Tensor(p + "down_proj", (HIDDEN, INTER), dtype),
                             transpose_b=True)
        h = F.rms_norm(x, Tensor("norm", (HIDDEN,), dtype), eps=1e-5)
        net.mark_output(F.linear(h, Tensor("lm_head", (VOCAB, HIDDEN), dtype), transpose_b=True), "logits")
    return net


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--backend", default="triton", choices=["triton", "torch"])
    args = ap.parse_args()
    t0 = time.perf_counter()
    net = build_decoder(args.layers)
    t_record = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = net.build_engine(backend=args.backend, lint=False)
    t_build = time.perf_counter() - t0
    print(engine.pass_report)
    print()
    print(f"record: {t_record:.2f} s   build (lint, clone, passes, engine): {t_build:.2f} s   "
          f"nodes {len(net.nodes)} -> {len(engine.net.nodes)}   launches/forward {engine.num_launches}")


if __name__ == "__main__":
    main()
