"""runtime/kernels/gguf_mma_q6k.py: the one-row Q6_K GEMV on int8 tensor cores over the stored layout
(224-byte blocks) — its activation planes and its sums against gguf-py's dequantize then a matmul
(CPU interpreter here, compiled on a GPU); and the stored layout itself (gguf_blocks.to_stored)."""
import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.runtime.gguf_blocks import dequantize_blocks, from_stored, stored_row_bytes, to_stored
from graphdsl.runtime.kernels.gemv import GemvWorkspace
from graphdsl.runtime.kernels.gguf_linear import gguf_gemv
import graphdsl.runtime.kernels.gguf_mma_q6k as kernels_q6k
from graphdsl.runtime.kernels.gguf_mma_q6k import gguf_gemv_q6k, pick_q6k_config, q6k_activation_planes
from tests.helpers.gguf_blocks import random_gguf_weight

pytest.importorskip("gguf")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _x(k, dtype, seed):
    return torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def _weight(n, k, seed):
    data, ref = random_gguf_weight("Q6_K", n, k, seed=seed)
    return to_stored(data, "Q6_K").to(DEV), ref


def test_stored_layout_pads_q6k_blocks_and_round_trips():
    """Each 210-byte block gets 14 zero bytes (224, 16-byte aligned); ``from_stored`` gives the file
    rows back; other types are stored as in the file (the same tensor)."""
    data, _ = random_gguf_weight("Q6_K", 3, 512, seed=1)
    stored = to_stored(data, "Q6_K")
    assert stored.shape == (3, 448) and stored_row_bytes("Q6_K", 512) == 448
    blocks = stored.reshape(3, 2, 224)
    assert torch.equal(blocks[:, :, :210], data.reshape(3, 2, 210)) and blocks[:, :, 210:].abs().sum() == 0
    assert torch.equal(from_stored(stored, "Q6_K"), data)
    q4k, _ = random_gguf_weight("Q4_K", 2, 256, seed=1)
    assert to_stored(q4k, "Q4_K") is q4k and from_stored(q4k, "Q4_K") is q4k and stored_row_bytes("Q4_K", 256) == 144
    with pytest.raises(GraphDSLError, match=r"to_stored: data must be uint8 \[rows, a multiple of 210\].*\[3, 224\]"):
        to_stored(stored[:, :224].contiguous(), "Q6_K")
    with pytest.raises(GraphDSLError, match=r"from_stored: data must be uint8 \[rows, a multiple of 224\].*\[3, 420\]"):
        from_stored(data[:, :420], "Q6_K")


def test_planes_hold_each_16_input_sub_block_in_16_bit_fixed_point():
    """Row ``8 p + s`` holds the high (p 0) or low (p 1) byte of the inputs whose sub-block within
    their half is ``s``, zeros elsewhere; ``256 hi + lo`` times the sub-block's ``a_s`` gives x back
    within ``a_s / 2``; an all-zero sub-block gives ``a_s = 0``, no NaN."""
    k = 512
    x = _x(k, torch.bfloat16, seed=2)
    x[0, 16:32] = 0                                      # sub-block 1 of super-block 0
    a, xa = (t.cpu() for t in q6k_activation_planes(x[0]))
    a = a.long()
    c = torch.arange(k)
    own = ((c % 128) // 16)[None, :] == torch.arange(16)[:, None] % 8
    assert (a[~own] == 0).all()
    hi = (a[:8] * own[:8]).sum(0)                        # each column is owned by one row of each byte
    lo = (a[8:] * own[8:]).sum(0)
    assert lo.min() >= -128 and lo.max() <= 127
    xq = 256 * hi + lo
    a_col = xa[c // 16]
    assert ((xq.float() * a_col - x[0].float().cpu()).abs() <= a_col / 2 + 1e-7).all()
    torch.testing.assert_close(xa, x[0].float().cpu().reshape(-1, 16).abs().amax(1) / 32639)
    assert xa[1] == 0 and not torch.isnan(xa).any()


@pytest.mark.parametrize("scale_dot,pair", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [1, 3])
def test_tensor_core_gemv_matches_dequantize_then_matmul(dtype, split, scale_dot, pair, monkeypatch):
    """Odd N (a partial row tile), K of 4 super-blocks split unevenly (3 asked: slices of 2), a
    float32 output to see the sums' own precision: within 1e-4 of the largest output; the scales and
    ``d`` read through the selector dots (the default) or by plain loads; one accumulator row a
    sub-block (``_PAIR``, the default) or sixteen."""
    monkeypatch.setattr(kernels_q6k, "_SCALE_DOT", scale_dot)
    monkeypatch.setattr(kernels_q6k, "_PAIR", pair)
    data, ref = _weight(19, 1024, seed=3)
    x = _x(1024, dtype, seed=4)
    out = torch.empty(1, 19, dtype=torch.float32, device=DEV)
    gguf_gemv_q6k(x, data, None, out, None, dict(BLOCK_N=16, SPLIT_K=split, num_warps=4, num_stages=2), 4)
    want = x.float().cpu() @ ref.T
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_extreme_codes_and_inputs_stay_exact():
    """Every code at its extreme (``q = 0``: the signed byte -128, ``qh`` and ``ql`` zero) and every
    input at the row's largest magnitude, where the joined int32 sums ``256 V_h + V_l`` are largest:
    still within 1e-4 of the float64 reference."""
    data, _ = random_gguf_weight("Q6_K", 21, 512, seed=40)
    data = data.reshape(21, 2, 210).clone()
    data[:, :, :192] = 0
    data = data.reshape(21, -1)
    ref = dequantize_blocks(data, "Q6_K", 512)
    x = torch.full((1, 512), 5.0, dtype=torch.bfloat16).to(DEV)
    out = torch.empty(1, 21, dtype=torch.float32, device=DEV)
    gguf_gemv_q6k(x, to_stored(data, "Q6_K").to(DEV), None, out, None,
                  dict(BLOCK_N=16, SPLIT_K=1, num_warps=4, num_stages=2), 4)
    want = x.double().cpu() @ ref.double().T
    torch.testing.assert_close(out.cpu().double(), want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_into_a_column_slice_with_the_residual_and_counters_left_at_zero():
    """``gguf_gemv`` with ``MMA=True`` on Q6_K writes a column slice of a wider product with the
    residual slice added, leaves the other columns alone and the split-K counters at zero (a second
    launch gives the same bits)."""
    data, ref = _weight(19, 1024, seed=5)
    x = _x(1024, torch.bfloat16, seed=6)
    res = _x(40, torch.bfloat16, seed=7)
    wide = torch.full((1, 40), float("nan"), dtype=torch.bfloat16, device=DEV)
    ws = GemvWorkspace()
    cfg = dict(MMA=True, BLOCK_N=16, SPLIT_K=4)
    got = gguf_gemv(x, data, "Q6_K", res[:, 10:29], out=wide[:, 10:29], workspace=ws, config=cfg)
    assert got.data_ptr() == wide[:, 10:29].data_ptr()
    assert torch.isnan(wide[:, :10].float()).all() and torch.isnan(wide[:, 29:].float()).all()
    want = x.float().cpu() @ ref.T + res[:, 10:29].float().cpu()
    torch.testing.assert_close(wide[:, 10:29].float().cpu(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    first = wide.clone()
    gguf_gemv(x, data, "Q6_K", res[:, 10:29], out=wide[:, 10:29], workspace=ws, config=cfg)
    assert torch.equal(wide[:, 10:29], first[:, 10:29])
    assert all(int(bufs[1].abs().sum()) == 0 for key, bufs in ws._buffers.items() if "planes" not in key[0])


def test_default_path_by_weight_rows(monkeypatch):
    """One bf16 row of Q6_K takes the tensor cores by default from ``MMA_MIN_ROWS`` weight rows on
    (the bits of the explicit tensor-core call), the CUDA-core loop below it or with ``_Q6K_MMA``
    off (the bits of its explicit config); fp32 rows never take them."""
    import graphdsl.runtime.kernels.gguf_linear as kernels
    calls = []
    real = kernels.gguf_gemv_q6k
    monkeypatch.setattr(kernels, "gguf_gemv_q6k", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    data, _ = _weight(19, 512, seed=8)
    x = _x(512, torch.bfloat16, seed=9)
    mma = gguf_gemv(x, data, "Q6_K", config=dict(MMA=True, **pick_q6k_config(19, 512, kernels._num_sms(x.device))))
    cuda_core = gguf_gemv(x, data, "Q6_K", config=kernels._pick_config(1, 19, 512, "Q6_K", x.device))
    assert len(calls) == 1
    assert not kernels.mma_eligible(x, data, "Q6_K") and torch.equal(gguf_gemv(x, data, "Q6_K"), cuda_core)
    assert len(calls) == 1
    monkeypatch.setattr(kernels, "MMA_MIN_ROWS", 19)
    assert kernels.mma_eligible(x, data, "Q6_K") and torch.equal(gguf_gemv(x, data, "Q6_K"), mma)
    assert len(calls) == 2
    assert not kernels.mma_eligible(x.float(), data, "Q6_K")
    monkeypatch.setattr(kernels, "_Q6K_MMA", False)
    assert not kernels.mma_eligible(x, data, "Q6_K") and torch.equal(gguf_gemv(x, data, "Q6_K"), cuda_core)
    assert len(calls) == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_gives_nan_not_a_finite_sum(bad):
    data, _ = _weight(19, 512, seed=10)
    x = _x(512, torch.bfloat16, seed=11)
    x[0, 300] = bad
    out = gguf_gemv(x, data, "Q6_K", config=dict(MMA=True, BLOCK_N=16, SPLIT_K=2))
    assert torch.isnan(out.float()).all()


def test_pick_q6k_config_from_the_sweep():
    """About two programs per SM, slices of at least two super-blocks, 2 stages (H100 sweep: qkv 4,
    gate 2, down 8 slices; o 8 as the Q4_K GEMV's)."""
    cfgs = {name: pick_q6k_config(n, k, 132) for name, (n, k) in {
        "o": (4096, 4096), "qkv": (6144, 4096), "gate": (14336, 4096), "down": (4096, 14336)}.items()}
    assert {name: c["SPLIT_K"] for name, c in cfgs.items()} == {"o": 8, "qkv": 4, "gate": 2, "down": 8}
    assert all(c["num_stages"] == 2 and c["BLOCK_N"] == 64 for c in cfgs.values())


def test_errors_name_what_is_wrong():
    data, _ = _weight(8, 256, seed=12)
    x = _x(256, torch.bfloat16, seed=13)
    with pytest.raises(GraphDSLError, match=r"silu_mul runs on the tensor-core paths only: 1\.\.32 fp16/bf16 rows "
                                            r"of \['Q4_K', 'Q5_K', 'Q8_0'\].*Q6_K \[8, 256\]"):
        gguf_gemv(x, data, "Q6_K", silu_mul=True)
    planes = GemvWorkspace().planes(x.device, 256)
    with pytest.raises(GraphDSLError, match=r"planes for Q6_K are 2 buffers \(its tensor-core GEMV's activation "
                                            r"operand\), got 3"):
        gguf_gemv(x, data, "Q6_K", config=dict(MMA=True, BLOCK_N=16, SPLIT_K=1), planes=planes)
    with pytest.raises(GraphDSLError, match=r"MMA=True needs one fp16/bf16 row, a type in \['Q4_K', 'Q6_K'\].*"
                                            r"got 1 torch.float32 rows of Q6_K"):
        gguf_gemv(x.float(), data, "Q6_K", config=dict(MMA=True, BLOCK_N=16, SPLIT_K=1))


@pytest.mark.parametrize("split", [1, 3])
def test_q4k_swiglu_epilogue_writes_the_q6k_planes_of_its_output(split):
    """A Q4_K gate/up GEMV's SwiGLU epilogue given two buffers writes its output's A operand in this
    kernel's format — bit for bit what ``q6k_activation_planes`` makes of the stored row, a zero
    sub-block included — and a Q6_K GEMV reading them gives the bits of its own planes launch."""
    data, _ = random_gguf_weight("Q4_K", 2 * 512, 1024, seed=14)
    data = data.to(DEV)
    data[512 + 64:512 + 96] = 0                           # up rows of outputs 64..95: sub-blocks 4, 5 all zero
    x = _x(1024, torch.bfloat16, seed=15)
    cfg = dict(MMA=True, BLOCK_N=64, SPLIT_K=split)
    planes = GemvWorkspace().q6k_planes(x.device, 512)
    for t in planes:
        t.fill_(3)
    got = gguf_gemv(x, data, "Q4_K", silu_mul=True, config=cfg, planes_out=planes)
    assert torch.equal(got, gguf_gemv(x, data, "Q4_K", silu_mul=True, config=cfg))
    for mine, want in zip(planes, q6k_activation_planes(got[0])):
        assert torch.equal(mine, want)
    assert planes[1][4] == 0 and planes[1][5] == 0 and not torch.isnan(planes[1]).any()
    down, _ = _weight(64, 512, seed=16)
    q6 = dict(MMA=True, BLOCK_N=16, SPLIT_K=2)
    assert torch.equal(gguf_gemv(got, down, "Q6_K", config=q6, planes=planes), gguf_gemv(got, down, "Q6_K", config=q6))
    with pytest.raises(GraphDSLError, match=r"planes for Q6_K are 2 buffers .*got 3"):
        gguf_gemv(got, down, "Q6_K", config=q6, planes=GemvWorkspace().planes(x.device, 512))
    with pytest.raises(GraphDSLError, match=r"planes_out is written by a Q4_K SwiGLU GEMV's epilogue"):
        gguf_gemv(got, down, "Q6_K", config=q6, planes_out=planes)


def test_backend_hands_a_q6k_down_the_planes_of_the_swiglu_epilogue(monkeypatch):
    """gate|up in Q4_K (SwiGLU in its tensor-core epilogue) then down in Q6_K, one row, through the
    Triton backend (``MMA_MIN_ROWS`` lowered to the test's shapes): the epilogue writes down's A
    operand, so the Q6_K GEMV launches no planes kernel; the output is the same bits as with the
    launch, and agrees with the torch backend."""
    import graphdsl.runtime  # noqa: F401 - registers the gguf-* schemes
    import graphdsl.runtime.kernels.gguf_linear as kernels
    import graphdsl.runtime.kernels.gguf_mma_q6k as q6k
    from graphdsl import Network, Parameter, Tensor
    from graphdsl import functional as F
    from graphdsl.quant import parse_scheme
    from graphdsl.runtime.backends import triton_backend
    monkeypatch.setattr(kernels, "MMA_MIN_ROWS", 1)
    n, k = 256, 256
    with Network("mlp") as net:
        x = Tensor("x", (1, k), torch.bfloat16)
        gu = Parameter((2 * n, k), torch.bfloat16, name="gate_up.weight").quantize(parse_scheme("gguf-q4_k"))
        down = Parameter((k, n), torch.bfloat16, name="down.weight").quantize(parse_scheme("gguf-q6_k"))
        g, u = F.split(F.linear(x, gu, None, transpose_b=True), 2, dim=-1)
        net.mark_output(F.linear(F.silu(g) * u, down, None, transpose_b=True), "y")
    gen = torch.Generator().manual_seed(17)
    feed = {"x": torch.randn(1, k, generator=gen).to(DEV, torch.bfloat16),
            **{c.name: t.to(DEV) for p in (gu, down)
               for c, t in zip(p.companions(), p.quant.quantize(0.1 * torch.randn(*p.shape, generator=gen)))}}
    engine = net.build_engine(device=DEV, backend="triton")
    assert [nd.op for nd in engine.net.nodes] == ["quant_linear_silu_mul", "quant_linear"]
    launches = []
    real = q6k.q6k_activation_planes
    monkeypatch.setattr(q6k, "q6k_activation_planes", lambda *a: launches.append(1) or real(*a))
    got = {}
    for on, want in ((True, 0), (False, 1)):
        monkeypatch.setattr(triton_backend, "_SWIGLU_PLANES_Q6K", on)
        launches.clear()
        got[on] = engine.forward(feed)["y"].clone()
        assert len(launches) == want, on
    assert torch.equal(got[True], got[False])
    ref = net.build_engine(device=DEV, backend="torch").forward(feed)["y"].float()
    torch.testing.assert_close(got[True].float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


@pytest.mark.parametrize("split", [1, 3])
def test_block_major_blocks_give_the_same_bits(split):
    """Stored Q6_K blocks block-major (``gguf_blocks.block_major``: what a CUDA bind stores) through
    the tensor-core GEMV: the same bits as the stored rows, with a residual, over a partial row tile."""
    from graphdsl.runtime.gguf_blocks import block_major
    data, ref = _weight(83, 1024, seed=17)
    kb = block_major(data, "Q6_K")
    x = _x(1024, torch.bfloat16, seed=18)
    res = _x(83, torch.bfloat16, seed=19)
    cfg = dict(MMA=True, BLOCK_N=16, SPLIT_K=split)
    got = gguf_gemv(x, kb, "Q6_K", res, config=cfg)
    assert torch.equal(got, gguf_gemv(x, data, "Q6_K", res, config=cfg))
    want = x.float().cpu() @ ref.T + res.float().cpu()
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
