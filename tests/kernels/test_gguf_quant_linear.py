"""``quant_linear`` on a ``gguf-<type>`` weight through the Triton backend: it runs the GGUF kernels
(:func:`graphdsl.runtime.kernels.gguf_linear.gguf_linear`), with the bias / SwiGLU / residual that
follow, and agrees with the torch backend's reference (dequantize the blocks, then matmul)."""
import pytest
import torch

import graphdsl.runtime  # noqa: F401 - registers the gguf-* schemes
from graphdsl.quant import parse_scheme
from graphdsl.runtime.gguf_scheme import quantize_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("qtype,rows", [("Q4_K", 1), ("Q6_K", 3), ("Q4_1", 20), ("Q4_K+Q6_K", 2), ("Q4_K+Q6_K", 20),
                                        ("Q4_K+Q6_K", 50), ("Q5_K", 40), ("Q4_K", 70)])
def test_triton_backend_runs_the_gguf_kernel(qtype, rows, monkeypatch):
    """``Q4_K+Q6_K``: the packed gate|up keeps gate rows in Q4_K and up rows in Q6_K (one GEMV each);
    with its two stored tensors and no bias it fuses into ``quant_linear_silu_mul`` (the backend's
    SwiGLU epilogue step after the GGUF kernels). Up to 16 rows every type runs its GEMV, up to 32
    Q5_K and Q8_0 do, up to 64 Q4_K and Q6_K (``gemv_rows``), beyond dequantize + matmul."""
    from graphdsl import Network, Parameter, Tensor
    from graphdsl import functional as F
    from graphdsl.runtime.gguf_scheme import gguf_scheme
    n, k = 32, 256
    types = qtype.split("+")
    s = gguf_scheme([(q, 2 * n // len(types)) for q in types])
    with Network("mlp") as net:
        x = Tensor("x", (rows, k), torch.bfloat16)
        gu = Parameter((2 * n, k), torch.bfloat16, name="gate_up.weight").quantize(s)
        down = Parameter((k, n), torch.bfloat16, name="down.weight").quantize(parse_scheme("gguf-q8_0"))
        bias = Parameter((2 * n,), torch.bfloat16, name="gate_up.bias") if len(types) == 1 else None
        g, u = F.split(F.linear(x, gu, bias, transpose_b=True), 2, dim=-1)
        net.mark_output(F.linear(F.silu(g) * u, down, None, transpose_b=True) + x, "y")
    gen = torch.Generator().manual_seed(rows)
    feed = {"x": torch.randn(rows, k, generator=gen).to(DEVICE, torch.bfloat16),
            "gate_up.bias": (0.1 * torch.randn(2 * n, generator=gen)).to(DEVICE, torch.bfloat16),
            **{c.name: t.to(DEVICE) for c, t in zip(gu.companions(), s.quantize(0.1 * torch.randn(2 * n, k, generator=gen)))},
            "down.weight_packed": quantize_blocks(0.1 * torch.randn(k, n, generator=gen), "Q8_0").to(DEVICE)}
    engine = net.build_engine(device=DEVICE, backend="triton")
    if len(types) > 1:
        feed.pop("gate_up.bias")
        assert [nd.op for nd in engine.net.nodes][0] == "quant_linear_silu_mul"
    import graphdsl.runtime.kernels.gguf_linear as kernels
    calls = []
    for name in ("gguf_linear", "gguf_gemv"):     # the GEMV (<= 16 rows, straight into the product) or both halves
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda x, d, q, *a, _f=real, _n=name, **kw:
                            calls.append((_n, q)) or _f(x, d, q, *a, **kw))
    got = engine.forward(feed)["y"]
    most = {"Q4_K": 64, "Q6_K": 64, "Q5_K": 32, "Q8_0": 32, "Q4_1": 16}
    gate_up = "gguf_gemv" if rows <= min(most[q] for q in types) else "gguf_linear"
    down = "gguf_gemv" if rows <= most["Q8_0"] else "gguf_linear"
    assert calls == [(gate_up, q) for q in types] + [(down, "Q8_0")], calls
    want = net.build_engine(device=DEVICE, backend="torch").forward(feed)["y"]
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2 * want.float().abs().max().item(), rtol=3e-2)


def test_one_q4_k_row_fuses_the_swiglu_into_the_tensor_core_gemv(monkeypatch):
    """A packed Q4_K gate|up without bias, one row: ``quant_linear_silu_mul`` is a single
    ``gguf_gemv(..., silu_mul=True)`` (the tensor-core kernel's SwiGLU epilogue, no product buffer,
    no separate ``silu_mul`` launch) when the weight is large enough for the tensor cores
    (``MMA_MIN_ROWS`` lowered to this test's 64 rows), and agrees with the torch backend."""
    from graphdsl import Network, Parameter, Tensor
    from graphdsl import functional as F
    import graphdsl.runtime.kernels.gguf_linear as kernels
    n, k = 32, 512
    s = parse_scheme("gguf-q4_k")
    with Network("mlp") as net:
        x = Tensor("x", (1, k), torch.bfloat16)
        gu = Parameter((2 * n, k), torch.bfloat16, name="gate_up.weight").quantize(s)
        g, u = F.split(F.linear(x, gu, None, transpose_b=True), 2, dim=-1)
        net.mark_output(F.silu(g) * u, "y")
    gen = torch.Generator().manual_seed(5)
    feed = {"x": torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16),
            **{c.name: t.to(DEVICE) for c, t in zip(gu.companions(), s.quantize(0.1 * torch.randn(2 * n, k, generator=gen)))}}
    engine = net.build_engine(device=DEVICE, backend="triton")
    assert [nd.op for nd in engine.net.nodes] == ["quant_linear_silu_mul"]
    calls = []
    real = kernels.gguf_gemv
    monkeypatch.setattr(kernels, "gguf_gemv", lambda x, d, q, *a, **kw: calls.append((q, kw.get("silu_mul", False))) or
                        real(x, d, q, *a, **kw))
    want = net.build_engine(device=DEVICE, backend="torch").forward(feed)["y"]
    unfused = engine.forward(feed)["y"].clone()                 # 64 rows < MMA_MIN_ROWS: CUDA-core GEMV + silu_mul
    assert calls == [("Q4_K", False)]
    monkeypatch.setattr(kernels, "MMA_MIN_ROWS", 64)
    got = engine.forward(feed)["y"]
    assert calls[1:] == [("Q4_K", True)]
    for out in (got, unfused):
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2 * want.float().abs().max().item(), rtol=2e-2)
