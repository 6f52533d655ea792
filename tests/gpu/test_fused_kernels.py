"""Fused kernels on the GPU at Llama-3-8B shapes (hidden 4096, intermediate 14336, 32/8 heads of
128) for 1 to 4096 tokens, against the ops' torch references, within bf16 tolerance.

Run on the device machine: ``pytest -m gpu tests/gpu/test_fused_kernels.py``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HIDDEN, INTER, HQ, HK, D = 4096, 14336, 32, 8, 128
TOKENS = [1, 7, 128, 1000, 4096]
BF16 = dict(rtol=1.6e-2, atol=1.6e-2)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def check(got, want):
    assert not torch.isnan(got).any(), "NaN in kernel output (unwritten element?)"
    torch.testing.assert_close(got.float(), want.float(), **BF16)
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("tokens", TOKENS)
def test_add_rms_norm(tokens):
    from graphdsl.opdef import get_op
    from graphdsl.runtime.codegen.ops import add_rms_norm
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(torch.bfloat16)
    out, res = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    add_rms_norm(x, r, w, eps=1e-5, out=out, residual_out=res)
    want_out, want_res = get_op("add_rms_norm").reference(x, r, w, eps=1e-5)
    torch.testing.assert_close(res, want_res, rtol=0, atol=0)      # one bf16 rounding of the same sum
    check(out, want_out)


@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul(tokens):
    from graphdsl.opdef import get_op
    from graphdsl.runtime.codegen.ops import silu_mul
    x = torch.randn(tokens, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    out = torch.full((tokens, INTER), float("nan"), device="cuda", dtype=torch.bfloat16)
    silu_mul(x, out=out)
    check(out, get_op("silu_mul").reference(x))


@pytest.mark.parametrize("layout", ["NEOX", "GPTJ"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rope_cache(tokens, layout):
    from graphdsl.functional.attention import RopeLayout
    from graphdsl.opdef import get_op
    from graphdsl.runtime.codegen.ops import rope_cache
    block, nblocks = 16, (4096 // 16) + 8
    q = torch.randn(tokens, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, HK, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(tokens, device="cuda", dtype=torch.float32)
    inv = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D)
    freqs = pos[:, None] * inv[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.randperm(nblocks * block, device="cuda")[:tokens]
    kc = torch.randn(nblocks, block, HK, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(nblocks, block, HK, D, device="cuda", dtype=torch.bfloat16)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    lay = RopeLayout[layout]
    q_ref, _, _ = get_op("rope_cache").reference(q, k, v, kc_ref, vc_ref, cos, sin, slots, layout=lay)
    q_out = torch.full_like(q, float("nan"))
    rope_cache(q, k, v, kc, vc, cos, sin, slots, layout=lay, q_out=q_out)
    check(q_out, q_ref)
    check(kc, kc_ref)
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)


@pytest.mark.parametrize("tokens", [1, 4096])
def test_generic_groups_pointwise_and_softmax(tokens):
    from graphdsl.opdef import get_op
    from graphdsl.runtime.codegen import run_fused
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    program = (("silu", (0,), ()), ("mul", (2, 1), ()), ("softmax", (3,), (("dim", -1),)))
    out = torch.full_like(x, float("nan"))
    run_fused(program, (4,), [x, y], [out])
    want = get_op("fused").reference(x, y, program=program, outputs=(4,), absorbed=())[0]
    check(out, want)


def test_engine_8b_layer_triton_matches_torch_reference():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from build_time import BLOCK, NUM_BLOCKS, VOCAB, build_decoder
    torch.manual_seed(0)
    net = build_decoder(1)
    ref = net.build_engine(backend="torch", passes=[])
    eng = net.build_engine(backend="triton")
    assert eng.num_launches < ref.num_launches
    g = torch.Generator(device="cuda").manual_seed(0)
    feed = {}
    for name, t in net.inputs.items():
        if t.dtype.is_floating_point and name not in ("cos", "sin"):
            shape = tuple(s if isinstance(s, int) else 0 for s in t.shape)
            scale = 1.0 if name == "embed" else 0.02
            base = 1.0 if "layernorm" in name or name == "norm" else 0.0
            feed[name] = (base + scale * torch.randn(shape, device="cuda", generator=g)).to(t.dtype)
    T = 96
    pos = torch.arange(T, device="cuda")
    inv = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, device="cuda", dtype=torch.float32) / 128)
    fr = pos.float()[:, None] * inv[None, :]
    feed.update({"input_ids": torch.randint(0, VOCAB, (T,), device="cuda", generator=g), "cos": fr.cos(),
                 "sin": fr.sin(), "slot_mapping": pos.clone(),
                 "block_tables": torch.arange(NUM_BLOCKS, device="cuda", dtype=torch.int32)[None],
                 "seq_lens": torch.tensor([T], device="cuda", dtype=torch.int32),
                 "query_start_loc": torch.tensor([0, T], device="cuda", dtype=torch.int32)})
    for c in ("layers.0.k_cache", "layers.0.v_cache"):
        feed[c] = torch.zeros(NUM_BLOCKS, BLOCK, 8, 128, device="cuda", dtype=torch.bfloat16)
    a = ref.forward({k: v.clone() for k, v in feed.items()})["logits"]
    b = eng.forward({k: v.clone() for k, v in feed.items()})["logits"]
    assert not torch.isnan(b).any()
    assert rel_err(b, a) < 2e-2
