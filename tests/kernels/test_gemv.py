"""Small-M GEMV (split-K, bias/residual epilogue) vs torch (under the CPU interpreter here, compiled on a GPU)."""
import os

import pytest
import torch
import triton
import triton.language as tl

from graphdsl import GraphDSLError
from graphdsl.runtime.kernels.gemv import GemvWorkspace, _pick_config, _to_e4m3, gemv

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m, n, k, add, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    return t(m, k), t(n, k), {None: None, "bias": t(n), "residual": t(m, n)}[add]


def _reference(x, w, add):
    return x.float() @ w.float().T + (0 if add is None else add.float())


@pytest.mark.parametrize("m,n,k,split", [(1, 40, 64, 1), (3, 17, 100, 2), (8, 64, 256, 4), (16, 33, 70, 3),
                                         (1, 40, 256, 4), (1, 17, 320, 10)])   # one row, split: row sums
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
    (part, lock), = ws._buffers.values()
    assert lock.shape == (3,) and int(lock.abs().sum()) == 0
    assert ws.nbytes > 0


@pytest.mark.parametrize("split", [3, 10])
def test_one_row_split_sums_equal_the_row_of_a_batch(split):
    """A one-row split launch stores and sums ``[BLOCK_N]`` row sums instead of padded tiles, in the
    same slice order, so a row's result does not depend on whether other rows ran beside it."""
    x, w, a = _operands(3, 40, 320, "residual", torch.float16, split)
    cfg = dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=split, num_warps=4, num_stages=2)
    alone = gemv(x[:1], w, a[:1], config=cfg)
    assert torch.equal(alone, gemv(x, w, a, config=cfg)[:1])


def test_pick_config_from_the_sweeps(monkeypatch):
    import graphdsl.runtime.kernels.gemv as g
    monkeypatch.setattr(g, "_num_sms", lambda device: 132)             # an H100/H200
    dev = torch.device("cpu")
    pick = lambda n, k: _pick_config(1, n, k, dev)  # noqa: E731
    assert (pick(6144, 4096)["BLOCK_K"], pick(6144, 4096)["SPLIT_K"]) == (128, 1)   # 96 tiles > 66
    assert (pick(4096, 4096)["BLOCK_K"], pick(4096, 4096)["SPLIT_K"]) == (256, 1)   # 64 tiles
    assert (pick(2048, 8192)["SPLIT_K"], pick(2048, 8192)["BLOCK_K"]) == (4, 128)   # 32 tiles, split slices
    assert pick(16384, 2048)["BLOCK_K"] == 64 and pick(128256, 2048)["BLOCK_K"] == 128  # 2 waves / many, short K
    assert pick(2048, 2048)["SPLIT_K"] == 1                                         # 32 tiles, 8 steps
    assert pick(64, 200)["BLOCK_K"] == 128 and pick(64, 48)["BLOCK_K"] == 64        # short K


def test_fp8_one_row_launch_from_the_sweeps(monkeypatch):
    """The fp8 one-row launch on the Llama-3-8B projections (H200 sweep, ``_pick_quant_config``):
    512-input steps only where K is split into slices of at least four of them (qkv)."""
    import graphdsl.runtime.kernels.gemv as g
    monkeypatch.setattr(g, "_num_sms", lambda device: 132)
    pick = lambda n, k: g._pick_quant_config(1, n, k, g.W_FP8, 1, torch.device("cpu"))  # noqa: E731
    launch = lambda n, k: tuple(pick(n, k)[key] for key in ("BLOCK_N", "BLOCK_K", "SPLIT_K"))  # noqa: E731
    assert launch(6144, 4096) == (32, 512, 2)          # qkv
    assert launch(4096, 4096) == (64, 256, 8)          # o: slices of one 512-input step
    assert launch(28672, 4096) == (32, 256, 1)         # gate_up: unsplit
    assert launch(4096, 14336) == (64, 256, 8)         # down: 1792-input slices


def test_int4_one_row_launch_fills_two_programs_a_sm(monkeypatch):
    """The int4 one-row launch splits K into as many slices as keep the grid within two programs a
    SM, any count (not only powers of two), so the SMs get even shares: the Llama-3-8B qkv in 11
    slices (264 programs, where 8 left 72 of 132 SMs one program), the Llama-3.2-1B down in 33
    requested (the launch makes 32 two-step slices of its 64 steps, 256 programs, where 16 gave 128)."""
    import graphdsl.runtime.kernels.gemv as g
    monkeypatch.setattr(g, "_num_sms", lambda device: 132)
    split = lambda n, k: g._pick_quant_config(1, n, k, g.W_INT4, 128, torch.device("cpu"))["SPLIT_K"]  # noqa: E731
    assert [split(6144, 4096), split(4096, 4096), split(28672, 4096), split(4096, 14336)] == [11, 16, 2, 16]
    assert [split(3072, 2048), split(2048, 2048), split(16384, 2048), split(2048, 8192)] == [16, 16, 4, 33]
    assert split(256 * 300, 4096) == 1                 # more tiles than two a SM: unsplit
    assert split(256, 256) == 2                        # never a slice without a 128-input step


def test_gemv_rejects_what_it_cannot_run():
    x = torch.randn(17, 8, dtype=torch.float16)
    with pytest.raises(GraphDSLError, match=r"gemv: needs x \[M<= 16, K\].*got x \[17, 8\]"):
        gemv(x, torch.randn(4, 8, dtype=torch.float16))
    with pytest.raises(GraphDSLError, match=r"add must be a bias \[4\] or a residual \[2, 4\], got \[3\]"):
        gemv(x[:2], torch.randn(4, 8, dtype=torch.float16), torch.randn(3, dtype=torch.float16))
    with pytest.raises(GraphDSLError, match=r"out must be \[2, 4\] torch.float16.*got \[2, 5\]"):
        gemv(x[:2], torch.randn(4, 8, dtype=torch.float16), out=torch.empty(2, 5, dtype=torch.float16))
    with pytest.raises(GraphDSLError, match=r"config takes BLOCK_N.*got \['BLOCK_K', 'BLOCK_N', 'SPLIT_K', 'num_wraps'\]"):
        gemv(x[:2], torch.randn(4, 8, dtype=torch.float16), config=dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=1, num_wraps=4))


@pytest.mark.parametrize("m,cols,k,split", [(1, 40, 64, 1), (3, 17, 100, 3), (16, 24, 256, 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_mul_epilogue_equals_gemv_then_silu_mul(m, cols, k, split, dtype):
    """``silu_mul=True`` reads the packed [gate | up] weight in interleaved tiles and writes
    silu(gate) * up: the same values as the GEMV's product through the silu_mul kernel, and within
    rounding of the float32 reference (split-K: the last program applies the epilogue)."""
    from graphdsl.runtime.codegen.ops import silu_mul
    x, w, _ = _operands(m, 2 * cols, k, None, dtype, m * 100 + cols + k)
    cfg = dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=split, num_warps=4, num_stages=2)
    out = torch.full((m, cols), float("nan"), dtype=dtype, device=DEV)
    gemv(x, w, silu_mul=True, out=out, config=cfg, workspace=GemvWorkspace())
    two_kernels = silu_mul(gemv(x, w, config=cfg, workspace=GemvWorkspace()))
    torch.testing.assert_close(out, two_kernels, rtol=0, atol=2e-6)
    prod = _reference(x, w, None)
    want = torch.nn.functional.silu(prod[:, :cols]) * prod[:, cols:]
    torch.testing.assert_close(out.float(), want, rtol=4e-2, atol=5e-2)     # g, u, silu(g) rounded to dtype


def test_silu_mul_epilogue_rejects_odd_weights_and_adds():
    x, w, _ = _operands(2, 6, 32, None, torch.float16, 5)
    with pytest.raises(GraphDSLError, match=r"silu_mul needs a packed \[gate \| up\] weight.*got w \[5, 32\]"):
        gemv(x, w[:5].contiguous(), silu_mul=True)
    with pytest.raises(GraphDSLError, match=r"no add.*add \[6\]"):
        gemv(x, w, torch.zeros(6, dtype=torch.float16, device=DEV), silu_mul=True)
    with pytest.raises(GraphDSLError, match=r"out must be \[2, 3\]"):
        gemv(x, w, silu_mul=True, out=torch.empty(2, 6, dtype=torch.float16, device=DEV))


# -- quantized weights (graphdsl.quant weight-only schemes) dequantized in the GEMV ---------------
_QUANT_CASES = [("int4-g64", 16, 256, 1), ("int4-g64-zp", 32, 64, 2), ("int4-g128", 16, 256, 2),
                ("int4-g128-zp", 16, 64, 3), ("int8-channel", 16, 64, 2), ("fp8-channel", 32, 128, 1),
                ("fp8-tensor", 16, 64, 3)]


def _quantized(name, n, k, dtype, seed):
    from graphdsl.quant import parse_scheme
    s = parse_scheme(name)
    stored = [t.to(DEV) for t in s.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), dtype)]
    w = s.dequantize(stored, n, k, torch.float32)
    return s, stored, w


def _epilogue_reference(prod, epilogue, add, dtype):
    """The fused op's result from its product ``prod`` (float32 or float64): SwiGLU of the packed
    ``[gate | up]`` halves, g, u and silu(g) rounded to ``dtype`` as the kernel rounds them, or
    ``prod + add``."""
    if epilogue == "silu_mul":
        cols = prod.shape[1] // 2
        g, u = prod[:, :cols].to(dtype).to(prod.dtype), prod[:, cols:].to(dtype).to(prod.dtype)
        return torch.nn.functional.silu(g).to(dtype).to(prod.dtype) * u
    return prod + (0 if add is None else add.to(prod.dtype))


@pytest.mark.parametrize("name,block_n,block_k,split", _QUANT_CASES)
@pytest.mark.parametrize("epilogue", [None, "residual", "silu_mul"])
@pytest.mark.parametrize("m", [1, 3])
def test_quantized_weights_match_dequantize_then_matmul(name, block_n, block_k, split, epilogue, m):
    """``W = (q - z) * s`` dequantized in registers (int4: a K step across several groups, inside one,
    and split over K — one row through the CUDA-core loop, more through ``tl.dot``; 8-bit: the row
    scale on the float32 sums) equals the dequantized weight's float32 product, with the residual or
    SwiGLU epilogue applied by the program finishing a tile."""
    k, dtype = 256, torch.bfloat16
    n = 48 if epilogue == "silu_mul" else 40
    s, stored, w = _quantized(name, n, k, dtype, seed=block_k + split)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    add = torch.randn(m, n, generator=torch.Generator().manual_seed(2)).to(DEV, dtype) if epilogue == "residual" else None
    cols = n // 2 if epilogue == "silu_mul" else n
    want = _epilogue_reference(x.float() @ w.T, epilogue, add, dtype)
    out = torch.full((m, cols), float("nan"), dtype=dtype, device=DEV)
    cfg = dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=2)
    gemv(x, stored[0], add, silu_mul=epilogue == "silu_mul", out=out, config=cfg, workspace=GemvWorkspace(),
         scheme=s, scales=stored[1], zeros=stored[2] if len(stored) > 2 else None)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_quantized_default_launch_splits_k_and_keeps_groups_whole():
    """The default quantized launch: K steps that hold whole int4 groups, K split when few tiles."""
    from graphdsl.runtime.kernels.gemv import W_INT4, _pick_quant_config
    cfg = _pick_quant_config(1, 4096, 4096, W_INT4, 128, torch.device("cuda:0") if DEV == "cuda" else torch.device("cpu"))
    assert cfg["BLOCK_K"] % 128 == 0 and cfg["SPLIT_K"] >= 1
    s, stored, w = _quantized("int4-g128", 24, 512, torch.float16, seed=3)
    x = torch.randn(2, 512).to(DEV, torch.float16)
    got = gemv(x, stored[0], scheme=s, scales=stored[1])
    torch.testing.assert_close(got.float(), x.float() @ w.T, rtol=1e-2, atol=1e-2 * (x.float() @ w.T).abs().max().item())


def test_quantized_operands_are_checked():
    s, stored, _ = _quantized("int4-g64", 8, 128, torch.float16, seed=4)
    x = torch.randn(2, 128).to(DEV, torch.float16)
    with pytest.raises(GraphDSLError, match=r"the codes of int4-g64.*w \[8, 128\] torch.float16"):
        gemv(x, torch.zeros(8, 128, dtype=torch.float16, device=DEV), scheme=s, scales=stored[1])
    with pytest.raises(GraphDSLError, match=r"int4-g64 needs contiguous scales"):
        gemv(x, stored[0], scheme=s)
    g32 = _quantized("int4-g32", 8, 128, torch.float16, seed=4)[0]
    with pytest.raises(GraphDSLError, match=r"the codes of int4-g32"):      # a plane of a group < 16 inputs
        gemv(x, stored[0], scheme=g32, scales=stored[1])


@pytest.mark.parametrize("split,block_k", [(1, 64), (4, 64), (2, 128)])
def test_fp8_one_row_loop_is_exact_on_every_code(split, block_k):
    """The one-row fp8 loop moves each e4m3 code's bits into a float32 (times 2^-120) instead of
    converting it: every finite code — signed zeros, the subnormals (exponent 0), 448 — must come
    out as its value. Rows 0-7 hold only subnormal codes, so a wrong subnormal would show at that
    row's own scale; each row is checked against a float64 product to fp16 rounding."""
    from graphdsl.quant import parse_scheme
    s = parse_scheme("fp8-tensor")
    gen = torch.Generator().manual_seed(split)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]                              # every code but the two NaNs
    sub = codes[(codes & 0x78) == 0]                                    # exponent 0: zeros and subnormals
    n, k = 24, 256
    q = torch.cat([sub[torch.randint(0, sub.numel(), (8, k), generator=gen)],
                   finite.repeat(16 * k // finite.numel() + 1)[: 16 * k].view(16, k)])
    q = q[:, torch.randperm(k, generator=gen)].contiguous()
    values = q.view(torch.float8_e4m3fn).double()
    assert values.abs().max() == 448 and values[:8].abs().max() < 2 ** -6
    x = torch.randn(1, k, generator=gen).half()
    cfg = dict(BLOCK_N=16, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=2)
    got = gemv(x.to(DEV), q.view(torch.float8_e4m3fn).to(DEV), config=cfg, workspace=GemvWorkspace(), scheme=s,
               scales=torch.tensor([[0.5]]).to(DEV)).double().cpu()
    want = (x.double() @ values.T) * 0.5
    for rows in (slice(0, 8), slice(8, 24)):
        torch.testing.assert_close(got[:, rows], want[:, rows], rtol=2e-3, atol=2e-3 * want[:, rows].abs().max().item())


@pytest.mark.parametrize("name,split", [("int4-g64", 1), ("int4-g64-zp", 3), ("int4-g128", 2), ("int4-g128-zp", 1)])
@pytest.mark.parametrize("epilogue", [None, "silu_mul"])
def test_int4_integer_dot_row_matches_a_float64_product(name, split, epilogue):
    """One int4 row through integer dot products (``INT_DOT``): per group the activations become
    16-bit fixed point (step ``max|x_g| / 32767``), so each output is within half a step per input
    of the exact product, plus the fp16 output's rounding. The row holds a group of zeros (no scale
    to divide by), a group with one large input beside tiny ones and groups 1000 times larger than
    others (each group is scaled on its own); SwiGLU's products of those need bfloat16's range."""
    k, dtype = 512, torch.bfloat16 if epilogue == "silu_mul" else torch.float16
    eps = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10     # the interpreter truncates to bfloat16
    n = 48 if epilogue == "silu_mul" else 40
    s, stored, w = _quantized(name, n, k, dtype, seed=split)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x[0, :64] = 0.0
    x[0, 64:128] *= 1e-3
    x[0, 100] = 300.0
    x[0, 256:320] *= 1e3
    x = x.to(dtype)
    out = torch.full((1, n // 2 if epilogue else n), float("nan"), dtype=dtype, device=DEV)
    cfg = dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=split, num_warps=4, num_stages=2, INT_DOT=True)
    gemv(x.to(DEV), stored[0], silu_mul=epilogue == "silu_mul", out=out, config=cfg, workspace=GemvWorkspace(),
         scheme=s, scales=stored[1], zeros=stored[2] if len(stored) > 2 else None)
    xd, wd = x.double(), w.double().cpu()
    prod = xd @ wd.T
    step = xd.view(-1, s.group_size).abs().amax(1).repeat_interleave(s.group_size)[None] / 32767
    bound = (step / 2) @ wd.abs().T + 1e-6 * (xd.abs() @ wd.abs().T)
    if epilogue == "silu_mul":
        cols = n // 2
        g, u = prod[:, :cols].to(dtype).double(), prod[:, cols:].to(dtype).double()
        want = torch.nn.functional.silu(g).to(dtype).double() * u
        # silu(g) * u moves by |u| * max|silu'| times g's error and |silu(g)| <= |g| times u's, and
        # the rounding of g, u and silu(g) to the output dtype
        bound = bound[:, :cols] * (u.abs() * 1.1) + bound[:, cols:] * g.abs() + 3 * eps * want.abs()
    else:
        want = prod
    got = out.double().cpu()
    err = (got - want).abs()
    assert torch.isfinite(got).all()
    assert (err <= bound + eps * want.abs() + 1e-3).all(), f"worst error {err.max():.3g} vs bound {bound.max():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,int_dot", [("int4-g64", True), ("int4-g64", False), ("fp8-channel", False)])
def test_one_row_activations_read_as_int64_words_give_the_same_bits(name, int_dot, dtype, monkeypatch):
    """The one-row int4 and fp8 loops read 16-bit activations four to an int64 word where ``x`` is
    8-byte aligned (``X_WIDE``), one by one where it is not (a row starting one element in): the
    same bits either way, and as with the wide reads turned off."""
    import graphdsl.runtime.kernels.gemv as G
    k, n = 256, 32
    s, stored, _ = _quantized(name, n, k, dtype, seed=4)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
    shifted = torch.empty(1, k + 1, dtype=dtype, device=DEV)[:, 1:]
    shifted.copy_(x)
    assert x.data_ptr() % 8 == 0 and shifted.data_ptr() % 8 != 0
    cfg = dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=2, INT_DOT=int_dot)
    kw = dict(config=cfg, scheme=s, scales=stored[1], workspace=GemvWorkspace())
    wide, narrow = gemv(x, stored[0], **kw), gemv(shifted, stored[0], **kw)
    monkeypatch.setattr(G, "_X_WIDE", False)
    assert torch.equal(wide, narrow) and torch.equal(wide, gemv(x, stored[0], **kw))
    assert not torch.equal(wide, gemv(x.flip(-1).contiguous(), stored[0], **kw))


@pytest.mark.parametrize("xpack", [False, True])
@pytest.mark.parametrize("name", ["int4-g64", "int4-g128-zp"])
def test_int4_operands_in_the_quads_layout_give_the_same_bits(name, xpack, monkeypatch):
    """The one-row integer-dot loops with the scales, zero points and activations loaded in the
    accumulator's quad layout (``_QUADS``: :func:`_x_quad_loads`, :func:`_int4_step_dp4a_quads`) are
    the same bits as with them loaded ``[BLOCK_N, G]`` / ``[G, C]`` and split into quads, with two
    groups a step and the K split (each program's quads span the groups of its slice)."""
    import graphdsl.runtime.kernels.gemv as G
    from graphdsl.runtime.kernels.int4_acts import pack_int4_activations
    k, n, dtype = 512, 48, torch.bfloat16
    s, stored, w = _quantized(name, n, k, dtype, seed=8)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(9)).to(DEV, dtype)
    cfg = dict(BLOCK_N=16, BLOCK_K=2 * s.group_size, SPLIT_K=2, num_warps=4, num_stages=2, INT_DOT=True)
    kw = dict(config=cfg, scheme=s, scales=stored[1], zeros=stored[2] if len(stored) > 2 else None,
              xpack=pack_int4_activations(x, s.group_size) if xpack else None)
    quads = gemv(x, stored[0], workspace=GemvWorkspace(), **kw)
    monkeypatch.setattr(G, "_QUADS", False)
    assert torch.equal(quads, gemv(x, stored[0], workspace=GemvWorkspace(), **kw))
    ref = x.double().cpu() @ w.double().cpu().T
    assert torch.allclose(quads.double().cpu(), ref, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("m,int_dot,xpack,block_k", [(1, True, False, 128), (1, True, True, 256),
                                                     (1, False, False, 128), (1, True, False, 64),
                                                     (3, False, False, 128), (16, False, False, 64)])
@pytest.mark.parametrize("name,k", [("int4-g64", 384), ("int4-g128-zp", 512), ("int4-g64-zp", 192)])
def test_int4_codes_in_blocks_give_the_same_bits(name, k, m, int_dot, xpack, block_k):
    """Codes stored in blocks of 128 inputs (``-kb``: :func:`graphdsl.quant.int4_blocks`, the layout
    a CUDA bind gives int4 weights) multiply to the same bits as the row-major codes: the one-row
    loops (integer dot, float FMAs, packed activation bytes), whose steps cross or stay inside a
    block, and the 2-16 row ``tl.dot`` loop; with SwiGLU over packed gate/up rows and the K split.
    ``k = 192`` leaves a short last block."""
    from graphdsl.quant import int4_blocks
    from graphdsl.runtime.kernels.int4_acts import pack_int4_activations
    n, dtype = 48, torch.bfloat16
    s, stored, w = _quantized(name, n, k, dtype, seed=m + block_k)
    if k % block_k or block_k % s.group_size and s.group_size % block_k:
        block_k = s.group_size
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
    cfg = dict(BLOCK_N=16, BLOCK_K=block_k, SPLIT_K=2, num_warps=4, num_stages=2, INT_DOT=int_dot)
    kw = dict(silu_mul=True, config=cfg, scales=stored[1], zeros=stored[2] if len(stored) > 2 else None,
              xpack=pack_int4_activations(x, s.group_size) if xpack else None)
    rows = gemv(x, stored[0], workspace=GemvWorkspace(), scheme=s, **kw)
    blocks = int4_blocks(stored[0])
    assert tuple(blocks.shape) == (-(-k // 128), n, 64)
    got = gemv(x, blocks, workspace=GemvWorkspace(), scheme=s.with_blocks(), **kw)
    assert torch.equal(got, rows)
    ref = _epilogue_reference(x.double().cpu() @ w.double().cpu().T, "silu_mul", None, dtype)
    torch.testing.assert_close(got.double().cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    with pytest.raises(GraphDSLError, match=r"the codes of " + s.name + r"-kb"):   # a layout and a scheme that differ
        gemv(x, stored[0], scheme=s.with_blocks(), **kw)
    with pytest.raises(GraphDSLError, match=r"the codes of " + s.name + r", got"):
        gemv(x, blocks, scheme=s, **kw)


def test_int4_integer_dot_row_gives_nan_for_a_nan_input():
    """A NaN activation must not vanish into the fixed-point scale (a max that skips NaN would)."""
    s, stored, _ = _quantized("int4-g64", 16, 128, torch.float16, seed=5)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)).half()
    x[0, 70] = float("nan")
    cfg = dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2, INT_DOT=True)
    got = gemv(x.to(DEV), stored[0], config=cfg, scheme=s, scales=stored[1])
    assert torch.isnan(got).all()


def test_weight_prefetch_lines_per_kind(monkeypatch):
    """The lines a row the GEMV asks L2 for before its PDL wait: the first K steps of its slice at the
    weight's width, a power of two, none for the quantized ``tl.dot`` paths or with the knob at 0."""
    import graphdsl.runtime.kernels.gemv as G
    monkeypatch.setattr(G, "_PREFETCH_STEPS", 2)
    monkeypatch.setattr(G, "_PREFETCH_STEPS_QUANT", {G.W_INT4: 2, G.W_INT4_ZP: 2, G.W_FP8: 1})
    assert G._prefetch_lines(G.W_FLOAT, False, 128, 4096) == 4          # 2 steps x 128 bf16 = 512 bytes
    assert G._prefetch_lines(G.W_FLOAT, False, 256, 4096) == 8
    assert G._prefetch_lines(G.W_FLOAT, False, 64, 96) == 2             # the slice's 96 elements: 192 bytes
    assert G._prefetch_lines(G.W_INT4, True, 128, 4096) == 1            # 2 x 128 nibbles = 128 bytes
    assert G._prefetch_lines(G.W_INT4_ZP, True, 256, 4096) == 2
    assert G._prefetch_lines(G.W_FP8, True, 512, 2048) == 4             # 1 x 512 codes
    assert G._prefetch_lines(G.W_FP8, True, 256, 4096) == 2
    assert G._prefetch_lines(G.W_FP8, False, 128, 4096) == 0            # the tl.dot path of more rows
    assert G._prefetch_lines(G.W_INT8, False, 128, 4096) == 0
    monkeypatch.setattr(G, "_PREFETCH_STEPS", 0)
    assert G._prefetch_lines(G.W_FLOAT, False, 128, 4096) == 0


@pytest.mark.parametrize("m,int_dot,xpack", [(1, True, False), (1, False, False), (1, True, True), (3, False, False),
                                             (16, False, False)])
@pytest.mark.parametrize("name", ["int4-g64", "int4-g128-zp"])
def test_act_order_perm_read_in_the_loop_equals_gathering_first(name, m, int_dot, xpack):
    """``gemv(x, ..., perm=p)`` (act-order int4: the groups take the inputs in ``p``'s order) is the
    same bits as ``gemv(x[:, p], ...)``: the one-row loops (integer dot, float FMAs, packed bytes made
    by ``pack_int4_activations(x, perm=p)``) and the 2-16 row ``tl.dot`` loop read ``x`` through ``p``."""
    from graphdsl.runtime.kernels.int4_acts import pack_int4_activations
    k, n, dtype = 256, 48, torch.bfloat16
    s, stored, _ = _quantized(name, n, k, dtype, seed=m)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    perm = torch.randperm(k, generator=g).to(torch.int32).to(DEV)
    cfg = dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=2, INT_DOT=int_dot)
    kw = dict(silu_mul=True, config=cfg, scheme=s, scales=stored[1], zeros=stored[2] if len(stored) > 2 else None)
    gathered = x[:, perm.long()].contiguous()
    if xpack:
        want = gemv(x[:, perm.long()].contiguous(), stored[0], xpack=pack_int4_activations(gathered, s.group_size),
                    workspace=GemvWorkspace(), **kw)
        got = gemv(x, stored[0], xpack=pack_int4_activations(x, s.group_size, perm=perm), workspace=GemvWorkspace(),
                   **kw)
    else:
        want = gemv(gathered, stored[0], workspace=GemvWorkspace(), **kw)
        got = gemv(x, stored[0], perm=perm, workspace=GemvWorkspace(), **kw)
    assert torch.equal(got, want)
    ident = torch.arange(k, dtype=torch.int32, device=DEV)
    assert not torch.equal(gemv(x, stored[0], perm=ident, workspace=GemvWorkspace(), **kw), got)


def test_act_order_perm_is_checked():
    s, stored, _ = _quantized("int4-g64", 16, 128, torch.bfloat16, seed=0)
    x = torch.randn(1, 128).to(DEV, torch.bfloat16)
    kw = dict(scheme=s, scales=stored[1])
    with pytest.raises(GraphDSLError, match=r"gemv: perm must be a contiguous int32 \[128\] on .*, got torch.int64"):
        gemv(x, stored[0], perm=torch.arange(128, device=DEV), **kw)
    w = torch.randn(16, 128).to(DEV, torch.bfloat16)
    with pytest.raises(GraphDSLError, match=r"gemv: perm is for int4 weights"):
        gemv(x, w, perm=torch.arange(128, dtype=torch.int32, device=DEV))


# -- fp8 with dynamic activation scales (W8A8): rows quantized in the kernel, e4m3 tensor cores ------
@pytest.mark.parametrize("name", ["fp8-channel-dyn", "fp8-tensor-dyn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,split,block_k,epilogue", [(1, 40, 256, 1, 64, None), (3, 40, 256, 2, 64, "residual"),
                                                          (16, 48, 256, 1, 128, "silu_mul"), (2, 33, 200, 3, 32, None)])
def test_w8a8_quantizes_each_row_as_the_scheme_and_multiplies_exactly(name, dtype, m, n, k, split, block_k, epilogue):
    """``W_FP8_A8``: each row is quantized in the kernel as :func:`graphdsl.quant.quantize_fp8_rows`
    quantizes it (its scale from the whole row, across every K slice; times the reciprocal; e4m3
    rounding), and the e4m3 products are exact in float32 — so the result is the float64 product of
    the reference's quantized rows and the codes, to float32 sums and the output's rounding. The
    rows span five decades (codes down to the subnormals); with several rows one is all zeros (scale
    1e-12, output the residual alone); K = 200 and N = 33 leave masked lanes, which must read as 0."""
    from graphdsl.quant import parse_scheme, quantize_fp8_rows
    s = parse_scheme(name)
    gen = torch.Generator().manual_seed(m * 100 + k)
    q, sw = s.quantize(torch.randn(n, k, generator=gen) * 0.05)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, k)[torch.randperm(k, generator=gen)]).to(dtype)
    if m > 1:
        x[1] = 0.0
    add = torch.randn(m, n, generator=gen).to(dtype) if epilogue == "residual" else None
    xq, sx = quantize_fp8_rows(x)
    prod = (xq.double() @ q.double().T) * sx.double() * sw.double().reshape(1, -1)
    eps = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    cols = n // 2 if epilogue == "silu_mul" else n
    want = _epilogue_reference(prod, epilogue, add, dtype)
    out = torch.full((m, cols), float("nan"), dtype=dtype, device=DEV)
    cfg = dict(BLOCK_N=16, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=2)
    gemv(x.to(DEV), q.to(DEV), None if add is None else add.to(DEV), silu_mul=epilogue == "silu_mul", out=out,
         config=cfg, workspace=GemvWorkspace(), scheme=s, scales=sw.to(DEV))
    got = out.double().cpu()
    assert torch.isfinite(got).all()
    # SwiGLU: g and u may each round the other way from a float32 sum in another order, then silu(g)
    torch.testing.assert_close(got, want, rtol=(5 if epilogue == "silu_mul" else 3) * eps,
                               atol=1e-5 * want.abs().max().item())
    if m > 1 and epilogue != "silu_mul":
        assert torch.equal(got[1], (torch.zeros(n, dtype=torch.float64) if add is None else add[1].double()))


@triton.jit
def _cast_e4m3(v_ptr, o_ptr, n, EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + i, _to_e4m3(tl.load(v_ptr + i, mask=i < n, other=0.0), EMULATE), mask=i < n)


def test_e4m3_rounding_matches_torch_on_every_boundary():
    """The kernel's cast to e4m3 (the interpreter's: rounded in float32 first) against torch's: each
    code's value, the midpoints between neighbouring codes (ties to even) and a float32 ulp either
    side of them, across the subnormals, the normal binades and up to 448, both signs."""
    codes = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (codes[1:] + codes[:-1]) / 2
    ulp = lambda t, d: (t.view(torch.int32) + d).view(torch.float32)  # noqa: E731
    v = torch.cat([codes, mids, ulp(mids, 1), ulp(mids, -1), torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 448])
    v = torch.cat([v, -v]).contiguous()
    out = torch.empty(v.numel(), dtype=torch.float8_e4m3fn, device=DEV)
    _cast_e4m3[(triton.cdiv(v.numel(), 1024),)](v.to(DEV), out, v.numel(),
                                            EMULATE=os.environ.get("TRITON_INTERPRET") == "1", BLOCK=1024)
    want = v.to(torch.float8_e4m3fn)
    bad = (out.cpu().view(torch.uint8) != want.view(torch.uint8)).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} values cast differently, e.g. {v[bad[:4]].tolist()}"


def test_w8a8_launch_from_the_sweep(monkeypatch):
    """``_pick_a8_config`` on the Llama-3-8B projections (H200 sweep): 256-code steps six deep for a
    wave of tiles, K split in two at half the SMs or fewer, 128-code steps four deep past a wave."""
    import graphdsl.runtime.kernels.gemv as g
    monkeypatch.setattr(g, "_num_sms", lambda device: 132)
    pick = lambda n, k: g._pick_a8_config(1, n, k, torch.device("cpu"))  # noqa: E731
    assert [(pick(n, k)["BLOCK_K"], pick(n, k)["SPLIT_K"], pick(n, k)["num_stages"])
            for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))] == \
        [(256, 1, 6), (256, 2, 6), (128, 1, 4), (256, 2, 6)]
    assert pick(40, 64)["BLOCK_K"] == 64 and pick(40, 64)["SPLIT_K"] == 1           # short K
