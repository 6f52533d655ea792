"""runtime/kernels/row_topk.py against torch.topk and the ``index_mask`` op's reference (CPU: Triton's
interpreter; GPU: the kernels), and the Triton backend's ``topk`` and ``index_mask`` lowerings inside a
graph (the MoE routing's top-k and its dense mask)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (see conftest.py)

import pytest  # noqa: E402

from graphdsl.errors import GraphDSLError  # noqa: E402
from graphdsl.runtime.kernels.row_topk import index_mask, row_topk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,k", [((5, 8), 2), ((3, 64), 6), ((2, 3, 160), 8), ((1, 1), 1), ((4, 256), 64)])
def test_row_topk_equals_torch_topk(shape, k, dtype):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    values, indices = row_topk(x, k)
    want = torch.topk(x.float().cpu(), k, dim=-1)
    assert values.dtype == dtype and indices.dtype == torch.int64 and values.shape == (*shape[:-1], k)
    assert torch.equal(values.float().cpu(), want.values)
    assert torch.equal(torch.gather(x.float().cpu(), -1, indices.cpu()), want.values)   # positions of those values


def test_row_topk_orders_nan_inf_and_ties_as_documented():
    """NaN first (as torch), then +inf, numbers, -inf; equal entries lowest position first."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, 3.0, nan, inf, -inf, 3.0, 2.0]], device=DEVICE)
    values, indices = row_topk(x, 8)
    assert indices.tolist() == [[1, 3, 4, 2, 6, 7, 0, 5]]
    assert values[0, :2].isnan().all() and values[0, 2:].tolist() == [inf, 3.0, 3.0, 2.0, 1.0, -inf]
    want = torch.topk(x.cpu(), 3)
    assert want.indices.tolist() == [[1, 3, 4]] and indices[0, :3].tolist() == [1, 3, 4]
    ties = torch.tensor([[0.5, 0.25, 0.5, 0.5, 0.25]], device=DEVICE)
    assert row_topk(ties, 4)[1].tolist() == [[0, 2, 3, 1]]
    lows = torch.full((1, 5), -inf, device=DEVICE)
    assert row_topk(lows, 2)[1].tolist() == [[0, 1]]


def test_row_topk_writes_given_outputs_and_refuses_what_it_cannot_take():
    x = torch.randn(3, 16, device=DEVICE)
    v, i = torch.empty(3, 4, device=DEVICE), torch.empty(3, 4, dtype=torch.int64, device=DEVICE)
    got = row_topk(x, 4, v, i)
    assert got[0] is v and got[1] is i and torch.equal(v.cpu(), torch.topk(x.cpu(), 4).values)
    with pytest.raises(GraphDSLError, match=r"unsupported operands \(k=17 \(1 to 16\)\)"):
        row_topk(x, 17)
    with pytest.raises(GraphDSLError, match=r"unsupported operands \(strides \(1, 3\) \(contiguous rows\)\)"):
        row_topk(x.t().contiguous().t(), 2)
    with pytest.raises(GraphDSLError, match=r"unsupported operands \(rows of 5000 entries \(1 to 4096\)\)"):
        row_topk(torch.zeros(1, 5000, device=DEVICE), 2)
    with pytest.raises(GraphDSLError, match=r"unsupported operands \(dtype torch.int64\)"):
        row_topk(torch.zeros(1, 4, dtype=torch.int64, device=DEVICE), 2)
    with pytest.raises(GraphDSLError, match=r"indices must be a contiguous \[3, 4\] torch.int64 tensor"):
        row_topk(x, 4, v, torch.empty(3, 4, dtype=torch.int32, device=DEVICE))


def test_the_triton_backend_lowers_topk_to_the_kernel(monkeypatch):
    """A graph's ``topk`` (here a routing's: softmax scores, top-2 of 8, a 3-D grouped case and a
    dim that is not the last, which keeps the torch reference) runs the kernel and equals the
    torch backend."""
    from graphdsl import Dim, Network, Tensor
    from graphdsl import functional as F
    from graphdsl.runtime.kernels import row_topk as rt
    calls = []
    real = rt.row_topk
    monkeypatch.setattr(rt, "row_topk", lambda x, k, *a: calls.append((tuple(x.shape), k)) or real(x, k, *a))
    with Network() as net:
        x = Tensor("x", (Dim("n"), 8), torch.float32)
        values, ids = F.topk(F.softmax(x, -1), k=2, dim=-1)
        g_values, g_ids = F.topk(x.reshape(-1, 2, 4), k=3, dim=-1)
        c_values, _ = F.topk(x.reshape(-1, 2, 4), k=1, dim=1)
        for name, t in (("v", values), ("i", ids), ("gv", g_values), ("gi", g_ids), ("cv", c_values)):
            net.mark_output(t, name)
    feed = {"x": torch.randn(5, 8, generator=torch.Generator().manual_seed(3)).to(DEVICE)}
    got = net.build_engine(device=DEVICE, backend="triton").forward(feed)
    want = net.build_engine(device=DEVICE, backend="torch").forward(feed)
    assert calls == [((5, 8), 2), ((5, 2, 4), 3)]
    torch.testing.assert_close(got["v"].cpu(), want["v"].cpu(), rtol=1e-6, atol=0)   # the softmax's last bits
    for name in ("i", "gv", "gi", "cv"):
        assert torch.equal(got[name].cpu(), want[name].cpu()), name


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("shape,size", [((5, 2), 8), ((3, 6), 64), ((2, 3, 4), 160), ((1, 1), 1)])
def test_index_mask_equals_the_reference(shape, size, dtype):
    from graphdsl.opdef import get_op
    g = torch.Generator().manual_seed(size)
    rows = int(torch.tensor(shape[:-1]).prod())
    ids = torch.stack([torch.randperm(size, generator=g)[:shape[-1]] for _ in range(rows)]).reshape(shape)
    ids = ids.to(dtype).to(DEVICE)
    got = index_mask(ids, size)
    assert got.dtype == torch.bool and got.shape == (*shape[:-1], size)
    assert torch.equal(got.cpu(), get_op("index_mask").reference(ids.cpu(), size=size))


def test_index_mask_marks_repeats_once_and_refuses_what_it_cannot_take():
    ids = torch.tensor([[3, 3, 0], [7, 1, 7]], device=DEVICE)
    out = torch.ones(2, 8, dtype=torch.bool, device=DEVICE)
    assert index_mask(ids, 8, out) is out
    assert out.cpu().nonzero().tolist() == [[0, 0], [0, 3], [1, 1], [1, 7]]
    with pytest.raises(GraphDSLError, match=r"unsupported operands \(ids torch.float32 \[2, 3\]"):
        index_mask(ids.float(), 8)
    with pytest.raises(GraphDSLError, match=r"unsupported operands \(3 indices a row into 5000"):
        index_mask(ids, 5000)
    with pytest.raises(GraphDSLError, match=r"out must be a contiguous \[2, 8\] torch.bool tensor"):
        index_mask(ids, 8, torch.empty(2, 8, dtype=torch.int8, device=DEVICE))


def test_the_triton_backend_lowers_a_routing_mask_to_the_kernel(monkeypatch):
    """A routing's ``index_mask`` (top-2 of 8 scores, then the chosen scores kept) runs one kernel
    launch and equals the torch backend."""
    from graphdsl import Dim, Network, Tensor
    from graphdsl import functional as F
    from graphdsl.runtime.kernels import row_topk as rt
    calls = []
    real = rt.index_mask
    monkeypatch.setattr(rt, "index_mask", lambda ids, size, *a: calls.append((tuple(ids.shape), size)) or
                        real(ids, size, *a))
    with Network() as net:
        x = Tensor("x", (Dim("n"), 8), torch.float32)
        scores = F.softmax(x, -1)
        _, ids = F.topk(scores, k=2, dim=-1)
        net.mark_output(F.where(F.index_mask(ids, 8), scores, scores * 0.0), "w")
    feed = {"x": torch.randn(5, 8, generator=torch.Generator().manual_seed(4)).to(DEVICE)}
    got = net.build_engine(device=DEVICE, backend="triton").forward(feed)
    want = net.build_engine(device=DEVICE, backend="torch").forward(feed)
    assert calls == [((5, 2), 8)]
    torch.testing.assert_close(got["w"].cpu(), want["w"].cpu(), rtol=1e-6, atol=0)
