"""Triton kernel for ``reshape_and_cache``: scatter this step's keys and values into the paged cache.

Semantics (``graphdsl.functional.attention.reshape_and_cache``): for every token ``t`` whose
``slot_mapping[t] >= 0``, ``key_cache.flat[slot] = key[t]`` and ``value_cache.flat[slot] = value[t]``
where ``flat`` views the cache ``[num_blocks, block_size, kv_heads, head_dim]`` as
``[num_blocks * block_size, kv_heads, head_dim]``; negative slots (padding) are skipped. The caches
are updated in place and returned.

File shape (STYLE.md 11): the ``@triton.jit`` kernel, a launcher that checks its inputs and picks the
tile with :func:`_pick_block`, the thin public wrapper :func:`reshape_and_cache`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

from .pdl import pdl_launch, pdl_wait

__all__ = ["reshape_and_cache"]

_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,            # [num_tokens, kv_heads, head_dim] keys of this step (any strides, last dim unit)
    value_ptr,          # [num_tokens, kv_heads, head_dim] values of this step
    key_cache_ptr,      # [num_blocks, block_size, kv_heads, head_dim] contiguous key cache
    value_cache_ptr,    # [num_blocks, block_size, kv_heads, head_dim] contiguous value cache
    slot_ptr,           # [num_tokens] int32/int64 flat slot of each token; < 0 means skip
    stride_kt,          # key stride between tokens (elements)
    stride_kh,          # key stride between heads
    stride_vt,          # value stride between tokens
    stride_vh,          # value stride between heads
    NUM_HEADS: tl.constexpr,   # kv_heads
    HEAD_DIM: tl.constexpr,    # head_dim
    BLOCK: tl.constexpr,       # elements of one token's heads*head_dim row handled per program
    USE_PDL: tl.constexpr,     # launched with programmatic dependent launch (kernels/pdl.py)
):
    """One program copies ``BLOCK`` of the ``kv_heads * head_dim`` elements of token ``t``.

    With ``s = slot_mapping[t]`` (skipped when ``s < 0``) and ``j = h * head_dim + d``::

        key_cache.flat[s * kv_heads * head_dim + j]   = key[t, h, d]
        value_cache.flat[s * kv_heads * head_dim + j] = value[t, h, d]

    converted to the cache's dtype; slot arithmetic is in int64 (large caches exceed 2**31 elements).
    """
    pdl_wait(USE_PDL)
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        j = chunk * BLOCK + tl.arange(0, BLOCK)
        inside = j < NUM_HEADS * HEAD_DIM
        h = j // HEAD_DIM
        d = j % HEAD_DIM
        t64 = t.to(tl.int64)
        k = tl.load(key_ptr + t64 * stride_kt + h * stride_kh + d, mask=inside)
        v = tl.load(value_ptr + t64 * stride_vt + h * stride_vh + d, mask=inside)
        dst = slot * (NUM_HEADS * HEAD_DIM) + j
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=inside)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=inside)


def _pick_block(row_elems: int) -> tuple[int, int]:
    """Tile of one token's row (``kv_heads * head_dim`` elements) and warps: up to 1024 elements per
    program (16-byte accesses for 4 warps of 16-bit data), whole rows when they are smaller."""
    block = min(triton.next_power_of_2(row_elems), 1024)
    return block, 4 if block >= 512 else (2 if block >= 128 else 1)


def _interpreted(kernel) -> bool:
    """True when triton built ``kernel`` for its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def _desc(x) -> str:
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def _fail(arg: str, expected: str, actual) -> None:
    raise GraphDSLError(f"reshape_and_cache: {arg} must be {expected}, got {actual}")


def _launch_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    for name, x in (("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            _fail(name, "a [num_tokens, kv_heads, head_dim] tensor", _desc(x))
        if x.dtype not in _CACHE_DTYPES:
            _fail(f"{name}.dtype", "float16, bfloat16 or float32", x.dtype)
        if x.stride(2) != 1:
            _fail(f"{name}.stride(2)", "1 (head_dim contiguous)", x.stride(2))
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            _fail(name, "a [num_blocks, block_size, kv_heads, head_dim] tensor", _desc(c))
        if c.dtype not in _CACHE_DTYPES:
            _fail(f"{name}.dtype", "float16, bfloat16 or float32", c.dtype)
        if not c.is_contiguous():
            _fail(name, "contiguous", f"strides {tuple(c.stride())}")
    if key_cache.shape != value_cache.shape:
        _fail("value_cache.shape", f"key_cache's {tuple(key_cache.shape)}", tuple(value_cache.shape))
    n, heads, dim = key.shape
    if tuple(value.shape) != (n, heads, dim):
        _fail("value.shape", f"key's {tuple(key.shape)}", tuple(value.shape))
    if (heads, dim) != tuple(key_cache.shape[2:]):
        _fail("key.shape[1:]", f"the cache's (kv_heads, head_dim) {tuple(key_cache.shape[2:])}", (heads, dim))
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64) \
            or tuple(slot_mapping.shape) != (n,):
        _fail("slot_mapping", f"a [{n}] int32/int64 tensor", _desc(slot_mapping))
    if not slot_mapping.is_contiguous():
        _fail("slot_mapping", "contiguous", f"stride {slot_mapping.stride()}")
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        _fail("all tensors", "on one device", sorted(str(d) for d in devices))
    if key.device.type != "cuda" and not _interpreted(_reshape_and_cache_kernel):
        _fail("device", "cuda (or TRITON_INTERPRET=1 set before triton was imported)", key.device)
    if n == 0:
        return key_cache, value_cache
    block, warps = _pick_block(heads * dim)
    grid = (n, triton.cdiv(heads * dim, block))
    _reshape_and_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_HEADS=heads, HEAD_DIM=dim, BLOCK=block, num_warps=warps, **pdl_launch(key.device))
    return key_cache, value_cache


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """Write ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` into the paged caches at
    ``slot_mapping`` (negative slots skipped), in place; returns ``(key_cache, value_cache)``."""
    return _launch_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
