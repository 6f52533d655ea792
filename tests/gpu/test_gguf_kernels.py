"""GGUF kernels (runtime/kernels/gguf_linear.py) on the GPU at Llama-3-8B projection shapes, per block
type: the GEMV (1, 4, 8, 16 rows — 4 and 8 of Q4_K on the several-row tensor-core kernel; 17, 40, 64
for the plane types), the dequantize kernel and the
prefill path against the torch reference decoder (itself checked against gguf-py's numpy dequantize
on the same real-size bytes); the packed-PTX planes of Q4_K / Q6_K against the float32 ones. The kernels
read the stored layout (gguf_blocks.to_stored: Q6_K padded to 224-byte blocks; one Q6_K row of at
least 2048 weight rows runs on the tensor cores, gguf_mma_q6k).

Run on the device machine: ``python3 -m pytest -m gpu tests/gpu/test_gguf_kernels.py``.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():   # before the kernel imports: triton picks the interpreter at decoration
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from graphdsl.runtime.gguf_blocks import dequantize_blocks, to_stored  # noqa: E402
from graphdsl.runtime.kernels.gguf_linear import gemv_rows, gguf_dequantize, gguf_gemv, gguf_linear  # noqa: E402
from tests.helpers.gguf_blocks import KERNEL_QTYPES, random_gguf_blocks  # noqa: E402

SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module", params=KERNEL_QTYPES)
def qtype(request):
    return request.param


@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_real_shapes(qtype, n, k):
    data = random_gguf_blocks(qtype, n, k, seed=n + k)
    w = dequantize_blocks(data, qtype, k)
    data = to_stored(data, qtype)
    for m in (1, 4, 8, 16, 17, 40, 64):
        if m > gemv_rows(qtype):
            continue
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        got = gguf_gemv(x, data, qtype)
        want = x.float() @ w.T
        assert got.dtype == torch.bfloat16 and not torch.isnan(got).any()
        assert rel_err(got, want) < 1e-2, (qtype, n, k, m)


@pytest.mark.parametrize("packed", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [2, 16, 33])
def test_planes_decoded_by_packed_ptx_match_the_float32_planes(packed, dtype, m, monkeypatch):
    """Several rows of Q4_K / Q6_K decode their planes in the activations' dtype by packed PTX
    (``_FAST_PLANES``: ``2^k + q`` in the mantissa, ``2^k`` subtracted, one fma): the same sums as
    the float32 decode to the dtype's rounding of the scales, both within 1e-2 of the reference."""
    import graphdsl.runtime.kernels.gguf_linear as gl
    qtype = packed
    n, k = 4096 + 64 * 3 + 19, 4096          # a partial row tile
    data = random_gguf_blocks(qtype, n, k, seed=m)
    w = dequantize_blocks(data, qtype, k)
    data = to_stored(data, qtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    want = x.float() @ w.T
    got = {}
    for fast in (True, False):
        monkeypatch.setattr(gl, "_FAST_PLANES", fast)
        got[fast] = gguf_gemv(x, data, qtype)
        assert got[fast].dtype == dtype and rel_err(got[fast], want) < 1e-2, (fast, rel_err(got[fast], want))
    assert rel_err(got[True], got[False]) < 4e-3


@pytest.mark.parametrize("n,k", SHAPES[:2])
def test_dequantize_and_prefill_real_shapes(qtype, n, k):
    data = random_gguf_blocks(qtype, n, k, seed=3)
    w = dequantize_blocks(data, qtype, k)
    data = to_stored(data, qtype)
    torch.testing.assert_close(gguf_dequantize(data, qtype, torch.float32), w, rtol=0, atol=0)
    torch.testing.assert_close(gguf_dequantize(data, qtype, torch.bfloat16), w.to(torch.bfloat16), rtol=0, atol=0)
    x = torch.randn(300, k, device="cuda", dtype=torch.bfloat16)
    assert rel_err(gguf_linear(x, data, qtype), x.float() @ w.T) < 1e-2


def test_reference_decoder_matches_gguf_py_at_real_size(qtype):
    gguf = pytest.importorskip("gguf")
    data = random_gguf_blocks(qtype, 4096, 4096, seed=11)
    ref = gguf.quants.dequantize(data.cpu().numpy(), gguf.GGMLQuantizationType[qtype]).reshape(4096, 4096)
    torch.testing.assert_close(dequantize_blocks(data, qtype, 4096).cpu(), torch.from_numpy(ref.copy()), rtol=0, atol=0)
