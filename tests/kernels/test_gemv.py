"""Small-M GEMV (split-K, bias/residual epilogue) vs torch (under the CPU interpreter here, compiled on a GPU)."""
import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.runtime.kernels.gemv import GemvWorkspace, _pick_config, gemv, gemv_add_rms_norm, gemv_swiglu

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m, n, k, add, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    return t(m, k), t(n, k), {None: None, "bias": t(n), "residual": t(m, n)}[add]


def _reference(x, w, add):
    return x.float() @ w.float().T + (0 if add is None else add.float())


@pytest.mark.parametrize("m,n,k,split", [(1, 40, 64, 1), (3, 17, 100, 2), (8, 64, 256, 4), (16, 33, 70, 3)])
@pytest.mark.parametrize("add", [None, "bias", "residual"])
def test_gemv_matches_torch(m, n, k, split, add):
    x, w, a = _operands(m, n, k, add, torch.float16, m * 1000 + n + k)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEV)
    cfg = dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=split, num_warps=4, num_stages=2)
    gemv(x, w, a, out=out, config=cfg)
    torch.testing.assert_close(out.float(), _reference(x, w, a), rtol=1e-2, atol=3e-2)


def test_gemv_bfloat16_and_default_launch():
    x, w, a = _operands(2, 96, 160, "bias", torch.bfloat16, 7)
    torch.testing.assert_close(gemv(x, w, a).float(), _reference(x, w, a), rtol=2e-2, atol=1e-1)


def test_split_k_is_deterministic_and_leaves_counters_at_zero():
    """The last-arriving program sums the slices in slice order, so repeated launches on one
    workspace give bit-identical results and the counters are reset for the next launch."""
    x, w, _ = _operands(4, 48, 512, None, torch.float16, 3)
    ws = GemvWorkspace()
    cfg = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=4, num_warps=4, num_stages=2)
    first = gemv(x, w, workspace=ws, config=cfg)
    for _ in range(3):
        assert torch.equal(gemv(x, w, workspace=ws, config=cfg), first)
    (part, lock, _, norm_lock), = ws._buffers.values()
    assert lock.shape == (3,) and int(lock.abs().sum()) == 0 and int(norm_lock.abs().sum()) == 0
    assert ws.nbytes > 0


def test_pick_config_from_the_sweeps(monkeypatch):
    import graphdsl.runtime.kernels.gemv as g
    monkeypatch.setattr(g, "_num_sms", lambda device: 132)             # an H100/H200
    dev = torch.device("cpu")
    pick = lambda n, k: _pick_config(1, n, k, dev)  # noqa: E731
    assert (pick(6144, 4096)["BLOCK_K"], pick(6144, 4096)["SPLIT_K"]) == (128, 1)   # 96 tiles > 66
    assert (pick(4096, 4096)["BLOCK_K"], pick(4096, 4096)["SPLIT_K"]) == (256, 1)   # 64 tiles
    assert pick(2048, 8192)["SPLIT_K"] == 4                                         # 32 tiles, 32 steps
    assert pick(2048, 2048)["SPLIT_K"] == 1                                         # 32 tiles, 8 steps
    assert pick(64, 200)["BLOCK_K"] == 128 and pick(64, 48)["BLOCK_K"] == 64        # short K


def test_gemv_rejects_what_it_cannot_run():
    x = torch.randn(17, 8, dtype=torch.float16)
    with pytest.raises(GraphDSLError, match=r"gemv: needs x \[M<= 16, K\].*got x \[17, 8\]"):
        gemv(x, torch.randn(4, 8, dtype=torch.float16))
    with pytest.raises(GraphDSLError, match=r"add must be a bias \[4\] or a residual \[2, 4\], got \[3\]"):
        gemv(x[:2], torch.randn(4, 8, dtype=torch.float16), torch.randn(3, dtype=torch.float16))
    with pytest.raises(GraphDSLError, match=r"out must be \[2, 4\] torch.float16.*got \[2, 5\]"):
        gemv(x[:2], torch.randn(4, 8, dtype=torch.float16), out=torch.empty(2, 5, dtype=torch.float16))


@pytest.mark.parametrize("m,i,k", [(1, 64, 128), (5, 40, 96), (16, 33, 70)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_swiglu_matches_torch(m, i, k, dtype):
    g = torch.Generator().manual_seed(m + i + k)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * i, k, generator=g) / k ** 0.5).to(DEV, dtype)
    act, gate_up = gemv_swiglu(x, w)
    want_gu = x.float() @ w.float().T
    torch.testing.assert_close(gate_up.float(), want_gu, rtol=2e-2, atol=2e-2)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(act.float(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)


def test_gemv_swiglu_rejects_odd_rows():
    with pytest.raises(GraphDSLError, match=r"gemv_swiglu: needs .* w \[2I, K\].*got .* w \[5, 8\]"):
        gemv_swiglu(torch.randn(1, 8, dtype=torch.float16), torch.randn(5, 8, dtype=torch.float16))


@pytest.mark.parametrize("m,n,k,split,block_n", [(1, 64, 128, 1, 16), (3, 100, 96, 2, 16), (16, 48, 70, 3, 32),
                                                 (2, 520, 64, 1, 16)])
def test_gemv_add_rms_norm_matches_the_unfused_ops(m, n, k, split, block_n):
    """s = x @ w.T + residual, normed = rms_norm(s): the last tile's program normalises whole rows
    (n = 520 > one 512-column chunk of that loop); repeated launches on one workspace agree."""
    from graphdsl.opdef import get_op
    g = torch.Generator().manual_seed(m * 7 + n)
    t = lambda *s: torch.randn(*s, generator=g).to(DEV, torch.float16)  # noqa: E731
    x, w, r, gamma = t(m, k), t(n, k) / k ** 0.5, t(m, n), t(n)
    ws = GemvWorkspace()
    cfg = dict(BLOCK_N=block_n, BLOCK_K=16, SPLIT_K=split, num_warps=4, num_stages=2)
    normed, s_out = gemv_add_rms_norm(x, w, r, gamma, 1e-5, workspace=ws, config=cfg)
    want_s = (x.float() @ w.float().T + r.float()).to(torch.float16)
    torch.testing.assert_close(s_out, want_s, rtol=1e-2, atol=1e-2)
    want = get_op("rms_norm").reference(s_out, gamma, eps=1e-5)     # the unfused op on the stored sum
    torch.testing.assert_close(normed, want, rtol=1e-3, atol=1e-3)
    again, _ = gemv_add_rms_norm(x, w, r, gamma, 1e-5, workspace=ws, config=cfg)
    assert torch.equal(again, normed)
    assert all(int(b[-1].sum()) == 0 and int(b[1].sum()) == 0 for b in ws._buffers.values())


def test_gemv_add_rms_norm_names_bad_operands():
    x, w = torch.randn(2, 8, dtype=torch.float16), torch.randn(4, 8, dtype=torch.float16)
    with pytest.raises(GraphDSLError, match=r"gemv_add_rms_norm: residual must be \[2, 4\].*got \[2, 5\]"):
        gemv_add_rms_norm(x, w, torch.randn(2, 5, dtype=torch.float16), torch.ones(4, dtype=torch.float16), 1e-6)
