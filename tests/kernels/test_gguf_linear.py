"""runtime/kernels/gguf_linear.py: GEMV / dequantize / linear on raw GGUF blocks vs the dequantize-then-matmul
reference (gguf-py's numpy dequantize). Under the CPU interpreter here (small shapes), compiled on a GPU.
The kernels read the stored layout (gguf_blocks.to_stored: Q6_K blocks padded to 224 bytes)."""
import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.runtime.gguf_blocks import block_major, dequantize_blocks, from_stored, row_major, to_stored
from graphdsl.runtime.kernels.gguf_tiles import KERNEL_QTYPES as BLOCKS
from graphdsl.runtime.kernels.gguf_tiles import PLANE_QTYPES
from graphdsl.runtime.kernels.gguf_linear import _pick_config, _sb_for, gguf_dequantize, gguf_gemv, gguf_linear
from tests.helpers.gguf_blocks import KERNEL_QTYPES, random_gguf_weight

pytest.importorskip("gguf")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(qtype, n, k, seed=0):
    data, ref = random_gguf_weight(qtype, n, k, seed=seed)
    return to_stored(data, qtype).to(DEV), ref.to(DEV)


def _x(m, k, dtype, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def _close(out, x, ref, dtype):
    want = x.float() @ ref.T
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
def test_dequantize_kernel_is_exact(qtype):
    data, ref = _weight(qtype, 19, 512, seed=1)
    torch.testing.assert_close(gguf_dequantize(data, qtype, torch.float32), ref, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_blocks(from_stored(data, qtype), qtype, 512), ref, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
def test_dequantize_in_k_order_and_at_tile_offsets_give_the_same_bits(qtype, monkeypatch):
    """The dequantize kernel storing K order contiguously (the default: Q4_K / Q6_K a 32-value plane
    at a time, the others their tile permuted in registers) or each tile at its K offsets
    (``_DEQUANT_K_ORDER`` off): the same bits, row-major and block-major."""
    import graphdsl.runtime.kernels.gguf_linear as gl
    data, ref = _weight(qtype, 19, 512, seed=3)
    for blocks in (data, block_major(data, qtype)):
        got = {}
        for planes in (True, False):
            monkeypatch.setattr(gl, "_DEQUANT_K_ORDER", planes)
            got[planes] = gguf_dequantize(blocks, qtype, torch.float32)
        assert torch.equal(got[True], ref) and torch.equal(got[False], ref)


@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
@pytest.mark.parametrize("m,split", [(1, 1), (1, 2), (5, 1), (5, 2)])
def test_gemv_matches_dequantize_then_matmul(qtype, m, split):
    """Odd N (19, a partial row tile), one and several activation rows, with and without split-K."""
    data, ref = _weight(qtype, 19, 512, seed=2)
    x = _x(m, 512, torch.float32, seed=m)
    cfg = dict(SB=_sb_for(512 // BLOCKS[qtype][0], 4), BLOCK_N=16, SPLIT_K=split, num_warps=4, num_stages=1)
    out = gguf_gemv(x, data, qtype, config=cfg)
    assert out.shape == (m, 19) and out.dtype == torch.float32
    _close(out, x, ref, torch.float32)


@pytest.mark.parametrize("qtype", PLANE_QTYPES)
@pytest.mark.parametrize("m,split", [(2, 1), (17, 2), (32, 3), (40, 1), (64, 2)])
def test_several_rows_a_plane_a_dot_match_dequantize_then_matmul(qtype, m, split):
    """The plane types' GEMV of 2..64 rows (``PLANES``: a 32-value plane decoded in K order, one
    ``tl.dot`` with the rows' 32 inputs; Q5_K and Q8_0 up to 32 rows, ``gemv_rows``): odd N, split-K
    (uneven), row-major and block-major blocks (the same sums); the decoded-tile path of the same
    rows agrees to float32 rounding."""
    from graphdsl.runtime.kernels.gguf_linear import gemv_rows
    data, ref = _weight(qtype, 19, 768, seed=5)
    x = _x(m, 768, torch.float32, seed=m)
    cfg = dict(SB=256 // BLOCKS[qtype][0], BLOCK_N=16, SPLIT_K=split, num_warps=4, num_stages=1, PLANES=True)
    assert gemv_rows(qtype) == (64 if qtype in ("Q4_K", "Q6_K") else 32)
    if m > gemv_rows(qtype):
        with pytest.raises(GraphDSLError, match=rf"x needs 1..32 rows for {qtype} \(gemv_rows\), got {m}"):
            gguf_gemv(x, data, qtype, config=cfg)
        return
    out = gguf_gemv(x, data, qtype, config=cfg)
    assert out.shape == (m, 19)
    _close(out, x, ref, torch.float32)
    _same(gguf_gemv(x, block_major(data, qtype), qtype, config=cfg), out)
    if m <= 16:
        _close(gguf_gemv(x, data, qtype, config={**cfg, "PLANES": False}), x, ref, torch.float32)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_several_rows_default_launch_in_bfloat16(qtype):
    """The default launch of 24 bf16 rows takes the plane path and matches the reference."""
    data, ref = _weight(qtype, 40, 512, seed=6)
    x = _x(24, 512, torch.bfloat16, seed=7)
    assert _pick_config(24, 40, 512, qtype, x.device).get("PLANES")
    _close(gguf_gemv(x, data, qtype), x, ref, torch.bfloat16)


@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
@pytest.mark.parametrize("split", [1, 3])
def test_one_row_prefetch_gives_the_same_sums(qtype, split):
    """``PREFETCH`` (each step's code bytes loaded a step ahead) over slices of several steps, one
    of them shorter: the reference's product, and bit for bit the sums of the plain loop."""
    data, ref = _weight(qtype, 19, 2048, seed=5)
    x = _x(1, 2048, torch.float32, seed=6)
    blocks = 2048 // BLOCKS[qtype][0]
    cfg = dict(SB=_sb_for(blocks, max(1, blocks // 16)), BLOCK_N=8, SPLIT_K=split, num_warps=2, num_stages=1)
    plain = gguf_gemv(x, data, qtype, config=cfg)
    ahead = gguf_gemv(x, data, qtype, config={**cfg, "PREFETCH": True})
    _close(ahead, x, ref, torch.float32)
    assert torch.equal(ahead, plain)


@pytest.mark.parametrize("m,split,use_dot", [(1, 3, False), (1, 3, True), (4, 5, True), (4, 1, True)])
def test_gemv_into_a_column_slice_with_the_residual_added(m, split, use_dot):
    """``out=`` a column slice of a wider product (a fused projection's row part) and a residual
    slice as ``add``: the last slice's program adds it and stores; split-K meets in the launch and
    leaves the workspace's counters at zero, so a second launch on it gives the same bits."""
    from graphdsl.runtime.kernels.gemv import GemvWorkspace
    data, ref = _weight("Q4_K", 19, 1024, seed=6)
    x = _x(m, 1024, torch.float32, seed=6 + m)
    wide = torch.full((m, 40), float("nan"), device=DEV)
    res = _x(m, 40, torch.float32, seed=7)
    ws = GemvWorkspace()
    cfg = dict(SB=1, BLOCK_N=8, SPLIT_K=split, num_warps=4, num_stages=1, USE_DOT=use_dot)
    got = gguf_gemv(x, data, "Q4_K", res[:, 10:29], out=wide[:, 10:29], workspace=ws, config=cfg)
    assert got.data_ptr() == wide[:, 10:29].data_ptr()
    _close(wide[:, 10:29] - res[:, 10:29], x, ref, torch.float32)
    assert torch.isnan(wide[:, :10]).all() and torch.isnan(wide[:, 29:]).all()
    first = wide.clone()
    gguf_gemv(x, data, "Q4_K", res[:, 10:29], out=wide[:, 10:29], workspace=ws, config=cfg)
    assert torch.equal(wide[:, 10:29], first[:, 10:29])
    assert all(int(lock.abs().sum()) == 0 for _, lock in ws._buffers.values())
    bias = res[0, :19].contiguous()
    _close(gguf_gemv(x, data, "Q4_K", bias, config=cfg) - bias, x, ref, torch.float32)


def test_one_row_dot_path_matches_row_dot():
    """The tile + tl.dot path forced for one row (benchmarks compare it) gives the same values."""
    data, ref = _weight("Q5_K", 17, 512, seed=5)
    x = _x(1, 512, torch.float32, seed=5)
    cfg = dict(SB=2, BLOCK_N=16, SPLIT_K=1, num_warps=4, num_stages=1)
    _close(gguf_gemv(x, data, "Q5_K", config={**cfg, "USE_DOT": True}), x, ref, torch.float32)
    _close(gguf_gemv(x, data, "Q5_K", config=cfg), x, ref, torch.float32)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_bfloat16_default_launch(qtype, m):
    data, ref = _weight(qtype, 33, 768, seed=3)
    x = _x(m, 768, torch.bfloat16, seed=10 + m)
    out = gguf_gemv(x, data, qtype)
    assert out.dtype == torch.bfloat16
    _close(out, x, ref, torch.bfloat16)


def _same(got, want):
    """The same bits under the interpreter; compiled, within float32 rounding of the largest output
    (test_block_major_blocks_give_the_same_bits)."""
    if DEV == "cpu":
        assert torch.equal(got, want)
    else:
        tol = 2 ** -20 if got.dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
def test_block_major_blocks_give_the_same_bits(qtype):
    """The blocks stored block-major (``gguf_blocks.block_major``, what a CUDA bind stores: block ``b``
    of every row side by side) give the row-major results: the one-row loop (with and without
    prefetch, split-K), the tile + ``tl.dot`` rows, the default launch in bf16, the dequantize kernel
    and ``gguf_linear``'s prefill; ``row_major`` restores the rows. Bit for bit under the interpreter;
    compiled, the register layouts (which follow the addresses' known alignment) may order a sum
    differently, so the GEMVs agree to float32 rounding there."""
    n, k = 19, 1024
    data, ref = _weight(qtype, n, k, seed=8)
    kb = block_major(data, qtype)
    nbytes = BLOCKS[qtype][1]
    assert kb.shape == (k // BLOCKS[qtype][0], n, nbytes) and torch.equal(row_major(kb, qtype), data)
    assert torch.equal(kb[1, 7], data[7, nbytes:2 * nbytes])              # block 1 of row 7
    blocks = k // BLOCKS[qtype][0]
    for m, cfg in [(1, dict(SB=_sb_for(blocks, 2), BLOCK_N=8, SPLIT_K=2, num_warps=2, num_stages=1)),
                   (1, dict(SB=_sb_for(blocks, 2), BLOCK_N=8, SPLIT_K=1, num_warps=2, num_stages=1, PREFETCH=True)),
                   (3, dict(SB=_sb_for(blocks, 4), BLOCK_N=16, SPLIT_K=2, num_warps=4, num_stages=1))]:
        x = _x(m, k, torch.float32, seed=m)
        got = gguf_gemv(x, kb, qtype, config=cfg)
        _same(got, gguf_gemv(x, data, qtype, config=cfg))
        _close(got, x, ref, torch.float32)
    x = _x(1, k, torch.bfloat16, seed=9)
    _same(gguf_gemv(x, kb, qtype), gguf_gemv(x, data, qtype))
    assert torch.equal(gguf_dequantize(kb, qtype, torch.float32), ref)
    x = _x(20, k, torch.float32, seed=10)
    assert torch.equal(gguf_linear(x, kb, qtype), gguf_linear(x, data, qtype))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_K", "Q4_1"])
def test_linear_dispatches_gemv_and_prefill(qtype, monkeypatch):
    """``gguf_linear``: leading dims and bias; the GEMV up to ``gemv_rows`` (16 rows; Q5_K and Q8_0 32,
    a plane a dot), dequantize + matmul beyond."""
    import graphdsl.runtime.kernels.gguf_linear as gl
    data, ref = _weight(qtype, 24, 256, seed=4)
    bias = torch.randn(24).to(DEV)
    most = {"Q8_0": 32, "Q5_K": 32, "Q4_1": 16}[qtype]
    assert gl.gemv_rows(qtype) == most
    calls, real = [], gl.gguf_dequantize
    monkeypatch.setattr(gl, "gguf_dequantize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for shape in [(2, 256), (3, 7, 256), (5, 6, 256), (most + 1, 256)]:
        calls.clear()
        x = _x(int(torch.tensor(shape[:-1]).prod()), 256, torch.float32, seed=len(shape)).reshape(shape)
        out = gguf_linear(x, data, qtype, bias)
        assert out.shape == (*shape[:-1], 24)
        assert bool(calls) == (x.numel() // 256 > most), (shape, calls)
        _close(out.reshape(-1, 24) - bias, x.reshape(-1, 256), ref, torch.float32)


def test_pick_config_splits_small_grids(monkeypatch):
    import graphdsl.runtime.kernels.gguf_linear as g
    monkeypatch.setattr(g, "_num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    c = _pick_config(1, 4096, 4096, "Q4_K", cpu)           # 512 tiles of 8 rows, 8 steps of 2 super-blocks
    assert (c["SB"], c["BLOCK_N"], c["SPLIT_K"], c["num_warps"]) == (2, 8, 2, 2)
    c = _pick_config(1, 14336, 4096, "Q8_0", cpu)          # 1792 tiles >= 4 per SM
    assert (c["SB"], c["SPLIT_K"]) == (16, 1)
    c = _pick_config(4, 4096, 14336, "Q6_K", cpu)            # several rows of a plane type: a plane a dot
    assert (c["SB"], c["BLOCK_N"], c["num_warps"], c.get("PLANES")) == (1, 64, 4, True)
    c = _pick_config(48, 4096, 4096, "Q4_K", cpu)             # beyond 32 rows: 128-row plane tiles
    assert (c["BLOCK_N"], c.get("PLANES")) == (128, True)
    c = _pick_config(4, 4096, 14336, "Q4_0", cpu)            # of the others: the decoded tile
    assert (c["SB"], c["BLOCK_N"], c["num_warps"], c.get("PLANES")) == (8, 32, 4, None)
    assert _sb_for(3, 8) == 1 and _sb_for(56, 8) == 8 and _sb_for(12, 8) == 4


def test_errors_name_the_operand():
    data = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(GraphDSLError, match=r"GGML type 'Q2_K' has no kernel; supported: \['Q4_0'"):
        gguf_gemv(torch.zeros(1, 256), data, "Q2_K")
    with pytest.raises(GraphDSLError, match=r"data must be contiguous uint8 \[N, K / 256 \* 224\] \(Q6_K blocks in the "
                                            r"stored layout, gguf_blocks.to_stored\) or block-major "
                                            r"\[K / 256, N, 224\] \(gguf_blocks.block_major\), got torch.uint8 \[4, 144\]"):
        gguf_gemv(torch.zeros(1, 256), data, "Q6_K")
    with pytest.raises(GraphDSLError, match=r"or block-major \[K / 256, N, 144\].*got torch.uint8 \[1, 4, 224\]"):
        gguf_gemv(torch.zeros(1, 256), torch.zeros(1, 4, 224, dtype=torch.uint8), "Q4_K")
    with pytest.raises(GraphDSLError, match=r"x must be \[M, 256\].*got \[1, 128\]"):
        gguf_gemv(torch.zeros(1, 128), data, "Q4_K")
    with pytest.raises(GraphDSLError, match=r"config takes SB, BLOCK_N, SPLIT_K and optionally \['MMA', 'PLANES', 'PREFETCH'.*"
                                            r"got \['BLOCK_N', 'PREFECTH', 'SB', 'SPLIT_K'\]"):
        gguf_gemv(torch.zeros(1, 256), torch.zeros(4, 144, dtype=torch.uint8), "Q4_K",
                  config=dict(SB=1, BLOCK_N=8, SPLIT_K=1, PREFECTH=True))
    with pytest.raises(GraphDSLError, match=r"x needs 1..64 rows for Q4_K \(gemv_rows\), got 65"):
        gguf_gemv(torch.zeros(65, 256), data, "Q4_K")
    with pytest.raises(GraphDSLError, match=r"x needs 1..16 rows for Q4_0 \(gemv_rows\), got 17"):
        gguf_gemv(torch.zeros(17, 256), torch.zeros(4, 144, dtype=torch.uint8), "Q4_0")
    with pytest.raises(GraphDSLError, match=r"config PLANES=True needs a type in \['Q4_K', 'Q5_K', 'Q6_K', 'Q8_0'\] "
                                            r"and the tl.dot path .*got Q4_0 with USE_DOT=True"):
        gguf_gemv(torch.zeros(2, 256), torch.zeros(4, 144, dtype=torch.uint8), "Q4_0",
                  config=dict(SB=1, BLOCK_N=16, SPLIT_K=1, PLANES=True))
    with pytest.raises(GraphDSLError, match=r"more than 16 rows \(17\) run a plane a dot only: config PLANES=True"):
        gguf_gemv(torch.zeros(17, 256), data[:, :144].contiguous(), "Q4_K", config=dict(SB=1, BLOCK_N=16, SPLIT_K=1))
    with pytest.raises(GraphDSLError, match=r"last dim must be K=256 \(the Q4_K weight's\), got \[2, 3\]"):
        gguf_linear(torch.zeros(2, 3), data, "Q4_K")
