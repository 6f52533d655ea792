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

    def __init__(self, blocks: BlockManager, max_model_len: int, graph_widths=None):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_blocks_per_seq = -(-max_model_len // blocks.block_size)
        self.cache = torch.full((blocks.num_blocks * blocks.block_size,), -1, dtype=torch.int64)
        self.graph_widths = graph_widths      # block-table widths of FakeGraph decode steps (None: eager)
        self.graphs: dict[tuple[int, int], FakeGraph] = {}
        self.replays: list[tuple[int, int]] = []   # (rows, width) of each graph replay

    def decode_graph(self, n, lora=False, width=None):
        if self.graph_widths is None:
            return None
        rows = 1 << (n - 1).bit_length()
        widths = sorted({*self.graph_widths, self.max_blocks_per_seq})
        wide = next(w for w in widths if w >= (width or widths[-1]))
        if (rows, wide) not in self.graphs:
            self.graphs[(rows, wide)] = FakeGraph(self, rows, wide)
        return self.graphs[(rows, wide)]

    def execute(self, phase, t, rows=None):
        self.cache[t["slot_mapping"]] = t["input_ids"]
        n = t["input_ids"].shape[0]
        if phase == "decode":
            heads, seq_of = range(n), list(range(n))
        else:
            heads, qsl = t["lm_head_indices"].tolist(), t["query_start_loc"].tolist()
            seq_of = {i: next(s for s in range(len(qsl) - 1) if qsl[s] <= i < qsl[s + 1]) for i in heads}
        heads = heads if rows is None else heads[:rows]
        out, bs = [], self.block_size
        for i in heads:
            table = t["block_tables"][seq_of[i]]
            L = int(t["positions"][i]) + 1
            ctx = [int(self.cache[table[p // bs] * bs + p % bs]) for p in range(L)]
            assert -1 not in ctx, "read a slot nothing wrote"
            out.append(fake_logits(ctx))
        return torch.stack(out) if out else torch.empty(0, VOCAB)




class FakeGraph:
    """A decode "graph" of the fake model over static buffers, as ``ModelExecutor``'s: ``replay(n)``
    runs the first ``n`` rows, then advances the buffers as the real graph's epilogue does
    (``input_ids <- argmax``, ``positions`` and ``seq_lens`` + 1 on real rows). A row whose new
    token lies past the block table's ``width`` fails the test (the real slot computation would
    clamp it to a wrong slot)."""

    def __init__(self, model: FakeModel, rows: int, width: int):
        self.model, self.rows, self.width = model, rows, width
        self.inputs = {"input_ids": torch.zeros(rows, dtype=torch.int64),
                       "positions": torch.zeros(rows, dtype=torch.int64),
                       "seq_lens": torch.zeros(rows, dtype=torch.int32),
                       "block_tables": torch.zeros(rows, width, dtype=torch.int32)}

    def replay(self, n):
        b, bs = self.inputs, self.model.block_size
        assert int(b["positions"][:n].max()) // bs < self.width, "a row's new token lies past the block table"
        self.model.replays.append((self.rows, self.width))
        cols = b["positions"][:n] // bs
        slots = b["block_tables"][:n].gather(1, cols[:, None].int().long()).squeeze(1).long() * bs + b["positions"][:n] % bs
        logits = self.model.execute("decode", {"input_ids": b["input_ids"][:n], "positions": b["positions"][:n],
                                               "slot_mapping": slots, "block_tables": b["block_tables"][:n]})
        greedy = logits.argmax(1)
        b["input_ids"][:n] = greedy
        b["positions"][:n] += 1
        b["seq_lens"][:n] += 1
        return logits, greedy
