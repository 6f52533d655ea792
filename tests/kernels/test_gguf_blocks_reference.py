"""runtime/gguf_blocks.py: the torch reference decoders on raw rows vs gguf-py's numpy dequantize."""
import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.runtime.gguf_blocks import GGUF_BLOCKS, dequantize_blocks, row_bytes
from tests.helpers.gguf_blocks import KERNEL_QTYPES, random_gguf_weight

pytest.importorskip("gguf")


@pytest.mark.parametrize("qtype", KERNEL_QTYPES + ("Q2_K", "Q3_K"))
def test_dequantize_blocks_matches_gguf_py(qtype):
    n, k = 5, 512
    data, ref = random_gguf_weight(qtype, n, k, seed=len(qtype) * 7 + n)
    assert data.shape == (n, row_bytes(qtype, k)) and data.dtype == torch.uint8
    out = dequantize_blocks(data, qtype, k)
    assert out.dtype == torch.float32 and out.shape == (n, k)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_dequantize_blocks_reads_rows_independently():
    """A row slice (as a tensor-parallel shard or a q/k row permutation takes) decodes to the same rows."""
    data, ref = random_gguf_weight("Q6_K", 6, 256, seed=3)
    perm = torch.tensor([4, 0, 5, 2])
    torch.testing.assert_close(dequantize_blocks(data[perm], "Q6_K", 256), ref[perm], rtol=0, atol=0)


def test_row_bytes_and_errors():
    assert row_bytes("Q4_K", 4096) == 16 * 144 and row_bytes("Q8_0", 64) == 68
    assert GGUF_BLOCKS["Q6_K"] == (256, 210)
    with pytest.raises(GraphDSLError, match=r"Q4_K row needs a positive multiple of 256 values, got K=100"):
        row_bytes("Q4_K", 100)
    with pytest.raises(GraphDSLError, match=r"'IQ2_XS' is not supported; supported: \['F32'"):
        row_bytes("IQ2_XS", 256)
    with pytest.raises(GraphDSLError, match=r"data must be uint8 \[rows, 18\] \(Q4_0, K=32\), got torch.uint8 \[2, 20\]"):
        dequantize_blocks(torch.zeros(2, 20, dtype=torch.uint8), "Q4_0", 32)
