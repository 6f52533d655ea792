"""Paged-attention Triton kernels at real sizes on the GPU (run with ``pytest -m gpu``).

Llama-3-8B attention shape (32 heads, 8 KV heads, head_dim 128), bf16 and fp16, contexts up to
4096, batches 1..64, against the op's torch reference; then a timing print (decode GB/s vs the
measured copy bandwidth, prefill TFLOP/s), using benchmarks/attention.py's helpers.
"""
from __future__ import annotations

import pytest
import torch

from graphdsl.opdef import get_op
from tests.helpers import benchmarks

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from graphdsl.runtime.kernels import (  # noqa: E402
    paged_attention_decode, paged_attention_prefill, reshape_and_cache)

REF = get_op("paged_attention").reference
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
H, HK, D = 32, 8, 128


def _bench_module():
    return benchmarks.load("attention")


def _case(lens, news, dtype, block_size=16, seed=0):
    """Caches filled through the Triton reshape_and_cache (checked against the op's reference)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = [(L + block_size - 1) // block_size for L in lens]
    num_blocks = sum(per_seq) + 8
    kc = torch.randn(num_blocks, block_size, HK, D, device="cuda", generator=g).to(dtype)
    vc = torch.randn_like(kc)
    order = torch.randperm(num_blocks, device="cuda", generator=g)
    tables = torch.randint(0, num_blocks, (len(lens), max(per_seq) + 1), device="cuda", generator=g,
                           dtype=torch.int32)
    used = 0
    for s, nb in enumerate(per_seq):
        tables[s, :nb] = order[used:used + nb].to(torch.int32)
        used += nb
    # rewrite every context token through the kernel under test
    slots = torch.cat([tables[s, torch.arange(L, device="cuda") // block_size].long() * block_size
                       + torch.arange(L, device="cuda") % block_size for s, L in enumerate(lens)])
    k_new = torch.randn(slots.numel(), HK, D, device="cuda", generator=g).to(dtype)
    v_new = torch.randn(slots.numel(), HK, D, device="cuda", generator=g).to(dtype)
    kr, vr = kc.clone(), vc.clone()
    reshape_and_cache(k_new, v_new, kc, vc, slots.to(torch.int32))
    get_op("reshape_and_cache").reference(k_new, v_new, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    qsl = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(int(sum(news)), H, D, device="cuda", generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"), qsl


def _close(out, ref, dtype):
    assert torch.isfinite(out.float()).all()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_real_sizes(dtype, batch):
    g = torch.Generator().manual_seed(batch)
    lens = [4096] + torch.randint(1, 4097, (batch - 1,), generator=g).tolist()
    q, kc, vc, bt, sl, _ = _case(lens, [1] * batch, dtype, seed=batch)
    ref = REF(q, kc, vc, bt, sl, scale=D ** -0.5)
    for splits in (None, 1, 7):
        out = paged_attention_decode(q, kc, vc, bt, sl, scale=D ** -0.5, num_splits=splits,
                                     out=torch.full_like(q, float("nan")))
        _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_real_sizes(dtype):
    lens = [2048, 4096, 1500, 700, 33, 4000]
    news = [2048, 512, 1500, 1, 33, 257]          # full prompts, prefix + chunk, one token
    q, kc, vc, bt, sl, qsl = _case(lens, news, dtype, block_size=32, seed=1)
    out = paged_attention_prefill(q, kc, vc, bt, sl, qsl, scale=D ** -0.5, out=torch.full_like(q, float("nan")))
    _close(out, REF(q, kc, vc, bt, sl, qsl, scale=D ** -0.5), dtype)


def test_window_softcap_real_sizes():
    dtype = torch.bfloat16
    lens, news = [3000, 4096, 100], [1000, 1, 100]
    q, kc, vc, bt, sl, qsl = _case(lens, news, dtype, block_size=64, seed=2)
    kw = dict(scale=D ** -0.5, sliding_window=1024, soft_cap=30.0)
    q = q * 4
    _close(paged_attention_prefill(q, kc, vc, bt, sl, qsl, **kw), REF(q, kc, vc, bt, sl, qsl, **kw), dtype)
    qd, sld = q[:3].contiguous(), sl
    _close(paged_attention_decode(qd, kc, vc, bt, sld, **kw), REF(qd, kc, vc, bt, sld, **kw), dtype)


def test_timing_print(capsys):
    """Not a pass/fail bar: prints the achieved rates next to the measured ceilings."""
    bench = _bench_module()
    copy, mm = bench.copy_bandwidth_gbs(), bench.matmul_tflops()
    lines = [f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s"]
    for batch in (1, 8, 64):
        for ctx in (512, 4096):
            r = bench.bench_decode(batch, ctx)
            assert torch.isfinite(r.out.float()).all()
            lines.append(f"decode b={batch} ctx={ctx} splits={r.splits}: eager {r.eager_ms * 1e3:.1f} us, "
                         f"graph {r.graph_ms * 1e3:.1f} us, {r.gbs:.0f} GB/s = {100 * r.gbs / copy:.0f}% of copy")
    ms, tflops, out = bench.bench_prefill(1, 2048)
    assert torch.isfinite(out.float()).all()
    lines.append(f"prefill 1x2048: {ms * 1e3:.1f} us, {tflops:.0f} TFLOP/s = {100 * tflops / mm:.0f}% of matmul")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
