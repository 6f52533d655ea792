"""The decode GEMV with the LoRA term in its epilogue (``HAS_LORA``), after one BGMV shrink launch,
and the slot-dense shrink of many rows, against the fused ops' torch references."""
import pytest
import torch

from graphdsl.opdef import get_op
from graphdsl.runtime.kernels.gemv import GemvLoRA, GemvWorkspace, gemv
from graphdsl.runtime.kernels.lora import lora_shrink, lora_shrink_dense, lora_splits

import graphdsl.passes  # noqa: F401  (registers the fused ops)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _factors(m, n, k, r, s, dtype, seed, slots_of_rows=None):
    g = torch.Generator().manual_seed(seed)
    t = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)  # noqa: E731
    x, w = t(m, k), t(n, k, scale=0.3)
    a, b = t(s, r, k, scale=k ** -0.5), t(n, s, r)
    idx = slots_of_rows if slots_of_rows is not None else [((i + 1) % (s + 1)) - 1 for i in range(m)]  # -1: base
    return x, w, a, b, torch.tensor(idx, dtype=torch.int32, device=DEV)


def _shrunk(x, a, idx):
    p = torch.full((x.shape[0] * lora_splits(x.shape[1]) * a.shape[1],), float("nan"), device=DEV)
    return lora_shrink(x, a, idx, p)              # NaN in base rows: the epilogue must skip them


# K=600 spans two LORA_SPLIT_K slices of the shrink; SPLIT_K > 1 splits the GEMV too
@pytest.mark.parametrize("epilogue", ["none", "bias", "residual", "silu_mul"])
@pytest.mark.parametrize("m,n,k,r,s,split", [(1, 40, 64, 8, 1, 1), (5, 48, 600, 12, 3, 2), (16, 34, 96, 16, 2, 3)])
def test_gemv_lora_epilogue_matches_reference(epilogue, m, n, k, r, s, split):
    dtype = torch.float16
    x, w, a, b, idx = _factors(m, n, k, r, s, dtype, m * 100 + n + k)
    g = torch.Generator().manual_seed(1)
    cols = n // 2 if epilogue == "silu_mul" else n
    add = {"none": None, "bias": torch.randn(n, generator=g), "residual": torch.randn(m, n, generator=g),
           "silu_mul": None}[epilogue]
    add = None if add is None else add.to(DEV, dtype)
    cfg = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split, num_warps=4, num_stages=2)
    out = torch.full((m, cols), float("nan"), dtype=dtype, device=DEV)
    gemv(x, w, add, silu_mul=epilogue == "silu_mul", out=out, workspace=GemvWorkspace(), config=cfg,
         lora=GemvLoRA(_shrunk(x, a, idx), b, idx))
    if epilogue == "silu_mul":
        want = get_op("matmul_silu_mul_lora").reference(x.float(), w.float(), a.float(), b.float(), idx)
    elif add is None:
        want = get_op("matmul_lora").reference(x.float(), w.float(), a.float(), b.float(), idx)
    else:
        want = get_op("matmul_add_lora").reference(x.float(), w.float(), add.float(), a.float(), b.float(), idx)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=3e-2)
    plain = gemv(x, w, add, silu_mul=epilogue == "silu_mul", config=cfg)
    base, lora = idx < 0, idx >= 0
    assert torch.equal(out[base], plain[base])                      # base rows: exactly the plain GEMV
    assert not torch.allclose(out[lora].float(), plain[lora].float(), atol=3e-2)   # the term is there


def test_gemv_lora_bfloat16_default_launch():
    x, w, a, b, idx = _factors(3, 64, 128, 16, 2, torch.bfloat16, 5, slots_of_rows=[1, -1, 0])
    got = gemv(x, w, lora=GemvLoRA(_shrunk(x, a, idx), b, idx))
    want = get_op("matmul_lora").reference(x.float(), w.float(), a.float(), b.float(), idx)
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=1e-1)


def test_gemv_lora_rejects_mismatched_factors():
    from graphdsl import GraphDSLError
    x, w, a, b, idx = _factors(2, 32, 64, 8, 2, torch.float16, 9)
    with pytest.raises(GraphDSLError, match="lora needs"):
        gemv(x, w, lora=GemvLoRA(_shrunk(x, a, idx), b[:16], idx))


@pytest.mark.parametrize("by_rows,ready", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("t,k,r,s", [(20, 48, 8, 3), (33, 70, 12, 2), (20, 600, 8, 1)])   # the last: split K
def test_dense_shrink_keeps_only_each_rows_slot(dtype, tol, t, k, r, s, by_rows, ready):
    """Both ways to the slot-dense V (row-block tiles; per-row slices whose last writes the row)
    give each row its own slot's product and zeros elsewhere, base rows included, and leave their
    arrival counters at zero for the next launch."""
    x, _, a, _, idx = _factors(t, 8, k, r, s, dtype, t + k)
    idx[: 16] = 0                                    # the first row block uses slot 0 only: others write zeros
    out = torch.full((t, s * r), float("nan"), dtype=dtype, device=DEV)
    scratch = {}
    lora_shrink_dense(x, a, idx, out, scratch=scratch, by_rows=by_rows, inputs_ready=ready)
    first = out.clone()
    lora_shrink_dense(x, a, idx, out, scratch=scratch, by_rows=by_rows, inputs_ready=ready)   # counters were reset
    assert torch.equal(out, first)
    if (k == 600 or by_rows) and DEV == "cpu":
        (_, lock), = scratch.values()
        assert int(lock.abs().sum()) == 0
    want = torch.zeros(t, s * r)
    for i, slot in enumerate(idx.tolist()):
        if slot >= 0:
            want[i, slot * r:(slot + 1) * r] = x[i].float() @ a[slot].float().T
    torch.testing.assert_close(out.float().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("r", [8, 48])
def test_shrink_prefetch_gives_the_same_partials(r):
    """``inputs_ready`` (slot and A read before the PDL wait, one A tile per program) computes what the
    K-stepping shrink does; base rows are left untouched by both."""
    x, _, a, _, idx = _factors(4, 8, 600, r, 2, torch.float16, r)
    p = torch.full((4 * lora_splits(600) * r,), float("nan"), device=DEV)
    plain = lora_shrink(x, a, idx, p.clone())
    ready = lora_shrink(x, a, idx, p.clone(), inputs_ready=True)
    rows = idx >= 0
    torch.testing.assert_close(ready[rows], plain[rows], atol=1e-3, rtol=1e-3)
    assert torch.isnan(ready[~rows]).all() and torch.isnan(plain[~rows]).all()
    want = torch.stack([x[i].float() @ a[s].float().T if s >= 0 else torch.zeros(r, device=DEV)
                        for i, s in enumerate(idx.tolist())])
    torch.testing.assert_close(ready.sum(1)[rows], want[rows], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("t,inter,r,s", [(20, 40, 8, 3), (70, 24, 16, 2), (20, 40, 16, 3)])   # last: two W steps
def test_silu_mul_lora_adds_each_rows_term_before_the_swiglu(dtype, tol, t, inter, r, s):
    """``silu_mul_lora`` = silu(g) · u of ``prod + V·B_allᵀ``, the reference computed in float32;
    base rows (V zero) get the plain SwiGLU of the product."""
    from graphdsl.runtime.kernels.lora import silu_mul_lora
    x, _, a, b, idx = _factors(t, 2 * inter, 48, r, s, dtype, t + inter)
    v = torch.empty(t, s * r, dtype=dtype, device=DEV)
    lora_shrink_dense(x, a, idx, v)
    g = torch.Generator().manual_seed(t)
    prod = torch.randn(t, 2 * inter, generator=g).to(DEV, dtype)
    out = torch.full((t, inter), float("nan"), dtype=dtype, device=DEV)
    silu_mul_lora(prod, v, b, out)
    full = prod.float() + v.float() @ b.view(2 * inter, s * r).float().T
    want = torch.nn.functional.silu(full[:, :inter]) * full[:, inter:]
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    base = (idx < 0).nonzero().flatten()
    plain = torch.nn.functional.silu(prod[base, :inter].float()) * prod[base, inter:].float()
    torch.testing.assert_close(out[base].float(), plain, atol=tol, rtol=tol)
