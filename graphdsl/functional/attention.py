"""Rotary embedding, paged KV-cache writes and paged attention.

Layouts (vLLM's "flash" layout):

* q: ``[num_tokens, num_heads, head_dim]``; k/v: ``[num_tokens, num_kv_heads, head_dim]``
* key/value cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``
* ``slot_mapping[t] = block * block_size + offset`` (negative: padding, not written)
* ``alibi_slopes``: one float per query head (ALiBi, Bloom); empty: no position bias
* ``block_tables[s, j]``: the j-th cache block of sequence s; ``seq_lens[s]``: its context length
  *including* the tokens of this step; ``query_start_loc[s]``: where sequence s's queries start in
  the packed q (length num_seqs + 1). Decode passes no ``query_start_loc``: one query per sequence.
"""
from __future__ import annotations

import enum
import math

import torch

from ..dim import same_extent, shape_str
from ..opdef import OpCategory, Spec, check, register_op
from ._rules import at_user_line

__all__ = ["RopeLayout", "rope", "reshape_and_cache", "paged_attention", "paged_mla_attention"]


class RopeLayout(enum.Enum):
    """Which pairs of the head dim rotate together."""

    NEOX = "neox"   # (x[i], x[i + r/2]): Llama, Qwen, Mistral (HF rotate_half)
    GPTJ = "gptj"   # (x[2i], x[2i+1]): GPT-J, ChatGLM, GGUF-converted interleaved weights


def _rope_rule(q: Spec, k: Spec, cos: Spec, sin: Spec, *, layout=RopeLayout.NEOX):
    check(isinstance(layout, RopeLayout), "rope", f"layout must be a RopeLayout, got {layout!r}")
    for name, x in (("q", q), ("k", k)):
        check(len(x.shape) == 3, "rope", f"{name} must be [num_tokens, heads, head_dim], got {shape_str(x.shape)}")
    check(cos.shape == sin.shape and len(cos.shape) == 2, "rope",
          f"cos/sin must both be [num_tokens, rotary_dim/2], got {shape_str(cos.shape)} and {shape_str(sin.shape)}")
    for name, x in (("q", q), ("k", k)):
        check(same_extent(x.shape[0], cos.shape[0]) is not False, "rope",
              f"{name} has {x.shape[0]} tokens but cos has {cos.shape[0]}")
        half = cos.shape[1]
        if isinstance(half, int) and isinstance(x.shape[2], int):
            check(2 * half <= x.shape[2], "rope", f"rotary dim {2 * half} exceeds {name}'s head_dim {x.shape[2]}")
    return q, k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: RopeLayout) -> torch.Tensor:
    r = 2 * cos.shape[-1]
    xr = x[..., :r].float()
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    if layout is RopeLayout.NEOX:
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    return torch.cat((out.to(x.dtype), x[..., r:]), dim=-1)


@register_op("rope", category=OpCategory.CUSTOM, shape=_rope_rule, num_outputs=2)
def rope(q, k, cos, sin, *, layout=RopeLayout.NEOX):
    """Rotary position embedding of q and k (first ``r = 2 * cos.shape[-1]`` dims of each head;
    the rest pass through). For each rotating pair (x1, x2) and token t, frequency i:
    ``x1' = x1 cos[t,i] - x2 sin[t,i]``, ``x2' = x2 cos[t,i] + x1 sin[t,i]`` (in float32)."""
    return _rotate(q, cos, sin, layout), _rotate(k, cos, sin, layout)


def _cache_rule(key: Spec, value: Spec, key_cache: Spec, value_cache: Spec, slot_mapping: Spec):
    op = "reshape_and_cache"
    check(len(key.shape) == 3 and len(value.shape) == 3, op,
          f"key/value must be [num_tokens, kv_heads, head_dim], got {shape_str(key.shape)}, {shape_str(value.shape)}")
    check(len(key_cache.shape) == 4 and len(value_cache.shape) == 4, op,
          "caches must be [num_blocks, block_size, kv_heads, head_dim], got "
          f"{shape_str(key_cache.shape)}, {shape_str(value_cache.shape)}")
    for x, c, what in ((key, key_cache, "key"), (value, value_cache, "value")):
        for a, b, n in ((x.shape[1], c.shape[2], "kv_heads"), (x.shape[2], c.shape[3], "head_dim")):
            check(same_extent(a, b) is not False, op, f"{what} {n} is {a} but its cache has {b}")
    check(slot_mapping.dtype in (torch.int32, torch.int64) and len(slot_mapping.shape) == 1, op,
          f"slot_mapping must be 1-D int32/int64, got {shape_str(slot_mapping.shape)} {slot_mapping.dtype}")
    check(same_extent(slot_mapping.shape[0], key.shape[0]) is not False, op,
          f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    return key_cache, value_cache


@register_op("reshape_and_cache", category=OpCategory.DATA_MOVEMENT, shape=_cache_rule, num_outputs=2,
             inplace={0: 2, 1: 3})
def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """key_cache.flat[slot_mapping[t]] = key[t] (likewise value) for every t with slot >= 0.
    The caches are updated in place; the outputs are the updated caches (order the readers)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    kc = key_cache.view(-1, *key_cache.shape[2:])
    vc = value_cache.view(-1, *value_cache.shape[2:])
    kc[slots] = key[valid].to(kc.dtype)
    vc[slots] = value[valid].to(vc.dtype)
    return key_cache, value_cache


def _attn_rule(q: Spec, key_cache: Spec, value_cache: Spec, block_tables: Spec, seq_lens: Spec,
               *query_start_loc: Spec, scale=1.0, sliding_window=0, soft_cap=0.0, alibi_slopes=()):
    op = "paged_attention"
    check(len(q.shape) == 3, op, f"q must be [num_tokens, num_heads, head_dim], got {shape_str(q.shape)}")
    check(len(key_cache.shape) == 4 and len(value_cache.shape) == 4, op, "caches must be rank 4")
    hq, hk = q.shape[1], key_cache.shape[2]
    if isinstance(hq, int) and isinstance(hk, int):
        check(hq % hk == 0, op, f"num_heads {hq} is not a multiple of num_kv_heads {hk}")
    check(same_extent(q.shape[2], key_cache.shape[3]) is not False, op,
          f"q head_dim {q.shape[2]} differs from the key cache's {key_cache.shape[3]}")
    check(block_tables.dtype in (torch.int32, torch.int64) and len(block_tables.shape) == 2, op,
          f"block_tables must be 2-D int, got {shape_str(block_tables.shape)} {block_tables.dtype}")
    check(seq_lens.dtype in (torch.int32, torch.int64) and len(seq_lens.shape) == 1, op,
          f"seq_lens must be 1-D int, got {shape_str(seq_lens.shape)} {seq_lens.dtype}")
    check(len(query_start_loc) <= 1, op, "takes at most one query_start_loc")
    if not query_start_loc:
        check(same_extent(q.shape[0], seq_lens.shape[0]) is not False, op,
              f"decode needs one query per sequence: {q.shape[0]} queries, {seq_lens.shape[0]} sequences")
    check(isinstance(sliding_window, int) and sliding_window >= 0, op, f"sliding_window must be an int >= 0, got {sliding_window!r}")
    check(isinstance(soft_cap, (int, float)) and soft_cap >= 0, op, f"soft_cap must be >= 0, got {soft_cap!r}")
    check(isinstance(alibi_slopes, tuple) and all(isinstance(x, float) for x in alibi_slopes), op,
          f"alibi_slopes must be a tuple of floats, got {alibi_slopes!r}")
    if alibi_slopes and isinstance(hq, int):
        check(len(alibi_slopes) == hq, op, f"alibi_slopes has {len(alibi_slopes)} slopes for {hq} query heads")
    return Spec(q.shape[:2] + value_cache.shape[3:], q.dtype)


@register_op("paged_attention", category=OpCategory.ATTENTION, shape=_attn_rule)
def _paged_attention(q, key_cache, value_cache, block_tables, seq_lens, *query_start_loc, scale=1.0,
                     sliding_window=0, soft_cap=0.0, alibi_slopes=()):
    """For each sequence s with context length L and n new queries, query i (absolute position
    p = L - n + i) attends causally over cached keys 0..p (and only keys > p - sliding_window when
    a window is set): ``softmax(cap·tanh(q·kᵀ·scale / cap) + m_h·(k - p)) · v`` with
    ``cap = soft_cap`` if set and ``m_h = alibi_slopes[h]`` for query head h if given (ALiBi; the
    bias is relative to the query, which softmax cannot tell from Bloom's ``m_h·k``). Query head h
    reads KV head h // (num_heads / num_kv_heads) (GQA). Computed in float32."""
    group = q.shape[1] // key_cache.shape[2]
    out = torch.zeros(q.shape[:2] + value_cache.shape[3:], dtype=q.dtype, device=q.device)
    for s, L, q0, q1 in _sequences(seq_lens, query_start_loc):
        n = q1 - q0
        k = _context(key_cache, block_tables[s], L).repeat_interleave(group, dim=1)
        v = _context(value_cache, block_tables[s], L).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        pos_q = torch.arange(L - n, L, device=q.device)[:, None]
        pos_k = torch.arange(L, device=q.device)[None, :]
        if alibi_slopes:
            slopes = torch.tensor(alibi_slopes, dtype=torch.float32, device=q.device)[:, None, None]
            scores = scores + slopes * (pos_k - pos_q)
        mask = pos_k <= pos_q
        if sliding_window:
            mask &= pos_k > pos_q - sliding_window
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def _sequences(seq_lens, query_start_loc):
    """``(s, L, q0, q1)`` of every sequence with queries: its context length and query rows."""
    num_seqs = seq_lens.shape[0]
    qsl = query_start_loc[0].tolist() if query_start_loc else list(range(num_seqs + 1))
    for s, L in enumerate(seq_lens.tolist()):
        if qsl[s + 1] > qsl[s]:
            yield s, L, qsl[s], qsl[s + 1]


def _context(cache, table_row, L):
    """Positions ``0..L-1`` of one sequence from a paged cache: ``[L, kv_heads, head_dim]`` float32."""
    bs = cache.shape[1]
    blocks = table_row[: (L + bs - 1) // bs].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:L].float()


def _mla_rule(q: Spec, key_cache: Spec, value_cache: Spec, block_tables: Spec, seq_lens: Spec,
              *query_start_loc: Spec, scale=1.0, value_dim=0):
    op = "paged_mla_attention"
    check(len(q.shape) == 3, op, f"q must be [num_tokens, num_heads, latent_dim], got {shape_str(q.shape)}")
    check(len(key_cache.shape) == 4 and tuple(key_cache.shape) == tuple(value_cache.shape), op,
          f"caches must both be [num_blocks, block_size, 1, latent_dim / 2], got {shape_str(key_cache.shape)} and "
          f"{shape_str(value_cache.shape)}")
    check(same_extent(key_cache.shape[2], 1) is not False, op,
          f"the latent cache has one head, got {key_cache.shape[2]}")
    half = key_cache.shape[3]
    if isinstance(half, int) and isinstance(q.shape[2], int):
        check(q.shape[2] == 2 * half, op, f"q's latent_dim {q.shape[2]} must be twice the caches' {half}")
        check(isinstance(value_dim, int) and 0 < value_dim <= q.shape[2], op,
              f"value_dim must be an int in [1, {q.shape[2]}], got {value_dim!r}")
    check(len(query_start_loc) <= 1, op, "takes at most one query_start_loc")
    if not query_start_loc:
        check(same_extent(q.shape[0], seq_lens.shape[0]) is not False, op,
              f"decode needs one query per sequence: {q.shape[0]} queries, {seq_lens.shape[0]} sequences")
    return Spec(q.shape[:2] + (value_dim,), q.dtype)


@register_op("paged_mla_attention", category=OpCategory.ATTENTION, shape=_mla_rule)
def _paged_mla_attention(q, key_cache, value_cache, block_tables, seq_lens, *query_start_loc, scale=1.0,
                         value_dim=0):
    """Multi-head latent attention (DeepSeek-V2, weight-absorbed): every query head attends over one
    shared latent per position, ``c[k] = key_cache[k] ++ value_cache[k]`` (the latent is stored split
    in two halves so the ordinary paged cache holds it without waste), with causal positions as in
    ``paged_attention``: ``out = softmax(q·cᵀ·scale) · c[:, :value_dim]``, in float32."""
    out = torch.zeros(q.shape[:2] + (value_dim,), dtype=q.dtype, device=q.device)
    for s, L, q0, q1 in _sequences(seq_lens, query_start_loc):
        n = q1 - q0
        c = torch.cat((_context(key_cache, block_tables[s], L), _context(value_cache, block_tables[s], L)), -1)[:, 0]
        scores = torch.einsum("qhd,kd->hqk", q[q0:q1].float(), c) * scale
        causal = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out[q0:q1] = torch.einsum("hqk,kd->qhd", probs, c[:, :value_dim]).to(q.dtype)
    return out


@at_user_line
def paged_mla_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *,
                        scale: float, value_dim: int):
    """Latent attention of packed queries ``q [num_tokens, num_heads, latent_dim]`` over a paged cache
    whose key and value halves hold each position's latent (prefill with ``query_start_loc``, decode
    without); returns ``[num_tokens, num_heads, value_dim]``, attention over the latent's first
    ``value_dim`` entries."""
    extra = [] if query_start_loc is None else [query_start_loc]
    return _paged_mla_attention(q, key_cache, value_cache, block_tables, seq_lens, *extra, scale=float(scale),
                                value_dim=int(value_dim))


@at_user_line
def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *,
                    scale: float | None = None, sliding_window: int | None = None, soft_cap: float | None = None,
                    alibi_slopes=None):
    """Attention of packed queries over a paged KV cache (prefill when ``query_start_loc`` is
    given, decode otherwise); ``scale`` defaults to 1/sqrt(head_dim); ``alibi_slopes``: one ALiBi
    slope per query head (a sequence of floats), or None."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape is not None and isinstance(q.shape[-1], int) else None
        check(scale is not None, "paged_attention", "pass scale= when q's head_dim is not known while recording")
    extra = [] if query_start_loc is None else [query_start_loc]
    return _paged_attention(q, key_cache, value_cache, block_tables, seq_lens, *extra, scale=float(scale),
                            sliding_window=int(sliding_window or 0), soft_cap=float(soft_cap or 0.0),
                            alibi_slopes=tuple(float(x) for x in alibi_slopes or ()))
