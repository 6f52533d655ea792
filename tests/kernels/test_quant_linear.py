"""The dequantize-in-GEMV/GEMM kernel of ``quant_linear`` against the op's torch reference
(dequantize, then matmul), per scheme, for decode (M <= 16) and prefill tile shapes."""
import pytest
import torch

from graphdsl.functional.quant import quant_linear as quant_linear_op
from graphdsl.quant import parse_scheme
from graphdsl.runtime.kernels.quant_linear import quant_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCHEMES = ["int8-channel", "int4-g32", "int4-g64-zp", "int4-g128", "int4-g64-zp-kb", "int4-g128-kb", "fp8-tensor",
           "fp8-channel", "fp8-channel-dyn"]


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("m,dtype", [(1, torch.bfloat16), (5, torch.float32), (20, torch.float16)])
def test_matches_reference(name, m, dtype):
    n, k = 40, 256
    g = torch.Generator().manual_seed(m)
    s = parse_scheme(name)
    stored = [t.to(DEVICE) for t in s.quantize(torch.randn(n, k, generator=g), dtype)]
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    want = quant_linear_op.opdef.reference(x, *stored, scheme=name, out_features=n, in_features=k)
    got = quant_linear(x, stored, s, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol * 4, rtol=tol)


def test_odd_k_per_channel_and_prefill_tiles():
    s = parse_scheme("int8-channel")
    stored = s.quantize(torch.randn(24, 200), torch.float32)
    stored = [t.to(DEVICE) for t in stored]
    x = torch.randn(70, 200).to(DEVICE)
    want = quant_linear_op.opdef.reference(x, *stored, scheme=s.name, out_features=24, in_features=200)
    torch.testing.assert_close(quant_linear(x, stored, s, 24), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["int4-g32-zp", "int4-g64-zp", "int4-g64-kb", "fp8-channel-dyn"])
def test_triton_backend_lowers_quant_linear(name, monkeypatch):
    """A graph with bias and a following op: the bias joins the projection (``quant_linear_add``), the
    Triton backend runs a kernel (the decode GEMV for weight-only schemes, the quantized GEMM for
    fp8 with dynamic activations), the torch backend the reference; both agree."""
    from graphdsl import Network, Parameter, Tensor
    from graphdsl import functional as F
    torch.manual_seed(0)
    s = parse_scheme(name)
    with Network("q") as net:
        p = Parameter((48, 64), torch.bfloat16, name="proj.weight").quantize(s)
        bias = Parameter((48,), torch.bfloat16, name="proj.bias")
        net.mark_output(F.silu(F.linear(Tensor("x", (3, 64), torch.bfloat16), p, bias, transpose_b=True)), "y")
    stored = s.quantize(torch.randn(48, 64), torch.bfloat16)
    feed = {"x": torch.randn(3, 64).to(DEVICE, torch.bfloat16), "proj.bias": torch.randn(48).to(DEVICE, torch.bfloat16),
            **{c.name: t.to(DEVICE) for c, t in zip(p.companions(), stored)}}
    triton_engine = net.build_engine(device=DEVICE, backend="triton")
    assert [n.op for n in triton_engine.net.nodes if n.op.startswith("quant")] == ["quant_linear_add"]
    import graphdsl.runtime.kernels.gemv as gemv_kernels
    import graphdsl.runtime.kernels.quant_linear as kernels
    calls = []
    monkeypatch.setattr(kernels, "quant_linear", lambda *a, **kw: calls.append("gemm") or quant_linear(*a, **kw))
    real_gemv = gemv_kernels.gemv
    monkeypatch.setattr(gemv_kernels, "gemv", lambda *a, **kw: calls.append("gemv") or real_gemv(*a, **kw))
    got = triton_engine.forward(feed)["y"]
    from graphdsl.runtime.kernels.gemv import gemv_supported
    takes = gemv_supported(feed["x"], stored[0].to(DEVICE), s)     # (W8A8: where e4m3 tensor cores are)
    assert calls == (["gemv"] if takes else ["gemm"]), calls
    want = net.build_engine(device=DEVICE, backend="torch").forward(feed)["y"]
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.float().abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("name", ["int4-g32", "int4-g128-zp", "int4-g32-kb"])
@pytest.mark.parametrize("block_k", [64, 256])
def test_tiles_across_and_inside_groups(name, block_k):
    """A K tile holding several groups, or lying inside one, over several K steps."""
    s = parse_scheme(name)
    stored = [t.to(DEVICE) for t in s.quantize(torch.randn(20, 512), torch.float32)]
    x = torch.randn(3, 512).to(DEVICE)
    want = quant_linear_op.opdef.reference(x, *stored, scheme=name, out_features=20, in_features=512)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=block_k, num_warps=4, num_stages=2)
    torch.testing.assert_close(quant_linear(x, stored, s, 20, config=cfg), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["int4-g32", "int4-g64-zp", "fp8-channel"])
@pytest.mark.parametrize("rows", [2, 20])
def test_quantized_gate_up_keeps_swiglu_in_the_epilogue(name, rows):
    """``silu(gate) * up`` of a quantized packed gate|up projection becomes one
    ``quant_linear_silu_mul`` (decode: the GEMV's SwiGLU epilogue; prefill: GEMM + silu_mul); a
    residual add after the down projection joins it (``quant_linear_add``); equal to the torch
    backend's reference."""
    from graphdsl import Network, Parameter, Tensor
    from graphdsl import functional as F
    s = parse_scheme(name)
    with Network("mlp") as net:
        x = Tensor("x", (rows, 64), torch.bfloat16)
        gu = Parameter((128, 64), torch.bfloat16, name="gate_up.weight").quantize(s)
        down = Parameter((64, 64), torch.bfloat16, name="down.weight").quantize(s)
        g, u = F.split(F.linear(x, gu, None, transpose_b=True), 2, dim=-1)
        net.mark_output(F.linear(F.silu(g) * u, down, None, transpose_b=True) + x, "y")
    gen = torch.Generator().manual_seed(0)
    feed = {"x": torch.randn(rows, 64, generator=gen).to(DEVICE, torch.bfloat16)}
    for p, shape in ((gu, (128, 64)), (down, (64, 64))):
        feed.update({c.name: t.to(DEVICE) for c, t in zip(p.companions(), s.quantize(torch.randn(*shape, generator=gen),
                                                                                      torch.bfloat16))})
    engine = net.build_engine(device=DEVICE, backend="triton")
    assert [n.op for n in engine.net.nodes if n.op.startswith("quant")] == ["quant_linear_silu_mul", "quant_linear_add"]
    got = engine.forward(feed)["y"]
    want = net.build_engine(device=DEVICE, backend="torch").forward(feed)["y"]
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2 * want.float().abs().max().item(), rtol=3e-2)


@pytest.mark.parametrize("m", [3, 40])
def test_int4_codes_in_blocks_give_the_row_major_bits(m):
    """The prefill tiles over codes stored in blocks of 128 inputs (``-kb``), with a short last block
    (K = 224), are the same bits as over the row-major codes; a layout that is not the scheme's is
    refused."""
    from graphdsl import GraphDSLError
    from graphdsl.quant import int4_blocks
    s = parse_scheme("int4-g32-zp")
    stored = [t.to(DEVICE) for t in s.quantize(torch.randn(40, 224, generator=torch.Generator().manual_seed(m)),
                                               torch.float16)]
    x = torch.randn(m, 224, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.float16)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=2)
    rows = quant_linear(x, stored, s, 40, config=cfg)
    blocked = [int4_blocks(stored[0]), *stored[1:]]
    assert torch.equal(quant_linear(x, blocked, s.with_blocks(), 40, config=cfg), rows)
    with pytest.raises(GraphDSLError, match=r"int4-g32-zp-kb codes must be \[blocks, N, 64\]"):
        quant_linear(x, stored, s.with_blocks(), 40, config=cfg)
