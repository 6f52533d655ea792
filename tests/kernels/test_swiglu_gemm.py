"""The tiled gate/up GEMM with the SwiGLU epilogue (runtime/kernels/swiglu_gemm.py) for 17-256 rows:
against the product rounded to the dtype and put through ``silu_mul``, as the two-kernel path does."""
import pytest
import torch

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.kernels.swiglu_gemm import MAX_ROWS, MIN_ROWS, launch_for, swiglu_gemm

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _two_kernels(x, w):
    """silu_mul of the product, each rounded as the product and the silu_mul kernel round them."""
    i = w.shape[0] // 2
    prod = (x.float() @ w.float().T).to(x.dtype).float()
    return (torch.nn.functional.silu(prod[:, :i]).to(x.dtype).float() * prod[:, i:]).to(x.dtype)


@pytest.mark.parametrize("m,k,i,cfg", [
    (17, 256, 96, None),                                                           # one 64-row tile, masked rows
    (70, 200, 72, None),                                                           # 128-row tiles; K, I not whole steps
    (130, 128, 64, dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, STAGES=2, num_warps=4)),   # several row and K tiles
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_the_product_through_silu_mul(m, k, i, cfg, dtype):
    g = torch.Generator().manual_seed(m + k + i)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * i, k, generator=g) * 0.1).to(DEV, dtype)
    out = torch.full((m, i), float("nan"), dtype=dtype, device=DEV)
    got = swiglu_gemm(x, w, out=out, config=cfg)
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any()
    want = _two_kernels(x, w)
    if dtype == torch.float16:
        # float32 sums in another order: g or u may round to the neighbouring value, then silu(g)
        torch.testing.assert_close(got.float(), want.float(), rtol=4e-3, atol=4e-3 * want.float().abs().max().item())
        assert (got == want).float().mean().item() > 0.95
    else:       # the interpreter truncates float32 to bfloat16 (the GPU rounds to nearest): g, u, silu(g)
        torch.testing.assert_close(got.float(), want.float(), rtol=4e-2, atol=4e-2 * want.float().abs().max().item())


def test_reads_rows_with_a_row_stride():
    """``x`` may be a row slice of a wider buffer (unit last stride only)."""
    base = torch.randn(40, 96, generator=torch.Generator().manual_seed(3)).to(DEV, torch.float16)
    x = base[:, 16:80]
    w = (torch.randn(64, 64, generator=torch.Generator().manual_seed(4)) * 0.1).to(DEV, torch.float16)
    torch.testing.assert_close(swiglu_gemm(x, w).float(), _two_kernels(x.contiguous(), w).float(),
                               rtol=4e-3, atol=4e-3)


def test_launch_only_where_it_beat_cublas():
    """64 and 128 rows (the decode buckets) take the kernel; 32, 96 and 192 rows keep cuBLAS; 256
    rows only with K <= 2048 (where it measured faster: docs/performance-log.md)."""
    assert launch_for(64, 4096)["BLOCK_M"] == 64 and launch_for(128, 4096)["BLOCK_M"] == 128
    assert launch_for(256, 2048)["BLOCK_N"] == 128 and launch_for(256, 4096) is None
    assert [launch_for(m, 2048) for m in (MIN_ROWS, 32, 96, 192)] == [None] * 4


def test_errors_name_the_operands():
    x = torch.randn(MIN_ROWS - 1, 32, device=DEV, dtype=torch.float16)
    w = torch.randn(64, 32, device=DEV, dtype=torch.float16)
    with pytest.raises(GraphDSLError, match=rf"needs x \[M, K\] with {MIN_ROWS} <= M <= {MAX_ROWS}.*got x \[16, 32\]"):
        swiglu_gemm(x, w)
    x = torch.randn(20, 32, device=DEV, dtype=torch.float16)
    with pytest.raises(GraphDSLError, match=r"w \[63, 32\]"):
        swiglu_gemm(x, w[:63])
    with pytest.raises(GraphDSLError, match=r"out \(\[20, 64\]"):
        swiglu_gemm(x, w, out=torch.empty(20, 64, device=DEV, dtype=torch.float16))
    with pytest.raises(GraphDSLError, match=r"w \[64, 32\] torch.bfloat16"):
        swiglu_gemm(x, w.bfloat16())
