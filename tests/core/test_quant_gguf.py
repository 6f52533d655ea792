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
from graphdsl.runtime.gguf_blocks import from_stored, to_stored
from graphdsl.runtime.gguf_scheme import GGUFScheme, quantize_blocks

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# error bound relative to the row's largest |w|: a step of the coarsest scale (round-to-nearest would
# keep to half a step; the searched steps may clip a group's extremes), 3/2 of it for Q6_K
BOUND = {"Q8_0": 0.01, "Q4_0": 0.26, "Q4_1": 0.14, "Q5_0": 0.13, "Q5_1": 0.07, "Q4_K": 0.14, "Q5_K": 0.07,
         "Q6_K": 0.06}


def _gguf_py(data: torch.Tensor, qtype: str, n: int, k: int) -> torch.Tensor:
    """gguf-py's decode of stored blocks (the scheme's companions: gguf_blocks.to_stored's layout)."""
    import gguf
    file_rows = from_stored(data, qtype).contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(file_rows, gguf.GGMLQuantizationType[qtype]).reshape(n, k), dtype=np.float32))


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


@pytest.mark.parametrize("qtype", TYPES)
def test_encoders_search_their_steps_for_a_smaller_error(qtype, monkeypatch):
    """The encoders' step search (``graphdsl.quant_fit.fit_affine`` / ``fit_symmetric``) re-rounds N(0, 1)
    and heavy-tailed weights with a smaller squared error than plain round-to-nearest steps (each
    group's span over its levels; at least 3% less, as gguf-py decodes the blocks), the same on the
    CPU in chunks as in one pass."""
    import gguf

    import graphdsl.quant_fit as QF
    import graphdsl.runtime.gguf_scheme as GS
    g = torch.Generator().manual_seed(3)
    n, k = 48, 1024
    w = torch.cat([torch.randn(n, k, generator=g), torch.randn(n, k, generator=g) ** 3])

    def error(data):
        back = torch.from_numpy(np.ascontiguousarray(
            gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[qtype]).reshape(2 * n, k), dtype=np.float32))
        return ((back - w).square().sum() / w.square().sum()).sqrt().item()

    searched = quantize_blocks(w, qtype)
    monkeypatch.setattr(QF, "CPU_CHUNK_VALUES", 5 * 256)          # 2 * 48 * 4 super-blocks in 77 chunks
    assert torch.equal(quantize_blocks(w, qtype), searched)
    def plain_affine(xs, levels, any_low=False):
        low = -xs.amin(-1) if any_low else (-xs.amin(-1)).clamp(min=0)
        return (xs.amax(-1) + low) / levels, low
    monkeypatch.setattr(GS, "fit_affine", plain_affine)
    monkeypatch.setattr(GS, "fit_symmetric", lambda xs, qmin, qmax: xs.abs().amax(-1) / qmax)
    plain = quantize_blocks(w, qtype)
    assert error(searched) < 0.97 * error(plain), (error(searched), error(plain))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 20])
def test_cpu_engine_matches_dequantize_then_matmul(qtype, rows):
    n, k = 24, 256
    g = torch.Generator().manual_seed(rows)
    s = parse_scheme(f"gguf-{qtype.lower()}")
    with Network("q") as net:
        p = Parameter((n, k), torch.float32, name="proj.weight").quantize(s)
        net.mark_output(F.linear(Tensor("x", (rows, k), torch.float32), p, None, transpose_b=True), "y")
    data = to_stored(quantize_blocks(torch.randn(n, k, generator=g), qtype), qtype)
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


def test_mixed_parts_scheme():
    """A packed weight with row ranges in different block types: one stored tensor per run of a type,
    W the parts stacked; adjacent parts of one type merge, a single type is the plain scheme."""
    from graphdsl.runtime.gguf_scheme import GGUFMixScheme, gguf_scheme
    s = gguf_scheme([("Q4_K", 16), ("q4_k", 8), ("Q6_K", 8)])
    assert isinstance(s, GGUFMixScheme) and s.name == "gguf-q4_k.24+q6_k.8" and parse_scheme(s.name) == s
    assert gguf_scheme([("Q8_0", 4), ("Q8_0", 4)]) == GGUFScheme("Q8_0")
    assert [(c.suffix, c.shape) for c in s.companions(32, 256)] == [("_packed", (24, 144)), ("_packed1", (8, 224))]
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(3))
    stored = s.quantize(w)
    assert stored[1].reshape(8, 224)[:, 210:].abs().sum() == 0          # Q6_K stored: the file's bytes, then zeros
    want = torch.cat([_gguf_py(stored[0], "Q4_K", 24, 256), _gguf_py(stored[1], "Q6_K", 8, 256)])
    torch.testing.assert_close(s.dequantize(stored, 32, 256, torch.float32), want, atol=0, rtol=0)
    with Network("m") as net:
        p = Parameter((32, 256), torch.float32, name="qkv.weight").quantize(s)
        net.mark_output(F.linear(Tensor("x", (3, 256), torch.float32), p, None, transpose_b=True), "y")
    x = torch.randn(3, 256)
    got = net.build_engine(device="cpu").forward({"x": x, "qkv.weight_packed": stored[0],
                                                  "qkv.weight_packed1": stored[1]})["y"]
    torch.testing.assert_close(got, x @ want.T, atol=1e-4, rtol=1e-4)
    with pytest.raises(GraphDSLError, match=r"'gguf-q4_k.24\+q6_k.8'.*'qkv.weight' has 40 rows, its parts 32"):
        Parameter((40, 256), name="qkv.weight").quantize(s)
    with pytest.raises(GraphDSLError, match=r"unknown gguf scheme 'gguf-q4_k.24\+q3_k.8'"):
        parse_scheme("gguf-q4_k.24+q3_k.8")


def test_block_major_schemes_round_trip():
    """``-kb`` schemes (what a CUDA bind stores): the same blocks block-major, ``[K / values, N, block
    bytes]`` per part; names parse back; ``quantize`` / ``dequantize`` agree with the row layout's;
    ``in_layout`` converts either layout to the scheme's; the CPU engine gives the same products."""
    from graphdsl.runtime.gguf_blocks import block_major, row_major
    from graphdsl.runtime.gguf_scheme import GGUFMixScheme
    s = parse_scheme("gguf-q4_k.24+q6_k.8-kb")
    assert s == GGUFMixScheme((("Q4_K", 24), ("Q6_K", 8)), blocked=True) and s.name == "gguf-q4_k.24+q6_k.8-kb"
    assert s.with_blocks(False).name == "gguf-q4_k.24+q6_k.8" and s.with_blocks(False).with_blocks() == s
    assert parse_scheme("gguf-q8_0-kb") == GGUFScheme("Q8_0", True) and GGUFScheme("Q8_0").blocked is False
    assert [(c.shape, c.per_row) for c in s.companions(32, 512)] == [((2, 24, 144), False), ((2, 8, 224), False)]
    w = torch.randn(32, 512, generator=torch.Generator().manual_seed(4))
    rows, kb = s.with_blocks(False).quantize(w), s.quantize(w)
    assert all(torch.equal(b, block_major(r, q)) and torch.equal(row_major(b, q), r)
               for r, b, q in zip(rows, kb, ["Q4_K", "Q6_K"]))
    assert torch.equal(kb[0][1, 5], rows[0][5, 144:288])                 # block 1 of row 5
    want = s.with_blocks(False).dequantize(rows, 32, 512, torch.float32)
    assert torch.equal(s.dequantize(kb, 32, 512, torch.float32), want)
    assert all(torch.equal(a, b) for a, b in zip(s.in_layout(rows, 512), kb))
    assert all(torch.equal(a, b) for a, b in zip(s.with_blocks(False).in_layout(kb, 512), rows))
    with Network("m") as net:
        p = Parameter((32, 512), torch.float32, name="qkv.weight").quantize(s)
        net.mark_output(F.linear(Tensor("x", (3, 512), torch.float32), p, None, transpose_b=True), "y")
    x = torch.randn(3, 512)
    got = net.build_engine(device="cpu").forward({"x": x, "qkv.weight_packed": kb[0], "qkv.weight_packed1": kb[1]})["y"]
    torch.testing.assert_close(got, x @ want.T, atol=1e-4, rtol=1e-4)
    with pytest.raises(GraphDSLError, match=r"row_major: data must be uint8 \[blocks, rows, 144\]"):
        row_major(rows[0], "Q4_K")
    with pytest.raises(GraphDSLError, match=r"block_major: data must be uint8 \[rows, a multiple of 224\] \(stored "
                                            r"Q6_K blocks\), got torch.uint8 \[8, 210\]"):
        block_major(torch.zeros(8, 210, dtype=torch.uint8), "Q6_K")
