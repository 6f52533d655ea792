"""The BGMV LoRA kernels (runtime/kernels/lora.py) against the ``lora_apply`` op's torch reference."""
import pytest
import torch

from graphdsl.opdef import get_op
from graphdsl.runtime.kernels.lora import lora_apply

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t,k,n,r,s", [(5, 48, 40, 8, 3), (3, 33, 70, 16, 2)])
def test_lora_kernel_matches_reference(dtype, tol, t, k, n, r, s):
    g = torch.Generator().manual_seed(t * 100 + r)
    x = torch.randn(t, k, generator=g).to(DEV, dtype)
    y = torch.randn(t, n, generator=g).to(DEV, dtype)
    a = (torch.randn(s, r, k, generator=g) / k ** 0.5).to(DEV, dtype)
    b = torch.randn(s, n, r, generator=g).to(DEV, dtype)
    idx = torch.tensor([(i % (s + 1)) - 1 for i in range(t)], dtype=torch.int32, device=DEV)   # -1 = base row
    want = get_op("lora_apply").reference(y, x, a, b, idx)
    got = lora_apply(y, x, a, b, idx)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    base = idx < 0
    assert torch.equal(got[base], y[base])            # rows without an adapter are copied exactly
    assert not torch.allclose(got[~base].float(), y[~base].float())
