"""runtime/kernels/rope.py: the ``rope`` op in one launch (q and k of every token) against the op's
torch reference — NEOX and GPT-J pairs, a partial rotary dim, strided inputs (MLA's ``q_pe`` is a
slice of a wider head), one key head, float32 and 16-bit; on CPU under Triton's interpreter."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (see conftest.py)

import pytest  # noqa: E402

from graphdsl.errors import GraphDSLError  # noqa: E402
from graphdsl.functional.attention import RopeLayout  # noqa: E402
from graphdsl.opdef import get_op  # noqa: E402
from graphdsl.runtime.kernels.rope import rope, rope_unsupported  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
REF = get_op("rope").reference


def _operands(tokens, hq, hk, d, half, dtype, wide=0, seed=0):
    """q, k (as slices of ``d + wide``-wide heads when ``wide``), cos, sin of ``tokens`` positions."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, hq, d + wide, generator=g).to(DEV, dtype)[..., wide:]
    k = torch.randn(tokens, hk, d + wide, generator=g).to(DEV, dtype)[..., wide:]
    pos = torch.arange(tokens, dtype=torch.float32)[:, None] * 7.0
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    return q, k, torch.cos(pos * freq).to(DEV, dtype), torch.sin(pos * freq).to(DEV, dtype)


@pytest.mark.parametrize("layout", [RopeLayout.NEOX, RopeLayout.GPTJ])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,half,wide", [(64, 32, 128), (48, 16, 0)], ids=["mla_q_pe_slice", "partial_rotary"])
def test_rope_equals_the_reference(layout, dtype, d, half, wide):
    """Every element: rotated pairs in float32 rounded once, the dims past ``2 half`` copied."""
    q, k, cos, sin = _operands(5, 4, 1, d, half, dtype, wide)
    assert q.stride(-1) == 1 and (wide == 0 or not q.is_contiguous())
    want_q, want_k = REF(q, k, cos, sin, layout=layout)
    got_q, got_k = rope(q, k, cos, sin, torch.empty_like(want_q), torch.empty_like(want_k), layout)
    tol = 0 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got_q, want_q, rtol=tol, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=tol, atol=1e-6)


def test_pass_through_dims_keep_infinities():
    """A dim past the rotary ones holding inf stays inf (not ``inf * 0``: NaN)."""
    q, k, cos, sin = _operands(2, 2, 2, 48, 16, torch.float32)
    q[0, 1, 40] = float("inf")
    got_q, _ = rope(q, k, cos, sin, torch.empty_like(q), torch.empty_like(k))
    assert got_q[0, 1, 40].item() == float("inf") and not got_q.isnan().any()


def test_rope_refuses_what_it_cannot_take():
    q, k, cos, sin = _operands(2, 2, 2, 32, 16, torch.float32)
    assert rope_unsupported(q, k, cos, sin, torch.empty_like(q), torch.empty_like(k)) is None
    assert "contiguous" in rope_unsupported(q.transpose(1, 2), k, cos, sin, torch.empty_like(q), torch.empty_like(k))
    with pytest.raises(GraphDSLError, match=r"rope: unsupported operands \(dtypes q torch.float32 -> torch.bfloat16"):
        rope(q, k, cos, sin, torch.empty_like(q, dtype=torch.bfloat16), torch.empty_like(k))
