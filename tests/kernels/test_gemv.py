"""Small-M GEMV vs torch (under the CPU interpreter here, compiled on a GPU)."""
import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.runtime.kernels.gemv import gemv

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (3, 17, 100), (8, 64, 256), (16, 33, 70)])
@pytest.mark.parametrize("add", [None, "bias", "residual"])
def test_gemv_matches_torch(m, n, k, add):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(DEV, torch.float16)
    w = torch.randn(n, k, generator=g).to(DEV, torch.float16)
    a = {None: None, "bias": torch.randn(n, generator=g), "residual": torch.randn(m, n, generator=g)}[add]
    a = None if a is None else a.to(DEV, torch.float16)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEV)
    gemv(x, w, a, out=out)
    want = x.float() @ w.float().T + (0 if a is None else a.float())
    torch.testing.assert_close(out.float(), want, rtol=2e-3, atol=2e-2)


def test_gemv_rejects_what_it_cannot_run():
    x = torch.randn(17, 8, dtype=torch.float16)
    with pytest.raises(GraphDSLError, match=r"gemv: needs x \[M<= 16, K\].*got x \[17, 8\]"):
        gemv(x, torch.randn(4, 8, dtype=torch.float16))
    with pytest.raises(GraphDSLError, match=r"add must be a bias \[4\] or a residual \[2, 4\], got \[3\]"):
        gemv(x[:2], torch.randn(4, 8, dtype=torch.float16), torch.randn(3, dtype=torch.float16))
