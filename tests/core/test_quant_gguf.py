"""GGUF block types as quantization schemes (``gguf-q4_k`` ...): names, companions, the CPU engine
against dequantize-then-matmul with gguf-py's decoder, the round-to-nearest encoders against gguf-py
(independent of graphdsl), printing, and errors naming the weight and the scheme."""
import numpy as np
import pytest
import torch

import graphdsl.runtime  # noqa: F401 - registers the gguf-* schemes
from graphdsl import Network, Parameter, Tensor
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError
from graphdsl.quant import online_scheme, parse_scheme
from graphdsl.runtime.gguf_scheme import GGUFScheme, quantize_blocks

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
# round-to-nearest error bound relative to the row's largest |w|: half a step of the coarsest scale
# (Q4_0: llama.cpp's d = max / -8 clips the opposite sign at 7/8 of the max)
BOUND = {"Q8_0": 0.005, "Q4_0": 0.13, "Q4_1": 0.07, "Q4_K": 0.07, "Q5_K": 0.035, "Q6_K": 0.02}


def _gguf_py(data: torch.Tensor, qtype: str, n: int, k: int) -> torch.Tensor:
    import gguf
    return torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[qtype]).reshape(n, k), dtype=np.float32))


@pytest.mark.parametrize("qtype", TYPES)
def test_encoder_round_trips_through_gguf_py(qtype):
    """quantize_blocks writes blocks gguf-py decodes to within half a quantization step of the weight,
    and the scheme's dequantize reads them exactly as gguf-py does."""
    g = torch.Generator().manual_seed(1)
    n, k = 6, 512
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    w[0, :256] = 0.0                                   # an all-zero block / super-block stays finite
    w[1] = w[1].abs()                                  # a row without negative values (K types: min 0)
    s = parse_scheme(f"gguf-{qtype.lower()}")
    (data,) = s.quantize(w)
    assert data.dtype == torch.uint8 and tuple(data.shape) == s.companions(n, k)[0].shape
    ref = _gguf_py(data, qtype, n, k)
    torch.testing.assert_close(s.dequantize([data], n, k, torch.float32), ref, atol=0, rtol=0)
    err = (ref - w).abs().amax(1) / w.abs().amax(1).clamp(min=1e-9)
    assert err.max().item() < BOUND[qtype], (qtype, err)
    assert ref[0, :256].abs().max().item() == 0.0


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 20])
def test_cpu_engine_matches_dequantize_then_matmul(qtype, rows):
    n, k = 24, 256
    g = torch.Generator().manual_seed(rows)
    s = parse_scheme(f"gguf-{qtype.lower()}")
    with Network("q") as net:
        p = Parameter((n, k), torch.float32, name="proj.weight").quantize(s)
        net.mark_output(F.linear(Tensor("x", (rows, k), torch.float32), p, None, transpose_b=True), "y")
    data = quantize_blocks(torch.randn(n, k, generator=g), qtype)
    x = torch.randn(rows, k, generator=g)
    got = net.build_engine(device="cpu").forward({"x": x, "proj.weight_packed": data})["y"]
    torch.testing.assert_close(got, x @ _gguf_py(data, qtype, n, k).T, atol=1e-4, rtol=1e-4)
    assert "quant_linear" in str(net) and f"scheme=gguf-{qtype.lower()}" in str(net)


def test_names_parse_and_errors():
    s = parse_scheme("gguf-q4_k")
    assert isinstance(s, GGUFScheme) and s.qtype == "Q4_K" and s.name == "gguf-q4_k" and str(s) == "gguf-q4_k"
    assert [c.suffix for c in s.companions(8, 512)] == ["_packed"] and s.companions(8, 512)[0].shape == (8, 288)
    assert online_scheme("gguf-q6_k") == GGUFScheme("Q6_K")
    with pytest.raises(GraphDSLError, match=r"unknown gguf scheme 'gguf-q3_k'.*'q4_k'"):
        parse_scheme("gguf-q3_k")
    with pytest.raises(GraphDSLError, match=r"quantization='gguf' keeps the block types of a GGUF file"):
        online_scheme("gguf")
    with pytest.raises(GraphDSLError, match=r"'gguf-q4_k'.*'layer.weight' has 96 inputs.*Q4_K block of 256"):
        Parameter((8, 96), name="layer.weight").quantize("gguf-q4_k")
    with pytest.raises(GraphDSLError, match=r"quantize_blocks: weight must be a 2-D float"):
        quantize_blocks(torch.zeros(4, 32, dtype=torch.int32), "Q8_0")
