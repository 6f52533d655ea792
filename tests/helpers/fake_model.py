"""A step executor for serving tests without a real model: it stores each token in its KV slot
and draws a position's logits from the tokens it reads back through the block table, so any
wrong slot, block table, pending token or shared block changes the output."""
from __future__ import annotations

import torch

VOCAB = 50


def fake_logits(context: list[int]) -> torch.Tensor:
    """The logits the fake model gives after ``context`` (prompt + generated tokens so far)."""
    g = torch.Generator().manual_seed(hash(tuple(context)) % (2 ** 31))
    return torch.randn(VOCAB, generator=g) * 3


class FakeModel:
    """A step executor that writes each token into its cache slot and computes the logits of a
    position from the tokens it can read back through the block table (positions 0..p), like
    attention would."""

    device = torch.device("cpu")
    vocab_size = VOCAB

    def __init__(self, blocks: BlockManager, max_model_len: int):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_blocks_per_seq = -(-max_model_len // blocks.block_size)
        self.cache = torch.full((blocks.num_blocks * blocks.block_size,), -1, dtype=torch.int64)

    def decode_graph(self, n, lora=False):
        return None

    def execute(self, phase, t):
        self.cache[t["slot_mapping"]] = t["input_ids"]
        n = t["input_ids"].shape[0]
        if phase == "decode":
            rows, seq_of = range(n), list(range(n))
        else:
            rows, qsl = t["lm_head_indices"].tolist(), t["query_start_loc"].tolist()
            seq_of = {i: next(s for s in range(len(qsl) - 1) if qsl[s] <= i < qsl[s + 1]) for i in rows}
        out, bs = [], self.block_size
        for i in rows:
            table = t["block_tables"][seq_of[i]]
            L = int(t["positions"][i]) + 1
            ctx = [int(self.cache[table[p // bs] * bs + p % bs]) for p in range(L)]
            assert -1 not in ctx, "read a slot nothing wrote"
            out.append(fake_logits(ctx))
        return torch.stack(out) if out else torch.empty(0, VOCAB)


