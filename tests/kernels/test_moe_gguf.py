"""runtime/kernels/moe_gguf.py: MoE expert stacks kept in GGUF blocks vs the quant_moe_experts op's
reference (the stacks' blocks dequantized to float32, every routed expert computed densely).

Every block type with a Triton decoder, super-block (256 values) and 32-value types, Q4_K_M-style
pairs of stacks (gate/up Q4_K, down Q6_K; down Q5_0 where its inputs are no multiple of 256), both paths (one pair a program row, on
the CUDA cores or, for Q4_K / Q6_K, the int8 tensor cores; grouped by expert) at
decode and prefill pair counts, float32 and bfloat16 activations. On CPU under Triton's
interpreter; at Mixtral's size on the GPU.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (see conftest.py)

import pytest  # noqa: E402

from graphdsl.errors import GraphDSLError  # noqa: E402
from graphdsl.functional import ActType  # noqa: E402
from graphdsl.opdef import get_op  # noqa: E402
from graphdsl.quant import parse_scheme  # noqa: E402
from graphdsl.runtime.kernels import moe_gguf  # noqa: E402
from graphdsl.runtime.kernels.moe import quant_moe_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QREF = get_op("quant_moe_experts").reference
# bfloat16: the grouped kernels round the decoded weights to bfloat16 for the tensor cores (as the int4 stacks'
# do) and the one-pair ones keep them in float32; both store h in bfloat16. Measured under the interpreter, the
# grouped path's largest error is 3 bfloat16 steps of an output near 1 (0.0234), the one-pair path's one (0.0078).
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _case(tokens, experts, hidden, inter, top_k, dtype, up_scheme, down_scheme, seed=0, act=ActType.SWIGLU):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    scores = torch.randn(tokens, experts, generator=g).softmax(-1)
    w, ids = scores.topk(top_k, -1)
    routing = torch.zeros_like(scores).scatter_(1, ids, w)
    su, sd = parse_scheme(up_scheme), parse_scheme(down_scheme)
    x, routing = x.to(DEVICE), routing.to(DEVICE)
    up, dn = su.quantize_stack(gate_up.to(DEVICE)), sd.quantize_stack(down.to(DEVICE))
    want = QREF(x, routing, *up, *dn, gate_up_scheme=up_scheme, down_scheme=down_scheme, experts=experts,
                hidden=hidden, intermediate=inter, act=act)
    return (x, routing, up, dn), dict(schemes=(su, sd), top_k=top_k, geglu=act is ActType.GEGLU), want


def _close(got, want, dtype):
    scale = want.float().abs().max().item()
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * max(scale, 1.0), f"max error {err} against {TOL[dtype] * max(scale, 1.0)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("up_scheme,down_scheme", [
    ("gguf-q4_k", "gguf-q6_k"),      # a Q4_K_M file's experts
    ("gguf-q5_k", "gguf-q4_k"),
    ("gguf-q8_0", "gguf-q4_0"),      # 32-value blocks
    ("gguf-q4_1", "gguf-q8_0"),
    ("gguf-q4_k", "gguf-q5_0"),      # DeepSeek-V2-Lite's Q4_K_M experts (down's 1408 inputs: no K type)
    ("gguf-q5_1", "gguf-q5_0"),
])
@pytest.mark.parametrize("tokens,gemv", [(1, True), (1, False), (37, False)],
                         ids=["one_pair", "grouped_decode", "grouped_prefill"])
def test_gguf_stacks_match_the_dequantized_reference(up_scheme, down_scheme, tokens, gemv, dtype):
    """(One pair a program row at 37 tokens is right too, but takes 90 s under the interpreter.)"""
    args, kw, want = _case(tokens, 4, 256, 256, 2, dtype, up_scheme, down_scheme)
    _close(quant_moe_experts(*args, **kw, gemv=gemv), want, dtype)


def test_gguf_grouped_launch_takes_a_config():
    """``config`` sets the tile kernels' rows a block, rows a program and values a K step."""
    from graphdsl.runtime.kernels.moe import MoeConfig
    args, kw, want = _case(37, 4, 512, 256, 2, torch.float32, "gguf-q8_0", "gguf-q4_0")
    cfg = MoeConfig(32, (16, 512, 4, 1), (64, 128, 4, 1))
    _close(quant_moe_experts(*args, **kw, config=cfg), want, torch.float32)


@pytest.mark.parametrize("gemv", [True, False], ids=["one_pair", "grouped"])
def test_gguf_geglu_partial_tiles_and_many_experts(gemv):
    """GeGLU, an intermediate size that leaves partial row tiles (288 = 9 x 32), top-3 of 6."""
    args, kw, want = _case(2, 6, 256, 288, 3, torch.bfloat16, "gguf-q8_0", "gguf-q8_0", seed=2,
                           act=ActType.GEGLU)
    _close(quant_moe_experts(*args, **kw, gemv=gemv), want, torch.bfloat16)


@pytest.mark.parametrize("gemv", [True, False], ids=["one_pair", "grouped"])
def test_gguf_stacks_read_only_the_chosen_experts(gemv):
    """An expert no token chose may hold blocks whose scales are NaN (0xFF bytes: float16 NaN):
    neither path reads them."""
    args, kw, want = _case(2, 6, 256, 256, 2, torch.float32, "gguf-q4_k", "gguf-q6_k", seed=1)
    routing = args[1]
    unused = sorted(set(range(6)) - set(routing.nonzero()[:, 1].tolist()))
    assert unused
    for stack in (args[2], args[3]):
        stack[0][unused] = 0xFF
    got = quant_moe_experts(*args, **kw, gemv=gemv)
    assert not got.isnan().any()
    _close(got, want, torch.float32)


@pytest.mark.parametrize("up_scheme,down_scheme,dtype,tokens,one_pair", [
    ("gguf-q4_k", "gguf-q8_0", torch.float32, 4, True), ("gguf-q4_k", "gguf-q8_0", torch.float32, 5, False),
    ("gguf-q8_0", "gguf-q8_0", torch.float32, 2, True), ("gguf-q8_0", "gguf-q8_0", torch.float32, 3, False),
    ("gguf-q4_k", "gguf-q6_k", torch.bfloat16, 8, True), ("gguf-q4_k", "gguf-q6_k", torch.bfloat16, 9, False),
    ("gguf-q4_k", "gguf-q8_0", torch.bfloat16, 5, False),
    ("gguf-q5_k", "gguf-q6_k", torch.bfloat16, 2, True), ("gguf-q5_k", "gguf-q6_k", torch.bfloat16, 3, False),
    ("gguf-q5_k", "gguf-q6_k", torch.float32, 4, True)])
def test_default_path_follows_the_pairs_an_expert(up_scheme, down_scheme, dtype, tokens, one_pair, monkeypatch):
    """One pair a program row up to ``MAX_PAIRS_PER_EXPERT`` pairs an expert for the gate/up
    stack's type (top-2 of 4 experts: Q4_K 2, so up to 4 tokens; Q8_0 1, up to 2), or
    ``MAX_PAIRS_PER_EXPERT_MMA`` (4: up to 8 tokens) where that path runs on the tensor cores
    (Q4_K / Q6_K stacks, 16-bit activations), ``MAX_PAIRS_PER_EXPERT_PLANES`` (1) where only the
    grouped kernels run a plane at a time (Q5_K gate/up, 16-bit activations; under float32 it keeps
    Q5_K's 2); grouped beyond."""
    args, kw, want = _case(tokens, 4, 256, 256, 2, dtype, up_scheme, down_scheme)
    seen = []
    real = moe_gguf.gguf_experts

    def spy(*a, **k):
        seen.append(a[9])                                # gguf_experts(..., out, gemv, config)
        return real(*a, **k)

    monkeypatch.setattr(moe_gguf, "gguf_experts", spy)
    _close(quant_moe_experts(*args, **kw), want, dtype)
    assert seen == [one_pair]


def _spy_launches(monkeypatch, module, name):
    """Grids of ``module.name``'s launches, recorded as they run."""
    grids, real = [], getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(module, name, Spy())
    return grids


@pytest.mark.parametrize("up_scheme,down_scheme,dtype", [
    ("gguf-q4_k", "gguf-q6_k", torch.bfloat16),     # a Q4_K_M file's experts
    ("gguf-q4_k", "gguf-q4_k", torch.float16),
    ("gguf-q6_k", "gguf-q6_k", torch.bfloat16),
    ("gguf-q6_k", "gguf-q4_k", torch.float16),
])
def test_gguf_tensor_core_pairs_match_the_reference(up_scheme, down_scheme, dtype, monkeypatch):
    """Q4_K / Q6_K stacks under 16-bit activations take the int8 tensor-core kernels
    (``moe_gguf_mma``) one pair a program row, within the CUDA-core path's tolerance (the 16-bit
    fixed-point activations add at most 2^-16 of a sub-block's largest input); 3 tokens, top-2."""
    from graphdsl.runtime.kernels import moe_gguf_mma
    grids = _spy_launches(monkeypatch, moe_gguf_mma, "_down_kernel")
    args, kw, want = _case(3, 4, 512, 256, 2, dtype, up_scheme, down_scheme)
    _close(quant_moe_experts(*args, **kw, gemv=True), want, dtype)
    assert grids == [(6, 8, 1)]                          # 6 pairs x 8 tiles of 64 rows, K in one slice


@pytest.mark.parametrize("module,up_scheme,seed,grid", [
    ("moe_gguf_mma", "gguf-q4_k", 3, (6, 4, 4)),        # 64-row tiles, K in 4 slices
    ("moe_gguf_rows", "gguf-q5_k", 8, (6, 8, 2)),       # 32-row tiles, K in 2 slices
])
def test_gguf_tensor_core_down_split_geglu_and_unread_experts(module, up_scheme, seed, grid, monkeypatch):
    """Both tensor-core one-pair paths (Q4_K / Q6_K stacks: ``moe_gguf_mma``; a Q5_K gate/up stack:
    ``moe_gguf_rows``): down's K in slices (1024 inputs: 4 super-blocks, split as on a 132-SM GPU),
    GeGLU, top-3 of 6, and unused experts' blocks all 0xFF (NaN scales) that no program reads."""
    import importlib
    mod = importlib.import_module(f"graphdsl.runtime.kernels.{module}")
    grids = _spy_launches(monkeypatch, mod, "_down_kernel")
    monkeypatch.setattr(mod, "_sm_count", lambda device: 132)
    args, kw, want = _case(2, 6, 256, 1024, 3, torch.bfloat16, up_scheme, "gguf-q6_k", seed=seed, act=ActType.GEGLU)
    unused = sorted(set(range(6)) - set(args[1].nonzero()[:, 1].tolist()))
    assert unused
    for stack in (args[2], args[3]):
        stack[0][unused] = 0xFF
    got = quant_moe_experts(*args, **kw, gemv=True)
    assert not got.isnan().any()
    _close(got, want, torch.bfloat16)
    assert grids == [grid]


def _spy_planes(monkeypatch, name):
    """Column tiles of ``moe_gguf.name``'s launches that ran the plane loop (``PLANES``)."""
    tiles, real = [], getattr(moe_gguf, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **k):
                if k.get("PLANES"):
                    tiles.append(grid[1])
                return real[grid](*a, **k)
            return launch

    monkeypatch.setattr(moe_gguf, name, Spy())
    return tiles


@pytest.mark.parametrize("up_scheme,down_scheme,dtype", [("gguf-q4_k", "gguf-q6_k", torch.bfloat16),
                                                      ("gguf-q6_k", "gguf-q4_k", torch.float16),
                                                      ("gguf-q5_k", "gguf-q6_k", torch.bfloat16),   # Q5_K_M's
                                                      ("gguf-q8_0", "gguf-q8_0", torch.float16)])
def test_gguf_grouped_planes_match_the_reference(up_scheme, down_scheme, dtype, monkeypatch):
    """Grouped by expert, Q4_K / Q5_K / Q6_K / Q8_0 stacks under 16-bit activations take the plane
    loop (``moe_gguf_mma.rows_dot``: a 32-value plane of weights dequantized in registers a K step):
    37 tokens, top-2 of 4, blocks of 16 pairs with padding, GeGLU."""
    launches = _spy_planes(monkeypatch, "_grouped_down_kernel")
    args, kw, want = _case(37, 4, 512, 256, 2, dtype, up_scheme, down_scheme, seed=4, act=ActType.GEGLU)
    _close(quant_moe_experts(*args, **kw, gemv=False), want, dtype)
    assert launches == [512 // 64]                      # down's 512 rows in 64-row tiles, on the plane loop


def test_gguf_grouped_planes_take_a_config_and_skip_unused_experts(monkeypatch):
    """``config`` sets the plane kernels' rows a block, rows a program, warps and stages; a K step of
    other than one plane (32 values) is refused; experts no token chose (blocks all 0xFF: NaN
    scales) are never read."""
    from graphdsl.runtime.kernels.moe import MoeConfig
    launches = _spy_planes(monkeypatch, "_grouped_gate_up_kernel")
    args, kw, want = _case(2, 6, 256, 512, 2, torch.bfloat16, "gguf-q4_k", "gguf-q6_k", seed=5)
    unused = sorted(set(range(6)) - set(args[1].nonzero()[:, 1].tolist()))
    assert unused
    for stack in (args[2], args[3]):
        stack[0][unused] = 0xFF
    got = quant_moe_experts(*args, **kw, config=MoeConfig(32, (32, 32, 8, 1), (128, 32, 4, 3)))
    assert not got.isnan().any()
    _close(got, want, torch.bfloat16)
    assert launches == [512 // 32]
    with pytest.raises(GraphDSLError, match=r"config.up must take 32 values a K step, got \(64, 256, 4, 2\)"):
        quant_moe_experts(*args, **kw, config=MoeConfig(16, (64, 256, 4, 2), (64, 32, 4, 2)))


def test_gguf_grouped_planes_only_for_their_types(monkeypatch):
    """Q4_0 stacks (a type the plane loop does not decode) keep the float32 tiles grouped."""
    launches = _spy_planes(monkeypatch, "_grouped_down_kernel")
    args, kw, want = _case(5, 4, 256, 256, 2, torch.bfloat16, "gguf-q4_0", "gguf-q4_0", seed=6)
    _close(quant_moe_experts(*args, **kw, gemv=False), want, torch.bfloat16)
    assert launches == []


@pytest.mark.parametrize("dtype,mma,taken", [(torch.float32, True, False), (torch.bfloat16, False, False),
                                            (torch.bfloat16, True, True)])
def test_gguf_tensor_core_pairs_only_where_eligible(dtype, mma, taken, monkeypatch):
    """float32 activations (their 16-bit fixed point would lose bits) and ``MMA`` off keep the
    CUDA-core loop, as do 32-value types (the other tests)."""
    from graphdsl.runtime.kernels import moe_gguf_mma
    grids = _spy_launches(monkeypatch, moe_gguf_mma, "_gate_up_kernel")
    monkeypatch.setattr(moe_gguf, "MMA", mma)
    args, kw, want = _case(1, 4, 256, 256, 2, dtype, "gguf-q4_k", "gguf-q6_k")
    _close(quant_moe_experts(*args, **kw, gemv=True), want, dtype)
    assert bool(grids) == taken


@pytest.mark.parametrize("up_scheme,down_scheme,dtype,tokens", [
    ("gguf-q5_k", "gguf-q6_k", torch.bfloat16, 3),     # a Q5_K_M file's experts
    ("gguf-q8_0", "gguf-q8_0", torch.float16, 4),      # 8 pairs: the most the path takes
    ("gguf-q5_k", "gguf-q8_0", torch.bfloat16, 3),
    ("gguf-q8_0", "gguf-q4_k", torch.bfloat16, 3),
])
def test_gguf_rows_pairs_match_the_reference(up_scheme, down_scheme, dtype, tokens, monkeypatch):
    """Stacks with a Q5_K or Q8_0 side under 16-bit activations take the rows kernel's K loop on the int8
    tensor cores (``moe_gguf_rows``) one pair a program row, within the CUDA-core path's tolerance;
    top-2: down's grid is the pairs x 16 tiles of 32 rows, K in one slice."""
    from graphdsl.runtime.kernels import moe_gguf_rows
    grids = _spy_launches(monkeypatch, moe_gguf_rows, "_down_kernel")
    args, kw, want = _case(tokens, 4, 512, 256, 2, dtype, up_scheme, down_scheme, seed=7)
    _close(quant_moe_experts(*args, **kw, gemv=True), want, dtype)
    assert grids == [(2 * tokens, 16, 1)]


@pytest.mark.parametrize("up,down,dtype,tokens,top_k,hidden,taken", [
    ("Q5_K", "Q6_K", torch.bfloat16, 4, 2, 256, True),
    ("Q5_K", "Q6_K", torch.bfloat16, 5, 2, 256, False),     # 10 pairs: more than one group of 8 rows
    ("Q5_K", "Q6_K", torch.bfloat16, 1, 8, 256, True),
    ("Q8_0", "Q8_0", torch.float16, 1, 2, 256, True),
    ("Q8_0", "Q8_0", torch.float32, 1, 2, 256, False),      # float32 activations would lose bits
    ("Q8_0", "Q8_0", torch.bfloat16, 1, 2, 288, False),     # 288 inputs: no whole super-blocks
    ("Q4_0", "Q8_0", torch.bfloat16, 1, 2, 256, False),
])
def test_gguf_rows_pairs_only_where_eligible(up, down, dtype, tokens, top_k, hidden, taken):
    """Both stacks of the rows kernel's types, whole super-blocks, 16-bit activations, at most 8 pairs
    (past one group of 8 the dots double: slower than the CUDA cores at Mixtral's size)."""
    from graphdsl.runtime.kernels.gguf_tiles import KERNEL_QTYPES
    from graphdsl.runtime.kernels.moe_gguf_rows import eligible

    class Stack:                                         # moe._Stack's fields: stored rows [E, N, row bytes]
        def __init__(self, qtype, rows, k):
            values, nbytes = KERNEL_QTYPES[qtype]
            self.qtype = qtype
            self.codes = torch.empty(2, rows, k // values * nbytes, dtype=torch.uint8)

    inter = 256
    assert eligible(Stack(up, 2 * inter, hidden), Stack(down, hidden, inter), hidden, inter, dtype, tokens,
                    top_k) is taken


def test_gguf_rows_pairs_off_with_mma(monkeypatch):
    """``moe_gguf.MMA`` off keeps the CUDA-core loop for Q5_K stacks."""
    from graphdsl.runtime.kernels import moe_gguf_rows
    grids = _spy_launches(monkeypatch, moe_gguf_rows, "_gate_up_kernel")
    monkeypatch.setattr(moe_gguf, "MMA", False)
    args, kw, want = _case(1, 4, 256, 256, 2, torch.bfloat16, "gguf-q5_k", "gguf-q6_k")
    _close(quant_moe_experts(*args, **kw, gemv=True), want, torch.bfloat16)
    assert grids == []


def test_gguf_stacks_refuse_what_the_kernels_cannot_read():
    args, kw, _ = _case(2, 4, 256, 256, 2, torch.float32, "gguf-q4_k", "gguf-q4_k")
    with pytest.raises(GraphDSLError, match=r"schemes gguf-q4_k and int8-channel: GGUF stacks run with GGUF "
                                            r"stacks only"):
        quant_moe_experts(*args, **dict(kw, schemes=(kw["schemes"][0], parse_scheme("int8-channel"))))
    with pytest.raises(GraphDSLError, match=r"top_k must be an int in \[1, 4\], got 0"):
        quant_moe_experts(*args, **dict(kw, top_k=0))


def test_block_major_schemes_cannot_store_stacks():
    with pytest.raises(GraphDSLError, match=r"'gguf-q4_k-kb' cannot store the expert stack 'w'"):
        parse_scheme("gguf-q4_k-kb").check_stack("w", (4, 256, 256))
    parse_scheme("gguf-q4_k").check_stack("w", (4, 256, 256))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,gemv,mma", [(1, True, True), (1, True, False), (1, False, False),
                                             (300, False, False)])
def test_gguf_mixtral_size_on_gpu(tokens, gemv, mma, monkeypatch):
    """Mixtral-8x7B's experts as a Q4_K_M file keeps them (gate/up Q4_K, down Q6_K), bfloat16; the
    one-pair path on the tensor cores and on the CUDA cores."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(moe_gguf, "MMA", mma)
    args, kw, want = _case(tokens, 8, 4096, 14336, 2, torch.bfloat16, "gguf-q4_k", "gguf-q6_k")
    got = quant_moe_experts(*args, **kw, gemv=gemv).float()
    assert (got - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("up_scheme,down_scheme,tokens", [("gguf-q5_k", "gguf-q6_k", 1), ("gguf-q5_k", "gguf-q6_k", 4),
                                                          ("gguf-q8_0", "gguf-q8_0", 2)])
def test_gguf_rows_pairs_mixtral_size_on_gpu(up_scheme, down_scheme, tokens, monkeypatch):
    """Mixtral-8x7B's experts as a Q5_K_M file (gate/up Q5_K, down Q6_K) and a Q8_0 file keep them, bfloat16,
    one pair a program row on the rows kernel's tensor-core loop (``moe_gguf_rows``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from graphdsl.runtime.kernels import moe_gguf_rows
    grids = _spy_launches(monkeypatch, moe_gguf_rows, "_gate_up_kernel")
    args, kw, want = _case(tokens, 8, 4096, 14336, 2, torch.bfloat16, up_scheme, down_scheme)
    got = quant_moe_experts(*args, **kw, gemv=True).float()
    assert grids == [(2 * tokens, 2 * 14336 // 32)]
    assert (got - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()

