"""A tiny transformer decoder built from functional ops only, and the same math in plain torch.

Used by core tests (engine == torch) and pass tests (fused engine == reference, fewer launches).
Prefill of one sequence through a paged KV cache: embedding → N × (RMSNorm → q/k/v → RoPE →
cache write → paged attention → o_proj → residual → RMSNorm → SwiGLU MLP → residual) → norm → logits.
"""
from __future__ import annotations

import math

import torch

from graphdsl import Dim, Network, Tensor
from graphdsl import functional as F

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK, NUM_BLOCKS = 64, 32, 4, 2, 8, 48, 4, 16


def weights(num_layers: int = 2, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    w = {"embed": r(VOCAB, HIDDEN, scale=1.0), "final_norm": 1 + r(HIDDEN), "lm_head": r(VOCAB, HIDDEN)}
    for i in range(num_layers):
        w[f"l{i}.in_norm"] = 1 + r(HIDDEN)
        w[f"l{i}.qkv"] = r((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
        w[f"l{i}.o"] = r(HIDDEN, HEADS * HEAD_DIM)
        w[f"l{i}.post_norm"] = 1 + r(HIDDEN)
        w[f"l{i}.gate_up"] = r(2 * INTER, HIDDEN)
        w[f"l{i}.down"] = r(HIDDEN, INTER)
    return w


def rope_tables(positions: torch.Tensor, theta: float = 10000.0):
    inv = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    freqs = positions.float()[:, None] * inv[None, :]
    return freqs.cos(), freqs.sin()


def build(num_layers: int = 2, dtype=torch.float32) -> Network:
    """Record the decoder into a new network with outputs ``logits`` and the updated caches."""
    n = Dim("num_tokens", max=256)
    with Network("tiny_block") as net:
        ids = Tensor("input_ids", (n,), torch.int64)
        cos, sin = Tensor("cos", (n, HEAD_DIM // 2), torch.float32), Tensor("sin", (n, HEAD_DIM // 2), torch.float32)
        slots = Tensor("slot_mapping", (n,), torch.int64)
        block_tables = Tensor("block_tables", (1, NUM_BLOCKS), torch.int32)
        seq_lens = Tensor("seq_lens", (1,), torch.int32)
        qsl = Tensor("query_start_loc", (2,), torch.int32)
        w = {k: Tensor(k, tuple(v.shape), dtype) for k, v in weights(num_layers).items()}
        x = F.embedding(ids, w["embed"])
        for i in range(num_layers):
            kc = Tensor(f"k_cache{i}", (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), dtype)
            vc = Tensor(f"v_cache{i}", (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), dtype)
            h = F.rms_norm(x, w[f"l{i}.in_norm"], eps=1e-6)
            qkv = F.linear(h, w[f"l{i}.qkv"], transpose_b=True)
            q, k, v = F.split(qkv, [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
            q, k = F.rope(q.reshape(-1, HEADS, HEAD_DIM), k.reshape(-1, KV_HEADS, HEAD_DIM), cos, sin)
            kc, vc = F.reshape_and_cache(k, v.reshape(-1, KV_HEADS, HEAD_DIM), kc, vc, slots)
            a = F.paged_attention(q, kc, vc, block_tables, seq_lens, qsl)
            x = x + F.linear(a.reshape(-1, HEADS * HEAD_DIM), w[f"l{i}.o"], transpose_b=True)
            h = F.rms_norm(x, w[f"l{i}.post_norm"], eps=1e-6)
            act = F.activation(F.linear(h, w[f"l{i}.gate_up"], transpose_b=True), F.ActType.SWIGLU)
            x = x + F.linear(act, w[f"l{i}.down"], transpose_b=True)
        logits = F.linear(F.rms_norm(x, w["final_norm"], eps=1e-6), w["lm_head"], transpose_b=True)
        net.mark_output(logits, "logits")
    return net


def inputs(num_tokens: int, num_layers: int = 2, seed: int = 1, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(num_tokens)
    cos, sin = rope_tables(pos)
    feed = {"input_ids": torch.randint(0, VOCAB, (num_tokens,), generator=g), "cos": cos, "sin": sin,
            "slot_mapping": pos.clone(),   # block i holds tokens [4i, 4i+4): identity block table
            "block_tables": torch.arange(NUM_BLOCKS, dtype=torch.int32)[None, :],
            "seq_lens": torch.tensor([num_tokens], dtype=torch.int32),
            "query_start_loc": torch.tensor([0, num_tokens], dtype=torch.int32)}
    for i in range(num_layers):
        feed[f"k_cache{i}"] = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
        feed[f"v_cache{i}"] = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    return feed


def torch_reference(w: dict, feed: dict, num_layers: int = 2) -> torch.Tensor:
    """The same decoder in plain torch: dense causal attention, HF-style rotate_half RoPE."""
    def rms(x, g):
        xf = x.float()
        return g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def rot(x, cos, sin):
        c, s = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        return x * c + torch.cat((-x2, x1), -1) * s

    x = w["embed"][feed["input_ids"]]
    t = x.shape[0]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(num_layers):
        h = rms(x, w[f"l{i}.in_norm"])
        q, k, v = (h @ w[f"l{i}.qkv"].T).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q = rot(q.reshape(t, HEADS, HEAD_DIM), feed["cos"], feed["sin"])
        k = rot(k.reshape(t, KV_HEADS, HEAD_DIM), feed["cos"], feed["sin"]).repeat_interleave(HEADS // KV_HEADS, 1)
        v = v.reshape(t, KV_HEADS, HEAD_DIM).repeat_interleave(HEADS // KV_HEADS, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
        a = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)
        x = x + a.reshape(t, -1) @ w[f"l{i}.o"].T
        gate, up = (rms(x, w[f"l{i}.post_norm"]) @ w[f"l{i}.gate_up"].T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w[f"l{i}.down"].T
    return rms(x, w["final_norm"]) @ w["lm_head"].T
