"""runtime/kernels/cache_write.py (reshape_and_cache) vs the op's torch reference: shuffled and
negative slots, int32/int64 slot maps, strided keys (views of a fused qkv output), dtype
conversion, odd token counts, block sizes 16/32/64; bad arguments raise naming the argument."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (see conftest.py)

import pytest  # noqa: E402

from graphdsl.errors import GraphDSLError  # noqa: E402
from graphdsl.opdef import get_op  # noqa: E402
from graphdsl.runtime.kernels import reshape_and_cache  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
REF = get_op("reshape_and_cache").reference


def _slots(num_tokens, num_blocks, block_size, *, pad_every=0, dtype=torch.int64, seed=0):
    """Distinct random slots; every ``pad_every``-th token gets -1 (padding)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if pad_every:
        slots[::pad_every] = -1
    return slots.to(dtype).to(DEVICE)


def _check(key, value, kc, vc, slots):
    kr, vr = kc.clone(), vc.clone()
    ret = reshape_and_cache(key, value, kc, vc, slots)
    REF(key, value, kr, vr, slots)
    assert ret[0] is kc and ret[1] is vc
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (1, 128)])
def test_cache_write_matches_reference(num_tokens, block_size, kv_heads, head_dim):
    n = num_tokens * (37 if CUDA else 1)
    blocks = (n + block_size - 1) // block_size + 3
    key = torch.randn(n, kv_heads, head_dim, device=DEVICE)
    value = torch.randn(n, kv_heads, head_dim, device=DEVICE)
    # non-zero cache contents: slots that must not be written keep them
    kc = torch.randn(blocks, block_size, kv_heads, head_dim, device=DEVICE)
    vc = torch.randn_like(kc)
    _check(key, value, kc, vc, _slots(n, blocks, block_size, pad_every=3, seed=num_tokens))


@pytest.mark.parametrize("src,dst", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                     (torch.float32, torch.float16), (torch.float32, torch.bfloat16)])
def test_cache_write_dtypes(src, dst):
    if src != dst and dst == torch.bfloat16 and not CUDA:
        pytest.skip("the CPU interpreter truncates float32 -> bfloat16 (GPUs round to nearest even like torch)")
    key = torch.randn(9, 4, 64, device=DEVICE).to(src)
    value = torch.randn(9, 4, 64, device=DEVICE).to(src)
    kc = torch.randn(3, 16, 4, 64, device=DEVICE).to(dst)
    vc = torch.randn_like(kc)
    _check(key, value, kc, vc, _slots(9, 3, 16, pad_every=4, dtype=torch.int32))


def test_cache_write_strided_views_of_qkv():
    """key/value as views into a fused [tokens, q+k+v heads, head_dim] projection output."""
    qkv = torch.randn(11, 8 + 2 + 2, 64, device=DEVICE)
    key, value = qkv[:, 8:10], qkv[:, 10:12]
    assert not key.is_contiguous()
    kc = torch.randn(2, 16, 2, 64, device=DEVICE)
    vc = torch.randn_like(kc)
    _check(key, value, kc, vc, _slots(11, 2, 16, pad_every=5))


def test_cache_write_all_padding_and_empty():
    kc = torch.randn(2, 16, 2, 64, device=DEVICE)
    vc = torch.randn_like(kc)
    before = kc.clone(), vc.clone()
    key = torch.randn(5, 2, 64, device=DEVICE)
    reshape_and_cache(key, key, kc, vc, torch.full((5,), -1, dtype=torch.int64, device=DEVICE))
    reshape_and_cache(key[:0], key[:0], kc, vc, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_cache_write_errors_name_the_argument():
    key = torch.randn(4, 2, 64, device=DEVICE)
    kc = torch.zeros(2, 16, 2, 64, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(GraphDSLError, match=r"reshape_and_cache: slot_mapping must be a \[4\] int32/int64 "
                                            r"tensor, got \(3,\) torch.int64"):
        reshape_and_cache(key, key, kc, kc.clone(), slots[:3])
    with pytest.raises(GraphDSLError, match=r"key.shape\[1:\] must be the cache's \(kv_heads, head_dim\) "
                                            r"\(2, 64\), got \(2, 32\)"):
        reshape_and_cache(key[..., :32], key[..., :32], kc, kc.clone(), slots)
    with pytest.raises(GraphDSLError, match=r"key.dtype must be float16, bfloat16 or float32, got torch.int64"):
        reshape_and_cache(key.long(), key.long(), kc, kc.clone(), slots)
    with pytest.raises(GraphDSLError, match=r"key_cache must be contiguous"):
        reshape_and_cache(key, key, kc.transpose(0, 1), kc.transpose(0, 1).clone(), slots)
    with pytest.raises(GraphDSLError, match=r"value_cache must be a \[num_blocks, block_size, kv_heads, "
                                            r"head_dim\] tensor, got \(2, 16, 128\) torch.float32"):
        reshape_and_cache(key, key, kc, kc.view(2, 16, 128), slots)
