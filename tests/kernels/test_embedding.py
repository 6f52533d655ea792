"""The embedding lookup kernel (runtime/kernels/embedding.py) against ``torch.nn.functional.embedding``,
and the Triton backend running a graph's ``embedding`` node through it."""
import pytest
import torch

from graphdsl import GraphDSLError, Network, Tensor
from graphdsl import functional as F
from graphdsl.runtime.backends import triton_backend
from graphdsl.runtime.kernels import embedding as K

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows, hidden", [(1, 64), (5, 1000), (37, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_rows_equal_torch(rows, hidden, dtype, id_dtype):
    g = torch.Generator().manual_seed(rows * hidden)
    table = torch.randn(300, hidden, generator=g).to(dtype).to(DEV)
    ids = torch.randint(0, 300, (rows,), generator=g).to(id_dtype).to(DEV)
    ids[0] = 299                                             # the last row of the table
    got = K.embedding(ids, table)
    assert torch.equal(got, torch.nn.functional.embedding(ids.long(), table))


def test_writes_into_a_strided_slot_and_leaves_the_rest():
    table = torch.randn(50, 96, device=DEV)
    buf = torch.full((3, 128), 7.0, device=DEV)
    out = buf[:, 16:112]                                     # row stride 128, unit column stride
    K.embedding(torch.tensor([4, 0, 49], device=DEV), table, out)
    assert torch.equal(out, table[[4, 0, 49]])
    assert (buf[:, :16] == 7.0).all() and (buf[:, 112:] == 7.0).all()


def test_an_unknown_id_reads_a_row_of_nan():
    table = torch.randn(10, 64, device=DEV)
    got = K.embedding(torch.tensor([3, 10, -1], device=DEV), table)
    assert torch.equal(got[0], table[3])
    assert got[1:].isnan().all()


def test_errors_name_the_operand():
    table = torch.randn(10, 8, device=DEV)
    with pytest.raises(GraphDSLError, match=r"embedding kernel: ids must be a contiguous 1-D int32/int64 tensor, got "
                                            r"\(2, 2\) torch.int64"):
        K.embedding(torch.zeros(2, 2, dtype=torch.int64, device=DEV), table)
    with pytest.raises(GraphDSLError, match=r"out must be \[3, 8\] torch.float32 .*got \(3, 8\) torch.bfloat16"):
        K.embedding(torch.zeros(3, dtype=torch.int64, device=DEV), table,
                    torch.empty(3, 8, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(GraphDSLError, match=r"table must be floating point .*got torch.int32"):
        K.embedding(torch.zeros(3, dtype=torch.int64, device=DEV), table.to(torch.int32))
    assert K.embedding_supported(torch.zeros(3, dtype=torch.int64, device=DEV), table.t()) is not None


def _net():
    with Network("emb") as net:
        ids = Tensor("ids", (6,), torch.int64)
        table = Tensor("table", (40, 128), torch.bfloat16)
        net.mark_output(F.embedding(ids, table) * 2.0, "y")
    return net


def test_the_triton_backend_runs_the_node_through_the_kernel(monkeypatch):
    calls = []
    real = K.embedding

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(K, "embedding", spy)
    ids = torch.tensor([0, 39, 5, 5, 17, 2], device=DEV)
    table = torch.randn(40, 128, device=DEV).to(torch.bfloat16)
    want = _net().build_engine(backend="torch").forward({"ids": ids, "table": table})["y"]
    got = _net().build_engine(backend="triton").forward({"ids": ids, "table": table})["y"]
    assert calls == [torch.Size([6])]
    assert torch.equal(got, want)
    monkeypatch.setattr(triton_backend, "_TRITON_EMBEDDING", False)          # the torch reference instead
    calls.clear()
    assert torch.equal(_net().build_engine(backend="triton").forward({"ids": ids, "table": table})["y"], want)
    assert calls == []
