"""Triton kernels for ``paged_mla_attention``: weight-absorbed latent attention over paged blocks.

Semantics (``graphdsl.functional.attention.paged_mla_attention``, whose torch reference defines
them): every query head attends over one latent per position, ``c[k] = key_cache[k] ++
value_cache[k]`` (``LORA + ROPE`` numbers stored as two halves of ``HALF``), causally: query ``i`` of
a sequence with context ``L`` and ``n`` new queries sits at ``p = L - n + i`` and sees keys
``0..p``::

    score[k] = q · c[k] * scale                        (float32)
    out      = sum_k softmax(score)[k] * c[k][:LORA]    (float32, stored in q's dtype)

The latent's first ``LORA`` numbers (DeepSeek's ``c_kv``, also the value) are ``key_cache`` row
then the start of the ``value_cache`` row; its last ``ROPE`` numbers (the RoPE key) lie wholly in
``value_cache`` (``LORA >= ROPE``). Each tile is loaded once and serves ``q_c · c`` and ``P · c``.

One kernel serves both phases, grid ``(num_tokens, cdiv(num_heads, BLOCK_H), num_splits)``: a
program takes one query token and ``BLOCK_H`` of its heads (all heads share the latent, so a
key tile is loaded once for them), finds the token's sequence by binary search over
``query_start_loc`` (decode: token ``t`` is sequence ``t``), and runs the online softmax in base 2
over its split's part of the keys ``[0, p]``. With one split it stores ``acc / l``; with several
each stores ``acc, m, l`` in the workspace and :func:`_combine_kernel` merges them::

    M = max_j m_j,   out = sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M) l_j

(zeros for a row that saw no key: a padded decode slot with ``seq_lens = 0``). Prefill therefore
reads each key tile once per query token — simple, memory-light (only the latent), and fine for
chunks; a query-tiled prefill kernel is the next step when prefill speed matters.

File shape (STYLE.md 11): the ``@triton.jit`` kernels, the heuristic :func:`_pick_config` and
:func:`mla_num_splits`, a launcher that checks every argument, and the thin public wrapper.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

from .paged_attention import _mm   # a @ b in float32 at the given tl.dot precision
from .pdl import pdl_launch, pdl_wait

__all__ = ["paged_mla_attention", "mla_num_splits", "mla_workspace", "MLAWorkspace"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _mla_kernel(
    q_ptr,              # [num_tokens, num_heads, LORA + ROPE] absorbed queries (last dim contiguous)
    k_cache_ptr,        # [num_blocks, block_size, 1, HALF] first half of each position's latent
    v_cache_ptr,        # [num_blocks, block_size, 1, HALF] second half
    out_ptr,            # [num_tokens, num_heads, LORA] output, q's dtype
    part_acc_ptr,       # [num_tokens, num_heads, NUM_SPLITS, LORA] float32 partial acc (NUM_SPLITS > 1)
    part_ml_ptr,        # [2, num_tokens, num_heads, NUM_SPLITS] float32 partial max m (0) and sum l (1)
    block_tables_ptr,   # [num_seqs, max_blocks] cache block of each sequence's j-th block
    seq_lens_ptr,       # [num_seqs] context length L, this step's tokens included
    qsl_ptr,            # [num_seqs + 1] query_start_loc (read only when PREFILL)
    scale,              # float, multiplies q · c
    num_tokens,         # int, rows of q
    num_seqs,           # int
    search_steps,       # int, ceil(log2(num_seqs)) binary-search steps (PREFILL)
    stride_qt, stride_qh,              # q strides (tokens, heads)
    stride_ot, stride_oh,              # out strides (tokens, heads)
    stride_kb, stride_ks,              # key cache strides (block, slot)
    stride_vb, stride_vs,              # value cache strides (block, slot)
    stride_bt,                         # block_tables stride between sequences
    NUM_HEADS: tl.constexpr,   # query heads
    LORA: tl.constexpr,        # the latent's value part (power of two >= 16)
    ROPE: tl.constexpr,        # the latent's RoPE part (power of two >= 16, <= LORA)
    HALF: tl.constexpr,        # (LORA + ROPE) / 2, numbers per cache row
    BLOCK_SIZE: tl.constexpr,  # cache block size
    BLOCK_H: tl.constexpr,     # heads per program (>= 16: tl.dot's smallest M)
    BLOCK_N: tl.constexpr,     # keys per inner step
    NUM_SPLITS: tl.constexpr,  # partitions of each query's keys
    PREFILL: tl.constexpr,     # queries packed by query_start_loc (else one per sequence)
    DOT_PREC: tl.constexpr,    # tl.dot input_precision ("tf32x3" for float32 caches)
    DOT_F32: tl.constexpr,     # upcast dot operands (interpreter only)
    USE_PDL: tl.constexpr,     # launched with programmatic dependent launch (kernels/pdl.py)
):
    """Program ``(t, hb, j)``: heads ``[hb * BLOCK_H, (hb + 1) * BLOCK_H)`` of query token ``t`` at
    position ``p``; keys ``[0, p + 1)`` cut into ``cdiv(p + 1, BLOCK_N)`` tiles, split ``j`` taking
    ``[j * c, (j + 1) * c)`` of them (``c = cdiv(tiles, NUM_SPLITS)``)::

        S = log2(e) * scale * (q_c cᵀ + q_r rᵀ),  m' = max(m, rowmax S),  P = 2^(S - m')
        l = l 2^(m - m') + rowsum P,  acc = acc 2^(m - m') + P c
    """
    pdl_wait(USE_PDL)
    tok = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    if PREFILL:          # the sequence of this token: the largest s with qsl[s] <= tok
        lo_s = tok * 0
        hi_s = lo_s + num_seqs
        for _ in range(search_steps):
            mid = (lo_s + hi_s) // 2
            go_right = tl.load(qsl_ptr + mid).to(tl.int32) <= tok
            lo_s = tl.where(go_right, mid, lo_s)
            hi_s = tl.where(go_right, hi_s, mid)
        seq = lo_s
        first = tl.load(qsl_ptr + seq).to(tl.int32)
        n_new = tl.load(qsl_ptr + seq + 1).to(tl.int32) - first
        pos = tl.load(seq_lens_ptr + seq).to(tl.int32) - n_new + (tok - first)
        pos = tl.where(tok - first < n_new, pos, -1)   # a padding token past the last sequence: no keys
    else:
        seq = tok
        pos = tl.load(seq_lens_ptr + seq).to(tl.int32) - 1
    tiles = tl.cdiv(pos + 1, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(tiles, NUM_SPLITS), 1)
    start = split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, pos + 1)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < NUM_HEADS
    lora = tl.arange(0, LORA)
    rope = tl.arange(0, ROPE)
    q_row = q_ptr + tok.to(tl.int64) * stride_qt + h[:, None] * stride_qh
    q_c = tl.load(q_row + lora[None, :], mask=h_ok[:, None], other=0.0)
    q_r = tl.load(q_row + LORA + rope[None, :], mask=h_ok[:, None], other=0.0)
    in_key = lora < HALF                       # latent dims held by the key cache row

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LORA], tl.float32)
    for kstart in range(start, end, BLOCK_N):
        kpos = kstart + tl.arange(0, BLOCK_N)
        kvalid = kpos < end
        blk = tl.load(table + kpos // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
        k_row = k_cache_ptr + blk * stride_kb + (kpos % BLOCK_SIZE) * stride_ks
        v_row = v_cache_ptr + blk * stride_vb + (kpos % BLOCK_SIZE) * stride_vs
        c = tl.load(k_row[:, None] + lora[None, :], mask=kvalid[:, None] & in_key[None, :], other=0.0) \
            + tl.load(v_row[:, None] + (lora - HALF)[None, :], mask=kvalid[:, None] & ~in_key[None, :], other=0.0)
        r = tl.load(v_row[:, None] + (LORA - HALF + rope)[None, :], mask=kvalid[:, None], other=0.0)
        sc = _mm(q_c, tl.trans(c), DOT_PREC, DOT_F32) + _mm(q_r, tl.trans(r), DOT_PREC, DOT_F32)
        sc = sc * (scale * 1.4426950408889634)
        sc = tl.where(kvalid[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p.to(c.dtype), c, DOT_PREC, DOT_F32)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok.to(tl.int64) * stride_ot + h[:, None] * stride_oh + lora[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:
        row = (tok.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS + split
        tl.store(part_acc_ptr + row[:, None] * LORA + lora[None, :], acc, mask=h_ok[:, None])
        tl.store(part_ml_ptr + row, m_i, mask=h_ok)
        tl.store(part_ml_ptr + num_tokens * NUM_HEADS * NUM_SPLITS + row, l_i, mask=h_ok)


@triton.jit
def _combine_kernel(
    part_acc_ptr,       # [num_tokens, num_heads, NUM_SPLITS, LORA] float32
    part_ml_ptr,        # [2, num_tokens, num_heads, NUM_SPLITS] float32
    out_ptr,            # [num_tokens, num_heads, LORA]
    num_tokens,         # int
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, LORA: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
    USE_PDL: tl.constexpr,
):
    """Program ``(t, h)``: ``out = sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M) l_j`` (0 if no key)."""
    pdl_wait(USE_PDL)
    tok = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, SPLITS_PAD)
    ok = j < NUM_SPLITS
    row = (tok.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS + j
    m = tl.load(part_ml_ptr + row, mask=ok, other=-1.0e30)
    l = tl.load(part_ml_ptr + num_tokens * NUM_HEADS * NUM_SPLITS + row, mask=ok, other=0.0)
    w = tl.where(ok, tl.exp2(m - tl.max(m, 0)), 0.0)
    lora = tl.arange(0, LORA)
    acc = tl.load(part_acc_ptr + row[:, None] * LORA + lora[None, :], mask=ok[:, None], other=0.0)
    den = tl.sum(w * l, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + h * stride_oh + lora, o.to(out_ptr.dtype.element_ty))


class _Config(NamedTuple):
    block_h: int
    block_n: int
    num_warps: int


def _pick_config(num_heads: int, lora: int) -> _Config:
    """Heads per program: all of them up to 64 (one latent tile serves them all), at least 16
    (``tl.dot``); 32 keys a tile, 8 warps for DeepSeek's 512-wide latent (the ``[heads, 512]``
    float32 accumulator and the ``[32, 512]`` tile must stay in registers)."""
    block_h = max(16, min(64, triton.next_power_of_2(num_heads)))
    return _Config(block_h=block_h, block_n=32 if lora >= 256 else 16, num_warps=8 if lora >= 256 else 4)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


_MAX_SPLITS = 32
_MIN_KEYS_PER_SPLIT = 256


def mla_num_splits(num_tokens: int, num_heads: int, max_blocks: int, block_size: int, device, *,
                   prefill: bool) -> int:
    """Splits of each query's keys: one in prefill (the token grid fills the GPU); in decode,
    enough for about two programs per SM, but no split shorter than 256 keys of the longest
    context the block table can hold (shapes only, so a caller can size the workspace)."""
    if prefill:
        return 1
    programs = max(num_tokens * triton.cdiv(num_heads, _pick_config(num_heads, 16).block_h), 1)
    want = triton.cdiv(2 * _sm_count(torch.device(device)), programs)
    return max(1, min(want, triton.cdiv(max_blocks * block_size, _MIN_KEYS_PER_SPLIT), _MAX_SPLITS))


class MLAWorkspace(NamedTuple):
    """Split scratch (``workspace=``): per-split partial results, made by :func:`mla_workspace`."""

    part_acc: torch.Tensor   # [num_tokens, num_heads, num_splits, value_dim] float32
    part_ml: torch.Tensor    # [2, num_tokens, num_heads, num_splits] float32


def mla_workspace(num_tokens: int, num_heads: int, value_dim: int, num_splits: int, device) -> MLAWorkspace:
    f32 = dict(dtype=torch.float32, device=device)
    return MLAWorkspace(torch.empty(num_tokens, num_heads, num_splits, value_dim, **f32),
                        torch.empty(2, num_tokens, num_heads, num_splits, **f32))


def _interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def _fail(arg: str, expected: str, actual) -> None:
    raise GraphDSLError(f"paged_mla_attention: {arg} must be {expected}, got {actual}")


def _desc(x) -> str:
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _check(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, value_dim, out):
    """Validate; return ``(num_heads, lora, rope, half, block_size)``."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in _DTYPES or q.stride(2) != 1:
        _fail("q", "a [num_tokens, num_heads, latent_dim] float16/bfloat16/float32 tensor, last dim contiguous",
              _desc(q))
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4 or c.shape[2] != 1 or c.dtype != q.dtype \
                or c.stride(3) != 1:
            _fail(name, f"a [num_blocks, block_size, 1, latent_dim / 2] {q.dtype} tensor, last dim contiguous",
                  _desc(c))
    if tuple(key_cache.shape) != tuple(value_cache.shape):
        _fail("value_cache.shape", f"key_cache's {tuple(key_cache.shape)}", tuple(value_cache.shape))
    latent, half = q.shape[2], key_cache.shape[3]
    if latent != 2 * half:
        _fail("q.shape[2]", f"twice the caches' last dim ({2 * half})", latent)
    lora, rope = value_dim, latent - value_dim
    if not (isinstance(value_dim, int) and _pow2(lora) and _pow2(rope) and rope <= lora):
        _fail("value_dim", f"a power of two >= 16 leaving a power of two >= 16 and <= it of {latent} for the "
              f"RoPE part", repr(value_dim))
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else -1
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or not seq_lens.is_contiguous() \
            or seq_lens.dtype not in (torch.int32, torch.int64):
        _fail("seq_lens", "a contiguous [num_seqs] int32/int64 tensor", _desc(seq_lens))
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 or block_tables.stride(1) != 1 \
            or block_tables.dtype not in (torch.int32, torch.int64) or block_tables.shape[0] != num_seqs:
        _fail("block_tables", f"a [{num_seqs}, max_blocks] int32/int64 tensor, rows contiguous", _desc(block_tables))
    if query_start_loc is None:
        if q.shape[0] != num_seqs:
            _fail("q.shape[0]", f"num_seqs = {num_seqs} (decode: one query per sequence)", q.shape[0])
    elif not isinstance(query_start_loc, torch.Tensor) or tuple(query_start_loc.shape) != (num_seqs + 1,) \
            or query_start_loc.dtype not in (torch.int32, torch.int64) or not query_start_loc.is_contiguous():
        _fail("query_start_loc", f"a contiguous [{num_seqs + 1}] int32/int64 tensor", _desc(query_start_loc))
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        _fail("scale", "a float", repr(scale))
    if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != (*q.shape[:2], lora)
                            or out.dtype != q.dtype or out.stride(2) != 1):
        _fail("out", f"a {(*q.shape[:2], lora)} {q.dtype} tensor, last dim contiguous", _desc(out))
    tensors = [q, key_cache, value_cache, block_tables, seq_lens] + [x for x in (query_start_loc, out) if x is not None]
    if len({t.device for t in tensors}) != 1:
        _fail("all tensors", "on one device", sorted({str(t.device) for t in tensors}))
    if q.device.type != "cuda" and not _interpreted(_mla_kernel):
        _fail("device", "cuda (or TRITON_INTERPRET=1 set before triton was imported)", q.device)
    return q.shape[1], lora, rope, half, key_cache.shape[1]


def paged_mla_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *,
                        scale: float, value_dim: int, out=None, num_splits: int | None = None,
                        workspace: MLAWorkspace | None = None):
    """The ``paged_mla_attention`` op on real tensors (prefill with ``query_start_loc``, decode
    without). ``num_splits``: partitions of each query's keys (default :func:`mla_num_splits`);
    ``workspace``: their scratch (:func:`mla_workspace`), kept by the caller so a CUDA-graph replay
    allocates nothing. Returns ``out`` ``[num_tokens, num_heads, value_dim]``."""
    heads, lora, rope, half, block_size = _check(q, key_cache, value_cache, block_tables, seq_lens,
                                                 query_start_loc, scale, value_dim, out)
    tokens, num_seqs, prefill = q.shape[0], seq_lens.shape[0], query_start_loc is not None
    if out is None:
        out = torch.empty(tokens, heads, lora, dtype=q.dtype, device=q.device)
    if tokens == 0 or num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = mla_num_splits(tokens, heads, block_tables.shape[1], block_size, q.device, prefill=prefill)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= 256:
        _fail("num_splits", "None or an int in [1, 256]", repr(num_splits))
    if num_splits > 1:
        workspace = workspace or mla_workspace(tokens, heads, lora, num_splits, q.device)
        want = ((tokens, heads, num_splits, lora), (2, tokens, heads, num_splits))
        if not isinstance(workspace, MLAWorkspace) or any(tuple(x.shape) != s or x.dtype != torch.float32
                                                          or x.device != q.device or not x.is_contiguous()
                                                          for x, s in zip(workspace, want)):
            _fail("workspace", f"an MLAWorkspace of contiguous float32 {want[0]} and {want[1]} on {q.device}",
                  repr(workspace))
        part_acc, part_ml = workspace
    else:
        part_acc = part_ml = out
    cfg = _pick_config(heads, lora)
    pdl = pdl_launch(q.device)
    _mla_kernel[(tokens, triton.cdiv(heads, cfg.block_h), num_splits)](
        q, key_cache, value_cache, out, part_acc, part_ml, block_tables, seq_lens,
        query_start_loc if prefill else seq_lens,
        float(scale), tokens, num_seqs, max(num_seqs - 1, 0).bit_length(),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1),
        block_tables.stride(0),
        NUM_HEADS=heads, LORA=lora, ROPE=rope, HALF=half, BLOCK_SIZE=block_size, BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits, PREFILL=prefill,
        DOT_PREC="tf32x3" if key_cache.dtype == torch.float32 else "tf32", DOT_F32=_interpreted(_mla_kernel), **pdl,
        num_warps=cfg.num_warps)
    if num_splits > 1:
        _combine_kernel[(tokens, heads)](
            part_acc, part_ml, out, tokens, out.stride(0), out.stride(1), NUM_HEADS=heads, LORA=lora,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), **pdl, num_warps=4)
    return out
