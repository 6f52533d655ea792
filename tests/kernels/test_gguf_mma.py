"""runtime/kernels/gguf_mma.py: the one-row Q4_K GEMV on int8 tensor cores — its activation planes
and its sums against the dequantize-then-matmul reference (CPU interpreter here, compiled on a GPU)."""
import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.runtime.gguf_blocks import dequantize_blocks
from graphdsl.runtime.kernels.gemv import GemvWorkspace
from graphdsl.runtime.kernels.gguf_linear import gguf_gemv
from graphdsl.runtime.kernels.gguf_mma import activation_planes, gguf_gemv_mma, pick_mma_config
from tests.helpers.gguf_blocks import random_gguf_weight

pytest.importorskip("gguf")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _x(k, dtype, seed):
    return torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def _planes_math(k):
    """Per column ``c`` of the A operand: its input index and sub-block (module docstring's layout)."""
    c = torch.arange(k)
    b, j = c // 256, c % 128
    sub = 2 * (j // 32) + (c % 256) // 128
    return 256 * b + 32 * sub + j % 32, 8 * b + sub


def test_activation_planes_hold_each_sub_block_in_16_bit_fixed_point():
    """Row ``8 p + s`` holds sub-block ``s``'s high (p 0) or low (p 1) bytes and zeros elsewhere;
    ``256 h + l`` times ``a_s`` gives x back within ``a_s / 2``; ``S_s = a_s sum xq``; an all-zero
    sub-block gives ``a_s = 0`` and zeros, no NaN."""
    k = 512
    x = _x(k, torch.bfloat16, seed=1)
    x[0, 32:64] = 0                                      # sub-block 1 of super-block 0
    a, xa, xs = activation_planes(x[0])
    a, xa, xs = a.cpu().long(), xa.cpu(), xs.cpu()
    idx, sub = _planes_math(k)
    rows = torch.arange(16)[:, None]
    own = (sub % 8)[None, :] == rows % 8
    assert (a[~own] == 0).all()
    h = a[:8][own[:8]].reshape(-1)
    lo = a[8:][own[8:]].reshape(-1)
    xq = torch.zeros(k, dtype=torch.long)
    cols = torch.arange(k)[own[:8].nonzero()[:, 1]]      # column order of h (row-major over rows 0..7)
    xq[cols] = 256 * h + lo
    assert lo.min() >= -128 and lo.max() <= 127
    want = x[0].float().cpu()[idx]
    got = xq.float() * xa[sub]
    assert ((got - want).abs() <= xa[sub] / 2 + 1e-7).all()
    torch.testing.assert_close(xa, x[0].float().cpu().reshape(-1, 32).abs().amax(1) / 32639)
    sums = torch.zeros(k // 32).index_add_(0, sub, xq.float())
    torch.testing.assert_close(xs, xa * sums)
    assert xa[1] == 0 and xs[1] == 0 and not torch.isnan(xs).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [1, 3])
def test_tensor_core_gemv_matches_dequantize_then_matmul(dtype, split):
    """Odd N (a partial row tile), K of 4 super-blocks split unevenly (3 asked: slices of 2), a
    float32 output to see the sums' own precision: within 1e-4 of the largest output (bf16 outputs
    round at 4e-3)."""
    data, ref = random_gguf_weight("Q4_K", 19, 1024, seed=2)
    x = _x(1024, dtype, seed=3)
    out = torch.empty(1, 19, dtype=torch.float32, device=DEV)
    gguf_gemv_mma(x, data.to(DEV), "Q4_K", None, out, None, dict(BLOCK_N=16, SPLIT_K=split, num_warps=4,
                                                                 num_stages=2), 4)
    want = x.float().cpu() @ ref.T
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_one_q4k_row_on_the_tensor_cores_into_a_column_slice_with_the_residual():
    """``gguf_gemv`` with ``MMA=True`` writes a column slice of a wider product with the residual
    slice added and leaves the split-K counters at zero (a second launch gives the same bits)."""
    data, ref = random_gguf_weight("Q4_K", 19, 1024, seed=6)
    data = data.to(DEV)
    x = _x(1024, torch.bfloat16, seed=7)
    res = _x(40, torch.bfloat16, seed=8)
    wide = torch.full((1, 40), float("nan"), dtype=torch.bfloat16, device=DEV)
    ws = GemvWorkspace()
    got = gguf_gemv(x, data, "Q4_K", res[:, 10:29], out=wide[:, 10:29], workspace=ws,
                    config=dict(MMA=True, BLOCK_N=16, SPLIT_K=4))
    assert got.data_ptr() == wide[:, 10:29].data_ptr()
    assert torch.isnan(wide[:, :10].float()).all() and torch.isnan(wide[:, 29:].float()).all()
    want = x.float().cpu() @ ref.T + res[:, 10:29].float().cpu()
    torch.testing.assert_close(wide[:, 10:29].float().cpu(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    first = wide.clone()
    gguf_gemv(x, data, "Q4_K", res[:, 10:29], out=wide[:, 10:29], workspace=ws,
              config=dict(MMA=True, BLOCK_N=16, SPLIT_K=4))
    assert torch.equal(wide[:, 10:29], first[:, 10:29])
    assert all(int(bufs[1].abs().sum()) == 0 for key, bufs in ws._buffers.items() if key[0] != "planes")


def test_default_path_by_weight_rows(monkeypatch):
    """One bf16 row of Q4_K takes the tensor cores by default from ``MMA_MIN_ROWS`` weight rows on
    (the same bits as the explicit tensor-core call), the CUDA-core launch below it (the same bits
    as its explicit config); fp32 rows never take them."""
    import graphdsl.runtime.kernels.gguf_linear as kernels
    data, _ = random_gguf_weight("Q4_K", 19, 1024, seed=6)
    data = data.to(DEV)
    x = _x(1024, torch.bfloat16, seed=9)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 4
    mma = torch.empty(1, 19, dtype=torch.bfloat16, device=DEV)
    gguf_gemv_mma(x, data, "Q4_K", None, mma, None, None, sms)
    cuda_core = gguf_gemv(x, data, "Q4_K", config=kernels._pick_config(1, 19, 1024, "Q4_K", x.device))
    assert not kernels.mma_eligible(x, data, "Q4_K") and torch.equal(gguf_gemv(x, data, "Q4_K"), cuda_core)
    monkeypatch.setattr(kernels, "MMA_MIN_ROWS", 19)
    assert kernels.mma_eligible(x, data, "Q4_K") and torch.equal(gguf_gemv(x, data, "Q4_K"), mma)
    assert not kernels.mma_eligible(x.float(), data, "Q4_K")
    assert not torch.equal(mma, cuda_core)              # the two paths are told apart by their bits here


def test_swiglu_epilogue_matches_silu_of_the_two_halves():
    """``silu_mul=True`` over a packed ``[gate | up]`` (2 x 37 rows: partial tiles, split K): the
    gate and up sums rounded to bf16, silu rounded, times up — the unfused GEMV + ``silu_mul``, to
    two bf16 units in the last place (the CPU interpreter's float32 -> bf16 casts truncate)."""
    data, ref = random_gguf_weight("Q4_K", 74, 1024, seed=11)
    data = data.to(DEV)
    x = _x(1024, torch.bfloat16, seed=12)
    got = gguf_gemv(x, data, "Q4_K", silu_mul=True, config=dict(MMA=True, BLOCK_N=16, SPLIT_K=3))
    assert got.shape == (1, 37) and got.dtype == torch.bfloat16
    full = gguf_gemv(x, data, "Q4_K", config=dict(MMA=True, BLOCK_N=16, SPLIT_K=3)).float()
    gate, up = full[:, :37], full[:, 37:]
    want = (torch.nn.functional.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=0)
    exact = x.float().cpu() @ ref.T
    ref_y = torch.nn.functional.silu(exact[:, :37]) * exact[:, 37:]
    torch.testing.assert_close(got.float().cpu(), ref_y, rtol=2e-2, atol=2e-2 * ref_y.abs().max().item())


@pytest.mark.parametrize("split", [1, 3])
def test_swiglu_epilogue_writes_the_planes_of_its_output(split):
    """``planes_out``: each tile's epilogue (32 outputs, one sub-block) also writes the output row's
    A operand — bit for bit what ``activation_planes`` makes of the stored row — and the output is
    the same as without; a zero sub-block gives zeros, no NaN."""
    from graphdsl.runtime.kernels.gguf_mma import swiglu_planes_possible
    data, _ = random_gguf_weight("Q4_K", 2 * 512, 1024, seed=13)
    data = data.to(DEV)
    data[512 + 64:512 + 96] = 0                           # up rows of outputs 64..95: sub-block 2 all zero
    x = _x(1024, torch.bfloat16, seed=14)
    cfg = dict(MMA=True, BLOCK_N=64, SPLIT_K=split)
    planes = GemvWorkspace().planes(x.device, 512)
    for t in planes:
        t.fill_(3)
    got = gguf_gemv(x, data, "Q4_K", silu_mul=True, config=cfg, planes_out=planes)
    assert torch.equal(got, gguf_gemv(x, data, "Q4_K", silu_mul=True, config=cfg))
    for mine, want in zip(planes, activation_planes(got[0])):
        assert torch.equal(mine, want)
    assert planes[1][2] == 0 and planes[2][2] == 0 and not torch.isnan(planes[1]).any()
    assert swiglu_planes_possible(512) and not swiglu_planes_possible(512, 32) and not swiglu_planes_possible(96)
    with pytest.raises(GraphDSLError, match=r"planes_out needs silu_mul with BLOCK_N 64.*BLOCK_N 16"):
        gguf_gemv(x, data, "Q4_K", silu_mul=True, config=dict(MMA=True, BLOCK_N=16, SPLIT_K=1), planes_out=planes)
    with pytest.raises(GraphDSLError, match=r"planes_out needs silu_mul.*silu_mul=False"):
        gguf_gemv(x, data, "Q4_K", config=cfg, planes_out=planes)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_gives_nan_not_a_finite_sum(bad):
    """The fixed-point planes cannot hold a NaN or an infinity: the sub-block's ``a_s`` becomes NaN,
    so every output is NaN rather than a silently finite number."""
    data, _ = random_gguf_weight("Q4_K", 19, 512, seed=4)
    x = _x(512, torch.bfloat16, seed=5)
    x[0, 300] = bad
    out = gguf_gemv(x, data.to(DEV), "Q4_K", config=dict(MMA=True, BLOCK_N=16, SPLIT_K=2))
    assert torch.isnan(out.float()).all()


def test_pick_mma_config_from_the_sweep():
    """About two programs per SM, slices of at least one super-block (H100 sweep: qkv 4, gate 2, down
    8 slices of 64-row tiles; the o's 8 slices of 2, and the 1B o's 8 slices of 1, from in-model A/Bs
    on an H200)."""
    splits = {name: pick_mma_config(n, k, 132)["SPLIT_K"]
              for name, (n, k) in {"o": (4096, 4096), "qkv": (6144, 4096), "gate": (14336, 4096),
                                   "down": (4096, 14336), "1b.down": (2048, 8192), "1b.o": (2048, 2048)}.items()}
    assert splits == {"o": 8, "qkv": 4, "gate": 2, "down": 8, "1b.down": 16, "1b.o": 8}
    assert pick_mma_config(64, 1024, 132)["SPLIT_K"] == 4         # slices of one super-block


def test_mma_config_errors_name_what_is_wrong():
    data, _ = random_gguf_weight("Q4_K", 8, 256, seed=1)
    data = data.to(DEV)
    with pytest.raises(GraphDSLError, match=r"silu_mul runs on the tensor-core paths only.*add=True"):
        gguf_gemv(_x(256, torch.bfloat16, seed=1), data, "Q4_K", torch.zeros(4, device=DEV), silu_mul=True)
    with pytest.raises(GraphDSLError, match=r"silu_mul runs on the tensor-core paths only.*got 1 torch.float32 rows"):
        gguf_gemv(_x(256, torch.float32, seed=1), data, "Q4_K", silu_mul=True)
    with pytest.raises(GraphDSLError, match=r"MMA=True needs one fp16/bf16 row.*got 1 torch.float32 rows of Q4_K"):
        gguf_gemv(_x(256, torch.float32, seed=1), data, "Q4_K", config=dict(MMA=True, BLOCK_N=16, SPLIT_K=1))
    with pytest.raises(GraphDSLError, match=r"config with MMA=True takes BLOCK_N, SPLIT_K.*got \['BLOCK_N', 'SB'"):
        gguf_gemv(_x(256, torch.bfloat16, seed=1), data, "Q4_K", config=dict(MMA=True, BLOCK_N=16, SB=1))


@pytest.mark.parametrize("k", [512, 768])
def test_norm_planes_is_add_rms_norm_and_the_planes_of_its_output(k):
    """``norm_planes``: the sum and the normed row as ``add_rms_norm`` gives them (exactly on a GPU, the
    normed row within a bf16 unit where its mean's summation order differs; within a few units
    on the CPU interpreter, whose casts truncate), and the A operand of that normed row, bit for bit."""
    from graphdsl.opdef import get_op
    from graphdsl.runtime.kernels.gguf_mma import norm_planes
    x, res = _x(k, torch.bfloat16, seed=20), _x(k, torch.bfloat16, seed=21)
    w = (1 + 0.2 * _x(k, torch.float32, seed=22)).to(torch.bfloat16)[0]
    out, s = torch.empty_like(x), torch.empty_like(x)
    planes = norm_planes(x, res, w, 1e-5, out, s, GemvWorkspace().planes(x.device, k))
    want_out, want_s = get_op("add_rms_norm").reference(x, res, w, eps=1e-5)
    torch.testing.assert_close(s.float(), want_s.float(), rtol=0 if DEV == "cuda" else 2 ** -7, atol=0)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2 ** -7 if DEV == "cuda" else 2 ** -5, atol=0)
    for got, want in zip(planes, activation_planes(out[0])):
        assert torch.equal(got, want)


def test_gguf_q4k_model_takes_the_planes_from_its_norms(tmp_path, monkeypatch):
    """A Q4_K model scoring one row on the tensor-core path (``MMA_MIN_ROWS`` lowered for the tiny
    shapes): the ``add_rms_norm`` before qkv and gate/up also makes their A operand (3 of the 8
    activation launches of 2 layers go: layer 0's qkv reads a plain RMSNorm, o and down the
    attention and SwiGLU outputs), and so does the gate/up GEMV's SwiGLU epilogue before
    down (2 more go); the logits stay those of the separate launches. Steps run eagerly: a CUDA
    graph's warm-up and capture would run the launches twice and its replays not at all. The norms
    are launched here, not carried by the GEMVs (``test_gguf_norm_carry.py`` carries them)."""
    import graphdsl as gd
    import graphdsl.runtime.kernels.gguf_linear as kernels
    import graphdsl.runtime.kernels.gguf_mma as mma
    from graphdsl.runtime.backends import norm_carry, triton_backend
    from tests.models.hf_tiny import make_checkpoint
    monkeypatch.setattr(kernels, "MMA_MIN_ROWS", 1)
    monkeypatch.setattr(norm_carry, "KINDS", ("int4", "float"))
    launches = []
    real = mma.activation_planes
    monkeypatch.setattr(mma, "activation_planes", lambda *a: launches.append(1) or real(*a))
    make_checkpoint("llama", tmp_path, hidden_size=256, intermediate_size=512)
    llm = gd.LLM(tmp_path, device=DEV, dtype="bfloat16", max_model_len=64, quantization="gguf-q4_k")
    llm.model.configure_runtime(backend="triton", cuda_graphs=False, max_blocks_per_seq=4)
    got = {}
    for norm, swiglu, want in ((True, True, 3), (True, False, 5), (False, True, 6), (False, False, 8)):
        monkeypatch.setattr(triton_backend, "_NORM_PLANES", norm)
        monkeypatch.setattr(triton_backend, "_SWIGLU_PLANES", swiglu)
        launches.clear()
        got[norm, swiglu] = llm.score([7]).float().cpu()
        assert len(launches) == want, (norm, swiglu)
    base = got[False, False]
    for key, logits in got.items():
        torch.testing.assert_close(logits, base, rtol=0, atol=2e-2 * base.abs().max().item(), msg=str(key))


@pytest.mark.parametrize("split", [1, 3])
def test_block_major_blocks_give_the_same_bits(split):
    """Q4_K blocks stored block-major (``gguf_blocks.block_major``: what a CUDA bind stores) through
    the tensor-core GEMV: the same bits as the stored rows with a residual, and in the SwiGLU epilogue
    with its output's planes (the halves' rows are rows ``r`` and ``N + r`` of the one tensor)."""
    from graphdsl.runtime.gguf_blocks import block_major
    data, _ = random_gguf_weight("Q4_K", 2 * 512, 1024, seed=15)
    data = data.to(DEV)
    kb = block_major(data, "Q4_K")
    x = _x(1024, torch.bfloat16, seed=16)
    res = _x(1024, torch.bfloat16, seed=17)
    cfg = dict(MMA=True, BLOCK_N=64, SPLIT_K=split)
    assert torch.equal(gguf_gemv(x, kb, "Q4_K", res, config=cfg), gguf_gemv(x, data, "Q4_K", res, config=cfg))
    planes, planes_kb = GemvWorkspace().planes(x.device, 512), GemvWorkspace().planes(x.device, 512)
    got = gguf_gemv(x, kb, "Q4_K", silu_mul=True, config=cfg, planes_out=planes_kb)
    assert torch.equal(got, gguf_gemv(x, data, "Q4_K", silu_mul=True, config=cfg, planes_out=planes))
    assert all(torch.equal(a, b) for a, b in zip(planes_kb, planes))


@pytest.mark.parametrize("pair", [True, False])
def test_joined_rows_are_exact_at_the_extremes(pair, monkeypatch):
    """``_PAIR`` (each sub-block's high and low byte sums joined as ``256 V_h + V_l`` in int32 before
    the float scales) and the 16-row accumulator both match the reference, also with every code at
    its extreme (``q = 0``: the signed byte -128) and every input at the row's largest magnitude,
    where the int32 sums are largest."""
    import graphdsl.runtime.kernels.gguf_mma as mma
    monkeypatch.setattr(mma, "_PAIR", pair)
    data, _ = random_gguf_weight("Q4_K", 21, 768, seed=30)
    data = data.reshape(21, 3, 144).clone()
    data[:, :, 16:] = 0                                  # every nibble q = 0
    data = data.reshape(21, -1)
    ref = dequantize_blocks(data, "Q4_K", 768)
    for x in (_x(768, torch.bfloat16, seed=31), torch.full((1, 768), -3.0, dtype=torch.bfloat16).to(DEV)):
        out = torch.empty(1, 21, dtype=torch.float32, device=DEV)
        gguf_gemv_mma(x, data.to(DEV), "Q4_K", None, out, None, dict(BLOCK_N=16, SPLIT_K=2, num_warps=4,
                                                                     num_stages=2), 4)
        want = x.double().cpu() @ ref.double().T
        torch.testing.assert_close(out.cpu().double(), want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_headers_a_step_ahead_give_the_same_bits(monkeypatch):
    """``_AHEAD`` (each K step's header words and activation scales loaded a step earlier): the same
    bits as loading them in their own step, over slices of one and of several steps."""
    import graphdsl.runtime.kernels.gguf_mma as mma
    data, ref = random_gguf_weight("Q4_K", 37, 1536, seed=20)
    data = data.to(DEV)
    x = _x(1536, torch.bfloat16, seed=21)
    for split in (1, 2, 6):
        cfg = dict(MMA=True, BLOCK_N=16, SPLIT_K=split)
        monkeypatch.setattr(mma, "_AHEAD", True)
        ahead = gguf_gemv(x, data, "Q4_K", config=cfg)
        monkeypatch.setattr(mma, "_AHEAD", False)
        assert torch.equal(ahead, gguf_gemv(x, data, "Q4_K", config=cfg)), split
    want = x.float().cpu() @ ref.T
    torch.testing.assert_close(ahead.float().cpu(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
