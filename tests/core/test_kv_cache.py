"""runtime/serving/kv_cache.py: cache layout, block accounting, slot mapping, and a paged-attention round trip."""
from __future__ import annotations

import math

import pytest
import torch

from graphdsl.errors import GraphDSLError
from graphdsl.opdef import get_op
from graphdsl.runtime.serving.kv_cache import BlockManager, OutOfBlocks, PagedKVCache


def test_cache_tensors_layout():
    c = PagedKVCache(3, 2, 8, num_blocks=5, block_size=4, dtype="float16", device="cpu")
    assert len(c.key_caches) == len(c.value_caches) == 3
    for t in c.key_caches + c.value_caches:
        assert t.shape == (5, 4, 2, 8) and t.dtype == torch.float16 and t.device.type == "cpu"
    assert c.key_caches[0].data_ptr() != c.key_caches[1].data_ptr() != c.value_caches[0].data_ptr()
    assert c.nbytes == 2 * 3 * 5 * 4 * 2 * 8 * 2
    assert c.nbytes == 5 * PagedKVCache.bytes_per_block(3, 2, 8, block_size=4, dtype=torch.float16)
    assert "blocks=5x4" in repr(c)


@pytest.mark.parametrize("kw,msg", [
    (dict(num_blocks=0), "num_blocks must be an integer >= 1, got 0"),
    (dict(num_blocks=4, block_size=-1), "block_size must be an integer >= 1, got -1"),
    (dict(num_blocks=4, dtype=torch.int8), "dtype must be a floating dtype, got torch.int8"),
    (dict(num_blocks=4, dtype="fp42"), "dtype must be a torch.dtype or one of"),
])
def test_cache_bad_args(kw, msg):
    with pytest.raises(GraphDSLError, match=msg):
        PagedKVCache(1, 1, 4, **kw)


def test_blocks_for():
    assert PagedKVCache.blocks_for(100, 3, 16) == 7 * 3
    assert PagedKVCache.blocks_for(32, 1, 16) == 2
    with pytest.raises(GraphDSLError, match="max_model_len must be an integer >= 1, got 0"):
        PagedKVCache.blocks_for(0, 1, 16)


def test_blocks_for_memory_cpu():
    per = PagedKVCache.bytes_per_block(2, 2, 64, block_size=16, dtype=torch.bfloat16)
    assert per == 2 * 2 * 16 * 2 * 64 * 2
    n = PagedKVCache.blocks_for_memory(0.01, 2, 2, 64, block_size=16, dtype=torch.bfloat16, device="cpu")
    assert n >= 1
    n2 = PagedKVCache.blocks_for_memory(0.02, 2, 2, 64, block_size=16, dtype=torch.bfloat16, device="cpu")
    assert n2 > n


def test_blocks_for_memory_errors():
    with pytest.raises(GraphDSLError, match=r"fraction must be a float in \(0, 1\], got 1.5"):
        PagedKVCache.blocks_for_memory(1.5, 1, 1, 1)
    with pytest.raises(GraphDSLError, match="holds no block of"):
        PagedKVCache.blocks_for_memory(1e-12, 10**4, 64, 256, device="cpu")
    with pytest.raises(GraphDSLError, match="supports cuda and cpu devices, got meta"):
        PagedKVCache.blocks_for_memory(0.5, 1, 1, 1, device="meta")


# ---------------------------------------------------------------- BlockManager

def test_allocate_append_free_accounting():
    m = BlockManager(num_blocks=6, block_size=4)
    assert m.num_free_blocks == 6 and m.can_allocate(24) and not m.can_allocate(25)
    assert m.allocate("a", 5) == [0, 1]
    assert m.allocate("b", 4) == [2]
    assert m.num_free_blocks == 3
    assert m.append("a", 3) == [0, 1]          # 8 tokens still fit 2 blocks
    assert m.num_tokens("a") == 8
    assert m.append("a", 1) == [0, 1, 3]       # 9th token opens a block
    assert m.can_append("b", 8) and not m.can_append("b", 9)
    m.free("a")
    assert m.num_free_blocks == 5 and "a" not in m and "b" in m
    # freed blocks are reused, lowest first
    assert m.allocate("c", 12) == [0, 1, 3]
    assert m.allocate("empty", 0) == []
    assert m.append("empty", 1) == [4]


def test_try_grow_to_holds_at_least_n_tokens_or_changes_nothing():
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate("a", 5)                           # blocks 0, 1
    assert m.try_grow_to("a", 3) and m.num_tokens("a") == 5       # already holds them: no change
    assert m.try_grow_to("a", 8) and m.block_table("a") == [0, 1] and m.num_tokens("a") == 8
    assert m.try_grow_to("a", 9) and m.block_table("a") == [0, 1, 2] and m.num_tokens("a") == 9
    assert not m.try_grow_to("a", 17)            # 5 blocks, 4 in the pool: nothing taken
    assert m.block_table("a") == [0, 1, 2] and m.num_tokens("a") == 9 and m.num_free_blocks == 1
    assert m.try_grow_to("a", 16) and m.num_free_blocks == 0
    with pytest.raises(GraphDSLError, match="unknown sequence 'b'"):
        m.try_grow_to("b", 1)


def test_slot_mapping_formula():
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate("x", 1)
    m.allocate("y", 10)                          # blocks 1, 2, 3
    m.append("x", 6)                             # x: blocks 0, 4
    assert m.block_table("x") == [0, 4]
    assert m.slot_mapping("x", 0, 7) == [0, 1, 2, 3, 16, 17, 18]
    assert m.slot_mapping("y", 3, 10) == [7, 8, 9, 10, 11, 12, 13]
    assert m.slot_mapping("y", 5, 5) == []
    for p, s in zip(range(10), m.slot_mapping("y", 0, 10)):
        assert s == m.block_table("y")[p // 4] * 4 + p % 4


def test_out_of_blocks_has_numbers_and_changes_nothing():
    m = BlockManager(num_blocks=4, block_size=16)
    m.allocate(1, 40)                            # 3 blocks
    with pytest.raises(OutOfBlocks, match=r"sequence 2 needs 2 more blocks for 17 tokens at "
                                          r"block_size 16, but only 1 of 4 are free") as ei:
        m.allocate(2, 17)
    assert (ei.value.needed, ei.value.free, ei.value.total) == (2, 1, 4)
    assert isinstance(ei.value, GraphDSLError)
    assert m.num_free_blocks == 1 and 2 not in m
    with pytest.raises(OutOfBlocks, match=r"needs 2 more blocks for 30 more tokens \(to 70\)"):
        m.append(1, 30)
    assert m.num_tokens(1) == 40 and m.block_table(1) == [0, 1, 2]


def test_numpy_and_torch_integers_are_accepted():
    import numpy as np
    m = BlockManager(np.int64(4), torch.tensor(4))
    assert m.allocate("a", np.int32(5)) == [0, 1] and m.append("a", torch.tensor(4)) == [0, 1, 2]
    assert m.num_tokens("a") == 9 and type(m.num_tokens("a")) is int
    with pytest.raises(GraphDSLError, match=r"n_tokens must be an integer >= 0, got tensor\(1.5000\)"):
        m.allocate("b", torch.tensor(1.5))
    with pytest.raises(GraphDSLError, match="num_blocks must be an integer >= 1, got True"):
        BlockManager(True, 4)


def test_manager_errors():
    m = BlockManager(4, 4)
    m.allocate("a", 3)
    with pytest.raises(GraphDSLError, match="sequence 'a' already has blocks"):
        m.allocate("a", 1)
    with pytest.raises(GraphDSLError, match=r"unknown sequence 'zz' \(allocate\(\) it first"):
        m.block_table("zz")
    with pytest.raises(GraphDSLError, match="unknown sequence 'zz'"):
        m.free("zz")
    with pytest.raises(GraphDSLError, match="unknown sequence 'zz'"):
        m.append("zz", 1)
    with pytest.raises(GraphDSLError, match=r"need 0 <= start <= end <= 3"):
        m.slot_mapping("a", 0, 4)
    with pytest.raises(GraphDSLError, match="n_tokens must be an integer >= 0, got -1"):
        m.allocate("b", -1)
    with pytest.raises(GraphDSLError, match="n_new_tokens must be an integer >= 0, got 1.5"):
        m.append("a", 1.5)
    with pytest.raises(GraphDSLError, match="num_blocks must be an integer >= 1, got 0"):
        BlockManager(0, 4)


# ---------------------------------------------------------------- round trip through the ops

def test_cache_feeds_reshape_and_cache_and_paged_attention():
    """Prefill two sequences then decode one token each through the reference ops; compare with
    dense causal attention over the same keys/values."""
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    cache = PagedKVCache(1, kv_heads, dim, num_blocks=10, block_size=bs, dtype=torch.float32)
    m = BlockManager(cache.num_blocks, bs)
    lens = {"s0": 6, "s1": 9}
    m.allocate("s1", 0)                          # interleave tables so blocks are not contiguous
    m.allocate("s0", 2)
    m.append("s1", 5)
    m.append("s0", 4)
    m.append("s1", 4)
    k = {s: torch.randn(n + 1, kv_heads, dim) for s, n in lens.items()}
    v = {s: torch.randn(n + 1, kv_heads, dim) for s, n in lens.items()}
    q = {s: torch.randn(n + 1, heads, dim) for s, n in lens.items()}
    write = get_op("reshape_and_cache")
    attn = get_op("paged_attention")
    seqs = list(lens)
    slots = torch.tensor(sum((m.slot_mapping(s, 0, lens[s]) for s in seqs), []) + [-1])
    kk = torch.cat([k[s][: lens[s]] for s in seqs] + [torch.zeros(1, kv_heads, dim)])
    vv = torch.cat([v[s][: lens[s]] for s in seqs] + [torch.zeros(1, kv_heads, dim)])
    write.run([kk, vv, cache.key_caches[0], cache.value_caches[0], slots], {})
    # decode: one more token per sequence
    for s in seqs:
        m.append(s, 1)
    slots = torch.tensor([m.slot_mapping(s, lens[s], lens[s] + 1)[0] for s in seqs])
    write.run([torch.stack([k[s][-1] for s in seqs]), torch.stack([v[s][-1] for s in seqs]),
               cache.key_caches[0], cache.value_caches[0], slots], {})
    width = max(len(m.block_table(s)) for s in seqs)
    tables = torch.tensor([m.block_table(s) + [0] * (width - len(m.block_table(s))) for s in seqs])
    seq_lens = torch.tensor([m.num_tokens(s) for s in seqs])
    qd = torch.stack([q[s][-1] for s in seqs])
    scale = 1 / math.sqrt(dim)
    out = attn.run([qd, cache.key_caches[0], cache.value_caches[0], tables, seq_lens],
                   {"scale": scale, "sliding_window": 0, "soft_cap": 0.0})[0]
    for i, s in enumerate(seqs):
        kf = k[s].repeat_interleave(heads // kv_heads, dim=1)
        vf = v[s].repeat_interleave(heads // kv_heads, dim=1)
        ref = torch.einsum("hk,khd->hd", torch.softmax(torch.einsum("hd,khd->hk", q[s][-1], kf) * scale, -1), vf)
        torch.testing.assert_close(out[i], ref)
