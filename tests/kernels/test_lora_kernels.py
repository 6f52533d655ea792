"""The LoRA kernels (runtime/kernels/lora.py), both paths, against the ``lora_apply`` op's torch reference."""
import pytest
import torch

from graphdsl.opdef import get_op
from graphdsl.runtime.kernels.lora import lora_apply

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dense", [False, True], ids=["bgmv", "dense"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("t,k,n,r,s", [(5, 48, 40, 8, 3), (3, 600, 70, 12, 2)])   # K=600: two split-K slices
def test_lora_kernel_matches_reference(dense, dtype, tol, t, k, n, r, s):
    g = torch.Generator().manual_seed(t * 100 + r)
    x = torch.randn(t, k, generator=g).to(DEV, dtype)
    y = torch.randn(t, n, generator=g).to(DEV, dtype)
    a = (torch.randn(s, r, k, generator=g) / k ** 0.5).to(DEV, dtype)
    b = torch.randn(n, s, r, generator=g).to(DEV, dtype)
    idx = torch.tensor([(i % (s + 1)) - 1 for i in range(t)], dtype=torch.int32, device=DEV)   # -1 = base row
    want = get_op("lora_apply").reference(y, x, a, b, idx)
    ws = torch.full((t * r * max(s, 2),), float("nan"), device=DEV)      # stale scratch must not leak in
    got = lora_apply(y, x, a, b, idx, workspace=ws, dense=dense)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    base = idx < 0
    if not dense:
        assert torch.equal(got[base], y[base])        # rows without an adapter are copied exactly
    assert not torch.allclose(got[~base].float(), y[~base].float(), atol=tol)
