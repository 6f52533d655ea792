"""runtime/kernels/paged_attention.py vs the paged_attention op's torch reference.

Prefill (varlen, causal, cached prefix read through shuffled block tables) and split-K decode, for
odd lengths, many sequences, GQA ratios 1/4/8, head dims 32..256, block sizes 16/32/64, sliding
window and soft-cap, in float32/float16/bfloat16. On CPU the kernels run under Triton's interpreter
(small shapes); with CUDA the same cases run compiled with every length scaled up ~16x.
"""
from __future__ import annotations

import importlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (see conftest.py)

import pytest  # noqa: E402

from graphdsl.errors import GraphDSLError  # noqa: E402
from graphdsl.opdef import get_op  # noqa: E402
from graphdsl.runtime.kernels import (  # noqa: E402
    paged_attention, paged_attention_decode, paged_attention_prefill)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
REF = get_op("paged_attention").reference
# relative Frobenius error ||out - ref|| / ||ref|| allowed per dtype (METHOD.md's bands)
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def _grow(lens, news):
    """On the GPU, scale the CPU case's lengths up (keeping them odd-ish and news <= lens)."""
    if not CUDA:
        return list(lens), list(news)
    big = [L * 16 + L % 7 for L in lens]
    return big, [min(n * 16 + n % 5, L) if n > 1 else n for n, L in zip(news, big)]


def make_case(lens, news, heads, kv_heads, head_dim, block_size, dtype, *, seed=0, device=DEVICE):
    """Random caches whose blocks are handed to sequences in shuffled order; the unused table
    entries point at real (random) blocks too, so reading past a context shows up as an error."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [(L + block_size - 1) // block_size for L in lens]
    num_blocks = sum(per_seq) + 5
    width = max(per_seq + [1]) + 2
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(lens), width), generator=g, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(per_seq):
        tables[s, :nb] = order[used:used + nb]
        used += nb
    qsl = torch.tensor([0] + torch.tensor(news, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), heads, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (q, kc, vc, tables, seq_lens, qsl)]


def assert_close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out.float()).all(), "non-finite output (unwritten rows?)"
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]:.0e}"


def _nan_like(q):
    return torch.full_like(q, float("nan"))


# (lens, news): context lengths and how many of their last tokens are this step's queries
PREFILL_SEQS = {
    "one_token": ([1], [1]),
    "odd_single": ([33], [33]),
    "many_mixed": ([1, 7, 33, 64, 100, 17], [1, 7, 5, 64, 3, 0]),
    "prefix_chunks": ([40, 97], [9, 31]),
}


@pytest.mark.parametrize("seqs", list(PREFILL_SEQS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_prefill_shapes_and_gqa(seqs, heads, kv_heads):
    lens, news = _grow(*PREFILL_SEQS[seqs])
    dtype = torch.float32
    q, kc, vc, bt, sl, qsl = make_case(lens, news, heads, kv_heads, 64, 16, dtype)
    out = paged_attention_prefill(q, kc, vc, bt, sl, qsl, scale=0.125, out=_nan_like(q))
    assert_close(out, REF(q, kc, vc, bt, sl, qsl, scale=0.125), dtype)


@pytest.mark.parametrize("head_dim,block_size,dtype", [
    (128, 32, torch.float16), (64, 64, torch.bfloat16), (128, 16, torch.bfloat16),
    (32, 16, torch.float32), (256, 32, torch.float16)])
def test_prefill_dims_blocks_dtypes(head_dim, block_size, dtype):
    lens, news = _grow([7, 70, 33], [7, 20, 1])
    q, kc, vc, bt, sl, qsl = make_case(lens, news, 8, 2, head_dim, block_size, dtype, seed=1)
    scale = head_dim ** -0.5
    out = paged_attention_prefill(q, kc, vc, bt, sl, qsl, scale=scale)
    assert_close(out, REF(q, kc, vc, bt, sl, qsl, scale=scale), dtype)


@pytest.mark.parametrize("window,cap", [(5, 0.0), (0, 2.5), (16, 4.0), (1, 0.0), (70, 0.0), (10_000, 0.0)])
def test_prefill_window_and_softcap(window, cap):
    lens, news = _grow([50, 9, 33, 200], [20, 9, 2, 5])
    dtype = torch.float32
    q, kc, vc, bt, sl, qsl = make_case(lens, news, 8, 4, 64, 16, dtype, seed=2)
    q = q * 3   # larger scores so the cap bends them
    kw = dict(scale=0.2, sliding_window=window, soft_cap=cap)
    out = paged_attention_prefill(q, kc, vc, bt, sl, qsl, **kw)
    assert_close(out, REF(q, kc, vc, bt, sl, qsl, **kw), dtype)


def test_prefill_strided_q_and_int64_tables():
    """q as a view of a fused qkv projection output, int64 tables/lengths, into a strided out."""
    lens, news = _grow([12, 30], [12, 4])
    q, kc, vc, bt, sl, qsl = make_case(lens, news, 4, 2, 64, 16, torch.float32, seed=3)
    qkv = torch.randn(q.shape[0], 8, 64, device=q.device)
    qkv[:, :4] = q
    qv = qkv[:, :4]
    out_buf = torch.full((q.shape[0], 6, 64), float("nan"), device=q.device)
    out = paged_attention_prefill(qv, kc, vc, bt.long(), sl.long(), qsl.long(), scale=0.125,
                                  out=out_buf[:, 1:5])
    assert out.data_ptr() == out_buf[:, 1:5].data_ptr()
    assert_close(out, REF(q, kc, vc, bt, sl, qsl, scale=0.125), torch.float32)
    assert torch.isnan(out_buf[:, 0]).all() and torch.isnan(out_buf[:, 5]).all()


DECODE_LENS = {"short": [1, 7, 33], "many": [5, 64, 65, 100, 1, 257], "long": [300]}


@pytest.mark.parametrize("lens,num_splits", [("short", 1), ("short", 3), ("many", 1), ("many", 5),
                                             ("many", None), ("long", 8), ("long", None)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 1)])
def test_decode_splits_and_gqa(lens, num_splits, heads, kv_heads):
    lens, _ = _grow(DECODE_LENS[lens], [])
    dtype = torch.float32
    q, kc, vc, bt, sl, _ = make_case(lens, [1] * len(lens), heads, kv_heads, 64, 16, dtype, seed=4)
    out = paged_attention_decode(q, kc, vc, bt, sl, scale=0.125, num_splits=num_splits, out=_nan_like(q))
    assert_close(out, REF(q, kc, vc, bt, sl, scale=0.125), dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padded_slots_give_zeros(num_splits):
    """seq_len 0 (a padded slot of a CUDA-graph decode batch): zeros, not NaN; the others exact."""
    lens, _ = _grow([9, 40], [])
    q, kc, vc, bt, sl, _ = make_case(lens + [1], [1] * 3, 4, 2, 64, 16, torch.float32, seed=8)
    sl[2] = 0
    out = paged_attention_decode(q, kc, vc, bt, sl, scale=0.125, num_splits=num_splits, out=_nan_like(q))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert_close(out[:2], REF(q[:2], kc, vc, bt[:2], sl[:2], scale=0.125), torch.float32)


@pytest.mark.parametrize("head_dim,block_size,dtype,heads,kv_heads,splits", [
    (128, 32, torch.float16, 8, 2, 4), (64, 64, torch.bfloat16, 8, 2, 1),
    (128, 16, torch.bfloat16, 32, 8, 2), (32, 16, torch.float32, 2, 1, 4), (256, 64, torch.float16, 4, 1, 3)])
def test_decode_dims_blocks_dtypes(head_dim, block_size, dtype, heads, kv_heads, splits):
    lens, _ = _grow([3, 130, 64], [])
    q, kc, vc, bt, sl, _ = make_case(lens, [1] * 3, heads, kv_heads, head_dim, block_size, dtype, seed=5)
    scale = head_dim ** -0.5
    out = paged_attention_decode(q, kc, vc, bt, sl, scale=scale, num_splits=splits)
    assert_close(out, REF(q, kc, vc, bt, sl, scale=scale), dtype)


@pytest.mark.parametrize("window,cap,splits", [(5, 0.0, 3), (0, 3.0, 2), (20, 2.0, 4), (1, 0.0, 2),
                                               (64, 0.0, 1)])
def test_decode_window_and_softcap(window, cap, splits):
    lens, _ = _grow([100, 3, 64, 21], [])
    q, kc, vc, bt, sl, _ = make_case(lens, [1] * 4, 8, 2, 64, 32, torch.float32, seed=6)
    q = q * 3
    kw = dict(scale=0.2, sliding_window=window, soft_cap=cap)
    out = paged_attention_decode(q, kc, vc, bt, sl, num_splits=splits, **kw)
    assert_close(out, REF(q, kc, vc, bt, sl, **kw), torch.float32)


def _slopes(heads):
    """Bloom's ALiBi slopes (2^(-8i/n) for n = heads, a power of two), as a tuple and a device tensor."""
    slopes = tuple(2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads))
    return slopes, torch.tensor(slopes, device=DEVICE)


@pytest.mark.parametrize("heads,kv_heads,window,dtype", [(4, 4, 0, torch.float32), (8, 2, 16, torch.float32),
                                                         (8, 2, 0, torch.bfloat16), (4, 1, 5, torch.float16)])
def test_prefill_alibi(heads, kv_heads, window, dtype):
    """ALiBi: ``slope[h] * (k - p)`` added to the scores, in the masked and the unmasked tiles."""
    lens, news = _grow([50, 9, 33, 200], [20, 9, 2, 5])
    q, kc, vc, bt, sl, qsl = make_case(lens, news, heads, kv_heads, 64, 16, dtype, seed=11)
    slopes, t = _slopes(heads)
    kw = dict(scale=0.125, sliding_window=window)
    out = paged_attention_prefill(q, kc, vc, bt, sl, qsl, alibi_slopes=t, out=_nan_like(q), **kw)
    ref = REF(q, kc, vc, bt, sl, qsl, alibi_slopes=slopes, **kw)
    assert_close(out, ref, dtype)
    assert (ref.float() - REF(q, kc, vc, bt, sl, qsl, **kw).float()).abs().max() > 0.05   # the bias matters


@pytest.mark.parametrize("heads,kv_heads,window,cap,splits", [(4, 4, 0, 0.0, 1), (8, 2, 0, 0.0, 3),
                                                              (8, 2, 20, 2.0, 4), (4, 1, 0, 0.0, None)])
def test_decode_alibi(heads, kv_heads, window, cap, splits):
    lens, _ = _grow([100, 3, 64, 21], [])
    q, kc, vc, bt, sl, _ = make_case(lens, [1] * 4, heads, kv_heads, 64, 32, torch.float32, seed=12)
    slopes, t = _slopes(heads)
    kw = dict(scale=0.2, sliding_window=window, soft_cap=cap)
    out = paged_attention_decode(q, kc, vc, bt, sl, num_splits=splits, alibi_slopes=t, out=_nan_like(q), **kw)
    assert_close(out, REF(q, kc, vc, bt, sl, alibi_slopes=slopes, **kw), torch.float32)
    with pytest.raises(GraphDSLError, match=r"alibi_slopes must be None or a contiguous \[4\] float32 tensor"):
        paged_attention_decode(q[:, :4], kc, vc, bt, sl, scale=0.2, alibi_slopes=t.double()[:4])


def test_cache_then_prefill_then_decode_round_trip():
    """Chunked prefill then decode through reshape_and_cache; prefill of a one-token step equals
    decode, and the op-shaped dispatcher picks the right kernel."""
    from graphdsl.runtime.kernels import reshape_and_cache
    torch.manual_seed(7)
    bs, hk, h, d = 16, 2, 4, 64
    total = 45 if not CUDA else 45 * 16
    kc = torch.zeros(total // bs + 4, bs, hk, d, device=DEVICE)
    vc = torch.zeros_like(kc)
    table = torch.randperm(kc.shape[0], device=DEVICE)[None, :].to(torch.int32)
    keys, values = torch.randn(total, hk, d, device=DEVICE), torch.randn(total, hk, d, device=DEVICE)
    qs = torch.randn(total, h, d, device=DEVICE)
    slots = (table[0].long()[torch.arange(total, device=DEVICE) // bs] * bs + torch.arange(total, device=DEVICE) % bs)
    cut = total * 2 // 3
    outs = []
    for a, b in ((0, cut // 2), (cut // 2, cut)):       # two prefill chunks
        reshape_and_cache(keys[a:b], values[a:b], kc, vc, slots[a:b])
        sl = torch.tensor([b], dtype=torch.int32, device=DEVICE)
        qsl = torch.tensor([0, b - a], dtype=torch.int32, device=DEVICE)
        outs.append(paged_attention(qs[a:b], kc, vc, table, sl, qsl))
    for t in range(cut, total):                          # then one token at a time
        reshape_and_cache(keys[t:t + 1], values[t:t + 1], kc, vc, slots[t:t + 1])
        sl = torch.tensor([t + 1], dtype=torch.int32, device=DEVICE)
        outs.append(paged_attention(qs[t:t + 1], kc, vc, table, sl))
    got = torch.cat(outs)
    # the whole sequence as one prefill over a cache written by the reference op
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    get_op("reshape_and_cache").reference(keys, values, kr, vr, slots)
    full_sl = torch.tensor([total], dtype=torch.int32, device=DEVICE)
    full_qsl = torch.tensor([0, total], dtype=torch.int32, device=DEVICE)
    assert_close(got, REF(qs, kr, vr, table, full_sl, full_qsl, scale=d ** -0.5), torch.float32)


@pytest.mark.parametrize("change,msg", [
    (lambda a: a.update(q=a["q"][..., :48], key_cache=a["key_cache"][..., :48],
                        value_cache=a["value_cache"][..., :48]), r"head_dim must be a power of two in \[16, 256\], got 48"),
    (lambda a: a.update(q=a["q"].half()), r"key_cache.dtype must be q's dtype torch.float16, got torch.float32"),
    (lambda a: a.update(q=a["q"][:, :3]), r"num_heads must be a multiple of num_kv_heads 2, got 3"),
    (lambda a: a.update(q=a["q"].int()), r"q.dtype must be float16, bfloat16 or float32, got torch.int32"),
    (lambda a: a.update(block_tables=a["block_tables"].float()), r"block_tables must be a \[num_seqs, max_blocks\]"),
    (lambda a: a.update(seq_lens=a["seq_lens"][:1]), r"block_tables.shape\[0\] must be num_seqs = len\(seq_lens\) = 1, got 2"),
    (lambda a: a.update(query_start_loc=a["query_start_loc"][:2]), r"query_start_loc must be a contiguous \[3\]"),
    (lambda a: a.update(sliding_window=-1), r"sliding_window must be an int >= 0, got -1"),
    (lambda a: a.update(out=torch.empty(2, 2)), r"out must be a \(\d+, 4, 64\) torch.float32 tensor, got \(2, 2\)"),
])
def test_prefill_errors_name_the_argument(change, msg):
    q, kc, vc, bt, sl, qsl = make_case([5, 9], [5, 2], 4, 2, 64, 16, torch.float32)
    args = dict(q=q, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=sl, query_start_loc=qsl,
                scale=0.1, sliding_window=0)
    change(args)
    with pytest.raises(GraphDSLError, match="paged_attention_prefill: " + msg):
        paged_attention_prefill(**args)


def test_decode_errors_name_the_argument():
    q, kc, vc, bt, sl, _ = make_case([5, 9], [1, 1], 4, 2, 64, 16, torch.float32)
    with pytest.raises(GraphDSLError, match=r"q.shape\[0\] must be num_seqs = len\(seq_lens\) = 2 "
                                            r"\(one query per sequence\), got 3"):
        paged_attention_decode(torch.cat([q, q[:1]]), kc, vc, bt, sl, scale=0.1)
    with pytest.raises(GraphDSLError, match=r"num_splits must be None or an int in \[1, 256\], got 0"):
        paged_attention_decode(q, kc, vc, bt, sl, scale=0.1, num_splits=0)
    with pytest.raises(GraphDSLError, match=r"soft_cap must be a float >= 0, got -1.0"):
        paged_attention_decode(q, kc, vc, bt, sl, scale=0.1, soft_cap=-1.0)
    n = 65536                                # one more sequence than the grid's second axis holds
    with pytest.raises(GraphDSLError, match=r"seq_lens must be at most 65535 sequences a launch, got 65536"):
        paged_attention_decode(q[:1].expand(n, -1, -1), kc, vc, bt[:1].expand(n, -1).contiguous(),
                               sl[:1].expand(n).contiguous(), scale=0.1)


def test_first_tile_prefetch_only_where_it_pays():
    """The first key tile is read before the PDL wait except in one-split grids of many waves with
    64 x 128 tiles (the launcher's rule; on this CPU device the grid counts 4 SMs)."""
    from graphdsl.runtime.kernels.paged_attention import _prefetch_first_tile
    cpu = torch.device("cpu")
    assert _prefetch_first_tile(1, 8, 16, 128, 4, cpu)            # batch 1, split: one wave
    assert not _prefetch_first_tile(256, 8, 1, 128, 4, cpu)       # 2048 programs of 64 x 128 tiles
    assert _prefetch_first_tile(256, 8, 1, 64, 4, cpu)            # head_dim 64: a 4096-element tile
    assert _prefetch_first_tile(256, 8, 2, 128, 4, cpu)           # split grids keep it
    assert _prefetch_first_tile(1, 8, 1, 128, 4, cpu)             # 8 programs, two per SM


def test_wide_one_split_grids_take_32_key_tiles(monkeypatch):
    """A one-split grid of more than ``_WIDE_GRID_PER_SM`` programs a SM (on the CPU device 4 SMs:
    36 sequences x 1 KV head) runs 32-key tiles, and gives the reference's output."""
    import importlib
    pa = importlib.import_module("graphdsl.runtime.kernels.paged_attention")   # (the package's attribute is the function)
    seen = []
    real = pa._pick_config
    monkeypatch.setattr(pa, "_pick_config", lambda *a, **k: seen.append(k.get("wide_grid")) or real(*a, **k))
    assert real(64, 4, decode=True, wide_grid=True).block_n == 32 and real(64, 4, decode=True).block_n == 64
    seqs = pa._WIDE_GRID_PER_SM * pa._sm_count(torch.device(DEVICE)) + 4
    lens, _ = _grow([40 + 3 * (i % 12) for i in range(seqs)], [])
    q, kc, vc, bt, sl, _ = make_case(lens, [1] * len(lens), 4, 1, 32, 16, torch.float32, seed=5)
    out = paged_attention_decode(q, kc, vc, bt, sl, scale=0.125, num_splits=1, out=_nan_like(q))
    assert_close(out, REF(q, kc, vc, bt, sl, scale=0.125), torch.float32)
    assert seen[-1] is True


def test_one_tile_splits_where_the_grid_has_room(monkeypatch):
    """Few sequences: the keys split into one ``_SPLIT_TILE_KEYS`` tile a split (read before the PDL
    wait), launched with that tile, ``_SPLIT_STAGES`` stages and, at head_dim 128, the wide warp
    count; where that many splits would crowd the grid, 128-key splits as before (the CPU device
    counts 4 SMs: two programs a SM is 8 programs). The fused rope/cache decode with one-tile
    splits gives the reference's output."""
    import importlib
    from graphdsl.functional.attention import RopeLayout
    from graphdsl.runtime.kernels.paged_attention import DecodeRopeCache
    pa = importlib.import_module("graphdsl.runtime.kernels.paged_attention")
    cpu = torch.device("cpu")
    assert pa._default_splits(1, 1, 6 * pa._SPLIT_TILE_KEYS, cpu) == 6              # 6 programs <= 8
    assert pa._default_splits(1, 1, 9 * pa._SPLIT_TILE_KEYS, cpu) == 5              # 9 > 8: 128-key splits
    assert pa._default_splits(1, 4, 592, cpu) == 2                                  # 4 heads x 10 > 8
    monkeypatch.setattr(pa, "_ONE_TILE_SPLITS", False)
    assert pa._default_splits(1, 1, 6 * pa._SPLIT_TILE_KEYS, cpu) == 3
    monkeypatch.setattr(pa, "_ONE_TILE_SPLITS", True)
    cfg = pa._pick_config(128, 4, decode=True, prefetch_splits=True, one_tile=True)
    assert (cfg.block_n, cfg.num_stages, cfg.num_warps) == (pa._SPLIT_TILE_KEYS, pa._SPLIT_STAGES,
                                                            pa._SPLIT_WARPS_WIDE)
    assert pa._pick_config(64, 4, decode=True, prefetch_splits=True, one_tile=True).num_warps == pa._DECODE_WARPS
    assert pa._pick_config(128, 4, decode=True, prefetch_splits=True).block_n == 32     # several tiles a split
    seen = []
    real = pa._pick_config
    monkeypatch.setattr(pa, "_pick_config", lambda *a, **k: seen.append(k.get("one_tile")) or real(*a, **k))
    lens = [300]
    q, k, v, kc, vc, cos, sin, slots, bt, sl = _rope_case(lens, 4, 1, 64, torch.float32, 32)
    lay = RopeLayout("neox")
    kr, vr = kc.clone(), vc.clone()
    want, _, _ = RCA_REF(q, k, v, kr, vr, cos, sin, slots, bt, sl, layout=lay, scale=0.125)
    splits = pa.decode_num_splits(1, 1, bt.shape[1], 16, 0, q.device)
    out = paged_attention_decode(q, kc, vc, bt, sl, scale=0.125, out=_nan_like(q), num_splits=splits,
                                 rope_cache=DecodeRopeCache(k, v, cos, sin, slots, lay), inputs_ready=True,
                                 cache_ready=True)
    assert_close(out, want, torch.float32)
    assert splits == 6 and seen[-1] is True                  # 21 blocks x 16 = 336 keys: six 64-key tiles


# -- decode fused with RoPE + cache write (the rope_cache_attention op) ---------------------------
RCA_REF = get_op("rope_cache_attention").reference


def _rope_case(lens, heads, kv_heads, head_dim, dtype, half, *, seed=9, pad_last=False):
    """A decode step: un-rotated q/k/v of the new token of each sequence, cos/sin of position L - 1
    and the slot of that position (-1 and L = 0 for a padded last sequence)."""
    from graphdsl.runtime.kernels.paged_attention import DecodeRopeCache  # noqa: F401 (import check)
    q, kc, vc, bt, sl, _ = make_case(lens, [1] * len(lens), heads, kv_heads, head_dim, 16, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    n = len(lens)
    k = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype).to(q.device)
    v = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype).to(q.device)
    pos = torch.tensor(lens, dtype=torch.float32) - 1
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(half, dtype=torch.float32) / half))[None, :]
    cos, sin = freqs.cos().to(q.device), freqs.sin().to(q.device)
    slots = [int(bt[s, (L - 1) // 16]) * 16 + (L - 1) % 16 for s, L in enumerate(lens)]
    if pad_last:
        sl[-1], slots[-1] = 0, -1
    slots = torch.tensor(slots, dtype=torch.int64, device=q.device)
    return q, k, v, kc, vc, cos, sin, slots, bt, sl


@pytest.mark.parametrize("layout,half,head_dim,heads,kv_heads,dtype,splits", [
    ("neox", 32, 64, 4, 4, torch.float32, 1), ("neox", 32, 64, 8, 2, torch.float32, 3),
    ("gptj", 32, 64, 8, 1, torch.float32, 4), ("neox", 16, 64, 8, 2, torch.float32, 2),
    ("gptj", 8, 32, 4, 2, torch.float32, None), ("neox", 64, 128, 8, 1, torch.bfloat16, 5),
    ("neox", 64, 128, 16, 2, torch.float16, 2)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_decode_with_rope_cache_equals_rope_cache_then_attention(layout, half, head_dim, heads, kv_heads, dtype,
                                                                  splits, prefetch):
    """Rotating q/k in the kernel and writing the new key/value first gives the reference's
    output and caches: NEOX and GPT-J pairs, partial rotary dims, GQA 1/4/8, splits 1..5; also
    with each split's first tile read before the PDL wait and the new key patched in."""
    from graphdsl.functional.attention import RopeLayout
    from graphdsl.runtime.kernels.paged_attention import DecodeRopeCache
    lens, _ = _grow([9, 40, 1, 70, 33], [])
    q, k, v, kc, vc, cos, sin, slots, bt, sl = _rope_case(lens, heads, kv_heads, head_dim, dtype, half)
    lay = RopeLayout(layout)
    kr, vr = kc.clone(), vc.clone()
    want, kr, vr = RCA_REF(q, k, v, kr, vr, cos, sin, slots, bt, sl, layout=lay, scale=head_dim ** -0.5)
    out = paged_attention_decode(q, kc, vc, bt, sl, scale=head_dim ** -0.5, num_splits=splits, out=_nan_like(q),
                                 rope_cache=DecodeRopeCache(k, v, cos, sin, slots, lay), inputs_ready=prefetch,
                                 cache_ready=prefetch)
    assert_close(out, want, dtype)
    torch.testing.assert_close(vc, vr, rtol=0, atol=0)             # values are copied
    torch.testing.assert_close(kc.float(), kr.float(), rtol=TOL[dtype], atol=TOL[dtype])   # rotated keys


@pytest.mark.parametrize("window,cap,prefetch", [(5, 0.0, False), (0, 3.0, False), (40, 2.0, False), (5, 0.0, True),
                                                (40, 2.0, True)])
def test_decode_with_rope_cache_window_softcap_and_padding(window, cap, prefetch):
    """Sliding window and soft-cap with the fused cache write; a padded slot (L = 0, slot -1)
    writes nothing and gives zeros."""
    from graphdsl.functional.attention import RopeLayout
    from graphdsl.runtime.kernels.paged_attention import DecodeRopeCache
    lens, _ = _grow([50, 7, 90, 1], [])
    q, k, v, kc, vc, cos, sin, slots, bt, sl = _rope_case(lens, 8, 2, 64, torch.float32, 32, pad_last=True)
    kw = dict(scale=0.2, sliding_window=window, soft_cap=cap)
    kr, vr = kc.clone(), vc.clone()
    want, kr, vr = RCA_REF(q[:3], k[:3], v[:3], kr, vr, cos[:3], sin[:3], slots[:3], bt[:3], sl[:3],
                           layout=RopeLayout.NEOX, **kw)
    out = paged_attention_decode(q, kc, vc, bt, sl, num_splits=3, out=_nan_like(q), **kw,
                                 rope_cache=DecodeRopeCache(k, v, cos, sin, slots, RopeLayout.NEOX),
                                 inputs_ready=prefetch, cache_ready=prefetch)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert_close(out[:3], want, torch.float32)
    torch.testing.assert_close(kc, kr, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(vc, vr, rtol=0, atol=0)


def test_decode_split_counters_reset_and_results_repeat():
    """The split combine leaves every counter at 0 (so graph replays need no memset), and runs
    that reuse one workspace are bitwise equal (splits are summed in order, whoever arrives last)."""
    from graphdsl.runtime.kernels.paged_attention import decode_workspace
    lens, _ = _grow([300, 5, 129], [])
    q, kc, vc, bt, sl, _ = make_case(lens, [1] * 3, 8, 2, 64, 16, torch.float32, seed=11)
    ws = decode_workspace(3, 8, 2, 64, 4, q.device)
    first = paged_attention_decode(q, kc, vc, bt, sl, scale=0.125, num_splits=4, workspace=ws)
    assert torch.count_nonzero(ws.counters) == 0
    for _ in range(3):
        again = paged_attention_decode(q, kc, vc, bt, sl, scale=0.125, num_splits=4, workspace=ws)
        assert torch.equal(again, first)
    assert torch.count_nonzero(ws.counters) == 0
    assert_close(first, REF(q, kc, vc, bt, sl, scale=0.125), torch.float32)


def test_decode_workspace_and_rope_cache_errors_name_the_argument():
    from graphdsl.functional.attention import RopeLayout
    from graphdsl.runtime.kernels.paged_attention import DecodeRopeCache, decode_workspace
    q, k, v, kc, vc, cos, sin, slots, bt, sl = _rope_case([9, 20], 4, 2, 64, torch.float32, 32)
    ws = decode_workspace(2, 4, 2, 64, 3, q.device)
    with pytest.raises(GraphDSLError, match=r"workspace.counters must be a contiguous \(2, 2\) torch.int32 tensor"):
        paged_attention_decode(q, kc, vc, bt, sl, scale=0.1, num_splits=3, workspace=ws._replace(
            counters=torch.zeros(2, 2, device=q.device)))
    with pytest.raises(GraphDSLError, match=r"workspace must be None or a DecodeWorkspace"):
        paged_attention_decode(q, kc, vc, bt, sl, scale=0.1, num_splits=3, workspace=tuple(ws)[:2])
    with pytest.raises(GraphDSLError, match=r"rope_cache.key must be a \[2, 2, 64\] tensor"):
        paged_attention_decode(q, kc, vc, bt, sl, scale=0.1,
                               rope_cache=DecodeRopeCache(k[:1], v, cos, sin, slots, RopeLayout.NEOX))
    with pytest.raises(GraphDSLError, match=r"rope_cache.cos.shape\[1\] must be <= head_dim / 2 = 32, got 40"):
        big = torch.zeros(2, 40, device=q.device)
        paged_attention_decode(q, kc, vc, bt, sl, scale=0.1,
                               rope_cache=DecodeRopeCache(k, v, big, big, slots, RopeLayout.NEOX))
    with pytest.raises(GraphDSLError, match=r"rope_cache.slot_mapping must be a contiguous \[2\] int32/int64"):
        paged_attention_decode(q, kc, vc, bt, sl, scale=0.1,
                               rope_cache=DecodeRopeCache(k, v, cos, sin, slots.float(), RopeLayout.NEOX))


def test_decode_widths_keep_the_tables_that_shrink_the_grid(monkeypatch):
    """The block-table widths worth a decode graph of their own (H200's 132 SMs): a narrower table
    is kept where it makes one-tile splits or halves them against the next wider kept, per
    attention window; the rows and tables that launch one grid share a width."""
    pa = importlib.import_module("graphdsl.runtime.kernels.paged_attention")
    monkeypatch.setattr(pa, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    widths = {n: pa.decode_widths(n, 8, 129, 16, (0,), cpu) for n in (1, 2, 4, 8, 64)}
    assert widths == {1: (32, 64, 129), 2: (32, 64, 129), 4: (32, 129), 8: (129,), 64: (129,)}
    for n, ws in widths.items():
        grids = [pa._grid_of(n, 8, w, 16, 0, cpu) for w in ws]
        assert all(a != b for a, b in zip(grids, grids[1:])), (n, grids)
    assert pa._grid_of(1, 8, 32, 16, 0, cpu) == (8, True) and pa._grid_of(1, 8, 129, 16, 0, cpu) == (33, True)
    assert pa.decode_widths(1, 8, 2048, 16, (0,), cpu) == (32, 64, 128, 2048)   # long tables keep their grid
    assert pa.decode_widths(1, 8, 129, 16, (256,), cpu) == (129,)    # a window of 256 keys: one grid for all
    assert pa.decode_widths(1, 8, 129, 16, (0, 256), cpu) == (32, 64, 129)
    assert pa.decode_widths(1, 8, 129, 16, (0,), cpu, floor_keys=2048) == (129,)
    assert pa.decode_widths(1, 8, 32, 16, (0,), cpu) == (32,)


@pytest.mark.parametrize("narrow", [3, 5])
def test_decode_through_a_narrower_table_is_the_same(narrow):
    """A table only as wide as the sequences' blocks (fewer splits) gives the wide table's output."""
    g = torch.Generator().manual_seed(narrow)
    heads, kv_heads, dim, bs = 4, 2, 32, 8
    kc = torch.randn(24, bs, kv_heads, dim, generator=g)
    vc = torch.randn(24, bs, kv_heads, dim, generator=g)
    lens = torch.tensor([narrow * bs - 3, 9], dtype=torch.int32)
    tables = torch.zeros(2, 12, dtype=torch.int32)
    tables[0, :narrow] = torch.tensor([5, 1, 17, 9, 2][:narrow])
    tables[1, :2] = torch.tensor([11, 4])
    q = torch.randn(2, heads, dim, generator=g)
    wide = paged_attention_decode(q, kc, vc, tables, lens, scale=dim ** -0.5)
    thin = paged_attention_decode(q, kc, vc, tables[:, :narrow].contiguous(), lens, scale=dim ** -0.5)
    torch.testing.assert_close(thin, wide, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("front", [True, False])
def test_prefill_with_empty_padding_sequences(front):
    """Sequences with no tokens (a padded prefill step's, at the front or the end) change no output."""
    lens, news = _grow([12, 30], [12, 4])
    q, kc, vc, bt, sl, qsl = make_case(lens, news, 4, 2, 64, 16, torch.float32, seed=5)
    want = paged_attention_prefill(q, kc, vc, bt, sl, qsl, scale=0.125)
    pad = 6
    zeros = torch.zeros(pad, bt.shape[1], dtype=bt.dtype, device=bt.device)
    psl = torch.zeros(pad, dtype=sl.dtype, device=sl.device)
    if front:
        bt2, sl2 = torch.cat([zeros, bt]), torch.cat([psl, sl])
        qsl2 = torch.cat([torch.zeros(pad, dtype=qsl.dtype, device=qsl.device), qsl])
    else:
        bt2, sl2 = torch.cat([bt, zeros]), torch.cat([sl, psl])
        qsl2 = torch.cat([qsl, qsl[-1:].expand(pad)])
    got = paged_attention_prefill(q, kc, vc, bt2, sl2, qsl2, scale=0.125)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_prefill_finds_sequences_by_vector_load_as_by_binary_search(monkeypatch):
    """A program's sequence, found in one load of query_start_loc (up to _SEQ_VEC_MAX sequences) or
    by binary search past it: the same outputs, with empty sequences among the others."""
    pa = importlib.import_module("graphdsl.runtime.kernels.paged_attention")
    lens, news = _grow([5, 9, 3, 12, 7, 4, 30, 2, 6, 11], [5, 1, 3, 4, 7, 2, 9, 2, 6, 1])
    q, kc, vc, bt, sl, qsl = make_case(lens, news, 4, 2, 32, 8, torch.float32, seed=9)
    qsl2 = torch.cat([qsl[:4], qsl[3:4].expand(2), qsl[4:]])      # two empty sequences after the third
    bt2 = torch.cat([bt[:3], torch.zeros_like(bt[:2]), bt[3:]])
    sl2 = torch.cat([sl[:3], torch.zeros_like(sl[:2]), sl[3:]])
    outs = []
    for cap in (1024, 0):
        monkeypatch.setattr(pa, "_SEQ_VEC_MAX", cap)
        outs.append(paged_attention_prefill(q, kc, vc, bt2, sl2, qsl2, scale=0.2))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert_close(outs[0], REF(q, kc, vc, bt, sl, qsl, scale=0.2), torch.float32)
