"""runtime/kernels/paged_mla_attention.py vs the paged_mla_attention op's torch reference.

Prefill (packed varlen queries over a cached prefix, shuffled block tables) and split-K decode,
latent sizes 32+16 and 64+32 (DeepSeek's 512+64 on the GPU), head counts below and above a
program's 16-head tile, float32/bfloat16, padded decode slots. On CPU under Triton's interpreter.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (see conftest.py)

import pytest  # noqa: E402

from graphdsl.errors import GraphDSLError  # noqa: E402
from graphdsl.opdef import get_op  # noqa: E402
from graphdsl.runtime.kernels.paged_mla_attention import mla_workspace, paged_mla_attention  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
REF = get_op("paged_mla_attention").reference
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def make_case(lens, news, heads, lora, rope, block_size, dtype, *, seed=0):
    """Random latent caches (two halves) with blocks handed out in shuffled order, queries for the
    last ``news[s]`` positions of each sequence."""
    g = torch.Generator().manual_seed(seed)
    half = (lora + rope) // 2
    per_seq = [(L + block_size - 1) // block_size for L in lens]
    num_blocks = sum(per_seq) + 3
    kc = torch.randn(num_blocks, block_size, 1, half, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, 1, half, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(lens), max(per_seq) + 1), generator=g, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(per_seq):
        tables[s, :nb] = order[used:used + nb]
        used += nb
    qsl = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist(), dtype=torch.int32)
    q = (torch.randn(int(qsl[-1]), heads, lora + rope, generator=g) * 0.5).to(dtype)
    return [t.to(DEVICE) for t in (q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), qsl)]


def assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype and torch.isfinite(out.float()).all()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("lora,rope,heads,dtype", [(32, 16, 4, torch.float32), (64, 32, 20, torch.float32),
                                                   (32, 32, 16, torch.bfloat16)])
def test_prefill(lora, rope, heads, dtype):
    lens, news = [9, 40, 1, 23], [9, 6, 1, 0]
    q, kc, vc, bt, sl, qsl = make_case(lens, news, heads, lora, rope, 16, dtype)
    kw = dict(scale=0.3, value_dim=lora)
    out = paged_mla_attention(q, kc, vc, bt, sl, qsl, **kw)
    assert_close(out, REF(q, kc, vc, bt, sl, qsl, **kw), dtype)


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("lora,rope,heads", [(32, 16, 4), (64, 32, 20)])
def test_decode_splits(splits, lora, rope, heads):
    lens = [70, 3, 33]
    q, kc, vc, bt, sl, _ = make_case(lens, [1] * 3, heads, lora, rope, 8, torch.float32, seed=1)
    kw = dict(scale=0.25, value_dim=lora)
    out = paged_mla_attention(q, kc, vc, bt, sl, num_splits=splits, **kw)
    assert_close(out, REF(q, kc, vc, bt, sl, **kw), torch.float32)


def test_decode_padded_slot_and_workspace():
    """A padded decode slot (seq_len 0) gives zeros; a kept workspace is used as given."""
    q, kc, vc, bt, sl, _ = make_case([12, 30], [1, 1], 4, 32, 16, 8, torch.float32, seed=2)
    sl[1] = 0
    ws = mla_workspace(2, 4, 32, 4, DEVICE)
    out = paged_mla_attention(q, kc, vc, bt, sl, scale=0.25, value_dim=32, num_splits=4, workspace=ws)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[:1], REF(q[:1], kc, vc, bt[:1], sl[:1], scale=0.25, value_dim=32), torch.float32)


@pytest.mark.skipif(not CUDA, reason="DeepSeek-V2's 512 + 64 latent: compiled only (slow under the interpreter)")
@pytest.mark.parametrize("heads", [16, 128])
def test_deepseek_v2_sizes(heads):
    lens = [4000, 17, 900]
    q, kc, vc, bt, sl, _ = make_case(lens, [1] * 3, heads, 512, 64, 16, torch.bfloat16, seed=3)
    kw = dict(scale=192 ** -0.5, value_dim=512)
    assert_close(paged_mla_attention(q, kc, vc, bt, sl, **kw), REF(q, kc, vc, bt, sl, **kw), torch.bfloat16)
    q, kc, vc, bt, sl, qsl = make_case([300, 40], [300, 7], heads, 512, 64, 16, torch.bfloat16, seed=4)
    assert_close(paged_mla_attention(q, kc, vc, bt, sl, qsl, **kw), REF(q, kc, vc, bt, sl, qsl, **kw),
                 torch.bfloat16)


def test_argument_errors_name_the_argument():
    q, kc, vc, bt, sl, qsl = make_case([5], [5], 4, 32, 16, 8, torch.float32)
    with pytest.raises(GraphDSLError, match=r"q.shape\[2\] must be twice the caches' last dim \(48\), got 40"):
        paged_mla_attention(q[..., :40], kc, vc, bt, sl, qsl, scale=1.0, value_dim=32)
    with pytest.raises(GraphDSLError, match="value_dim must be a power of two >= 16"):
        paged_mla_attention(q, kc, vc, bt, sl, qsl, scale=1.0, value_dim=24)
    with pytest.raises(GraphDSLError, match=r"workspace must be an MLAWorkspace"):
        paged_mla_attention(q[:1], kc, vc, bt, sl, scale=1.0, value_dim=32, num_splits=2,
                            workspace=mla_workspace(1, 4, 32, 3, DEVICE))


def test_prefill_padding_tokens_past_the_last_sequence_read_nothing():
    """A padded prefill step's extra tokens (past ``query_start_loc[-1]``) belong to no sequence:
    they attend over no key (zeros), where they once continued the last sequence past its context
    and read its block table beyond the row."""
    lens, news = [9, 40], [9, 6]
    q, kc, vc, bt, sl, qsl = make_case(lens, news, 4, 32, 16, 16, torch.float32)
    kw = dict(scale=0.3, value_dim=32)
    want = paged_mla_attention(q, kc, vc, bt, sl, qsl, **kw)
    padded = torch.cat([q, torch.randn(40, *q.shape[1:], device=q.device)])     # 40 tokens of padding
    got = paged_mla_attention(padded, kc, vc, bt[:, :3], sl, qsl, **kw)           # the rows' own blocks only
    torch.testing.assert_close(got[:q.shape[0]], want, rtol=0, atol=0)
    assert torch.equal(got[q.shape[0]:], torch.zeros_like(got[q.shape[0]:]))
