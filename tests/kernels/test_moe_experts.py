"""runtime/kernels/moe.py vs the moe_experts op's torch reference (every expert, dense).

Routing like the MoE layer's (top-k of a softmax, zeros elsewhere; some rows sharing experts,
some experts unused), SwiGLU and GeGLU, decode-sized (16-row blocks) and prefill-sized (64-row
blocks) pair counts, odd sizes that leave partial tiles, float32 and bfloat16; the same kernels over
quantized stacks (``quant_moe_experts``) vs that op's reference (the stacks dequantized). On CPU
under Triton's interpreter; at real sizes on the GPU.
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
from graphdsl.runtime.kernels.moe import moe_align, moe_experts, quant_moe_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REF = get_op("moe_experts").reference
QREF = get_op("quant_moe_experts").reference
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _case(tokens, experts, hidden, inter, top_k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    scores = torch.randn(tokens, experts, generator=g).softmax(-1)
    w, ids = scores.topk(top_k, -1)
    routing = torch.zeros_like(scores).scatter_(1, ids, w)
    return [t.to(DEVICE) for t in (x, routing, gate_up, down)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,hidden,inter,top_k,act", [
    (1, 8, 64, 48, 2, ActType.SWIGLU),        # decode: one token, two experts
    (5, 6, 40, 24, 3, ActType.GEGLU),         # partial tiles in every dim
    (37, 4, 32, 80, 2, ActType.SWIGLU),       # > 64 pairs: prefill-sized blocks
])
def test_moe_experts_matches_reference(tokens, experts, hidden, inter, top_k, act, dtype):
    x, routing, gate_up, down = _case(tokens, experts, hidden, inter, top_k, dtype)
    got = moe_experts(x, routing, gate_up, down, top_k=top_k, geglu=act is ActType.GEGLU)
    want = REF(x.float(), routing, gate_up.float(), down.float(), act=act).to(dtype)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype] * max(scale, 1.0)


def test_only_chosen_experts_are_read():
    """An expert no token chose may hold NaNs: the sparse kernel never reads it."""
    x, routing, gate_up, down = _case(3, 6, 32, 32, 2, torch.float32, seed=1)
    unused = sorted(set(range(6)) - set(routing.nonzero()[:, 1].tolist()))
    assert unused
    want = moe_experts(x, routing, gate_up, down, top_k=2)
    gate_up[unused], down[unused] = float("nan"), float("nan")
    got = moe_experts(x, routing, gate_up, down, top_k=2)
    assert torch.equal(got, want)


def test_align_groups_pairs_by_expert():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)       # pairs 0..5: experts 2,0,2,1,0,2
    rows, block_expert = moe_align(ids, num_experts=4, block_m=2)
    p = 6
    assert block_expert.numel() == 3 + 4 and rows.numel() == 14       # cdiv(P, 2) + min(E, P) blocks
    assert block_expert.tolist() == [0, 1, 2, 2, 4, 4, 4]
    assert rows.tolist()[:8] == [1, 4, 3, p, 0, 2, 5, p]
    assert all(r == p for r in rows.tolist()[8:])


def test_bad_operands():
    x, routing, gate_up, down = _case(2, 4, 16, 16, 2, torch.float32)
    with pytest.raises(GraphDSLError, match=r"top_k must be an int in \[1, 4\], got 5"):
        moe_experts(x, routing, gate_up, down, top_k=5)
    with pytest.raises(GraphDSLError, match=r"do not fit \[T, H\], \[T, E\], \[E, 2I, H\], \[E, H, I\]"):
        moe_experts(x, routing[:, :3], gate_up, down, top_k=2)
    with pytest.raises(GraphDSLError, match="dtypes"):
        moe_experts(x, routing, gate_up.half(), down, top_k=2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_mixtral_size_on_gpu(tokens):
    """Mixtral-8x7B's experts (hidden 4096, intermediate 14336, top-2 of 8) in bfloat16 vs a float32
    loop over each token's chosen experts."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x, routing, gate_up, down = _case(tokens, 8, 4096, 14336, 2, torch.bfloat16)
    got = moe_experts(x, routing, gate_up, down, top_k=2).float()
    want = torch.zeros_like(got)
    for e in range(8):
        rows = routing[:, e].nonzero().squeeze(1)
        if rows.numel():
            g, u = (x[rows].float() @ gate_up[e].float().T).chunk(2, -1)
            want[rows] += routing[rows, e, None] * ((torch.nn.functional.silu(g) * u) @ down[e].float().T)
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()


def _quantized(scheme, tokens, experts, hidden, inter, top_k, dtype, seed=0):
    """A case with both stacks quantized in ``scheme`` (scales in ``dtype``): ``(args, kwargs, want)``."""
    x, routing, gate_up, down = _case(tokens, experts, hidden, inter, top_k, torch.float32, seed)
    s = parse_scheme(scheme)
    up, dn = s.quantize_stack(gate_up, dtype), s.quantize_stack(down, dtype)
    x = x.to(dtype)
    want = QREF(x, routing, *up, *dn, gate_up_scheme=scheme, down_scheme=scheme, experts=experts, hidden=hidden,
                intermediate=inter)
    return (x, routing, up, dn), dict(schemes=(s, s), top_k=top_k), want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["int8-channel", "fp8-channel", "int4-g32", "int4-g64-zp"])
@pytest.mark.parametrize("tokens,experts,hidden,inter,top_k", [
    (1, 8, 128, 64, 2),        # decode: one token, two experts
    (37, 4, 64, 128, 2),       # > 64 pairs: prefill-sized blocks
])
@pytest.mark.parametrize("gemv", [False, True], ids=["grouped", "gemv"])
def test_quantized_stacks_match_the_dequantized_reference(scheme, tokens, experts, hidden, inter, top_k, dtype, gemv):
    """Both paths (the grouped tensor-core kernels, the one-pair-a-row ones of ``moe_gemv``) at
    decode and prefill sizes, whichever the pair count would pick."""
    if scheme.startswith("fp8") and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 codes need sm_89+")
    args, kw, want = _quantized(scheme, tokens, experts, hidden, inter, top_k, dtype)
    got = quant_moe_experts(*args, **kw, gemv=gemv)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype] * max(scale, 1.0)


class _Launches:
    """A Triton kernel that records the name of every launch (``kernel[grid](...)``)."""

    def __init__(self, kernel, name, seen):
        self.kernel, self.name, self.seen = kernel, name, seen

    def __getitem__(self, grid):
        self.seen.append((self.name, tuple(grid)))
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["int4-g128", "int4-g64-zp", "fp8-channel", "int8-channel"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_stacks_run_the_word_loop(scheme, dtype, tokens, monkeypatch):
    """int4 stacks in groups of 64 or 128, fp8 and int8 stacks with 16-bit activations run the
    one-row word loops, one pair a program: gate and up rows interleaved in a tile, down's K split
    into slices (int4 at one token: four on the interpreter's four SMs) whose partials sum with the
    top-k. Within the float loop's tolerance of the reference, and of the float loop itself."""
    if scheme.startswith("fp8") and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 codes need sm_89+")
    from graphdsl.runtime.kernels import moe_gemv
    seen = []
    for name in ("_gate_up_words_kernel", "_down_words_kernel", "_gate_up_kernel", "_down_kernel"):
        monkeypatch.setattr(moe_gemv, name, _Launches(getattr(moe_gemv, name), name, seen))
    args, kw, want = _quantized(scheme, tokens, 8, 256, 512, 2, dtype)
    got = quant_moe_experts(*args, **kw, gemv=True)
    assert [n for n, _ in seen] == ["_gate_up_words_kernel", "_down_words_kernel"]
    if scheme.startswith("int4") and DEVICE == "cpu":
        assert seen[1][1] == ((2, 1, 4) if tokens == 1 else (6, 1, 1))     # (pairs, tiles, K slices)
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= 2e-2 * scale     # two ulps of a 16-bit output
    monkeypatch.setattr(moe_gemv, "words_step", lambda *a: None)
    floats = quant_moe_experts(*args, **kw, gemv=True)
    assert [n for n, _ in seen[2:]] == ["_gate_up_kernel", "_down_kernel"]
    assert (got.float() - floats.float()).abs().max().item() <= 2e-2 * scale


@pytest.mark.parametrize("scheme,tokens,experts,one_pair", [
    ("int4-g128", 4, 2, True), ("int4-g128", 5, 2, False), ("int4-g128", 6, 3, True),
    ("fp8-channel", 2, 8, True), ("fp8-channel", 3, 8, False), ("int8-channel", 2, 8, True),
    ("int8-channel", 3, 8, False)])
def test_default_path_follows_the_pairs_an_expert(scheme, tokens, experts, one_pair, monkeypatch):
    """Stacks run one pair a program row up to ``MAX_PAIRS_PER_EXPERT`` of their kind of codes (int4
    4, fp8 and int8 0.5) times the experts (top-2: int4 4 tokens of 2 experts, 6 of 3; fp8 and int8
    2 tokens of 8), the grouped kernels beyond."""
    if scheme.startswith("fp8") and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 codes need sm_89+")
    from graphdsl.runtime.kernels import moe, moe_gemv
    seen = []
    for mod, name in ((moe_gemv, "_gate_up_words_kernel"), (moe_gemv, "_gate_up_kernel"), (moe, "_gate_up_kernel")):
        monkeypatch.setattr(mod, name, _Launches(getattr(mod, name), f"{mod.__name__.rsplit('.', 1)[1]}.{name}", seen))
    args, kw, want = _quantized(scheme, tokens, experts, 256, 256, 2, torch.bfloat16)
    got = quant_moe_experts(*args, **kw)
    assert [n for n, _ in seen] == (["moe_gemv._gate_up_words_kernel"] if one_pair else ["moe._gate_up_kernel"])
    assert (got.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()


@pytest.mark.parametrize("inter", [128, 512])
def test_int4_gate_up_tiles_narrow_where_the_grid_leaves_sms_idle(inter, monkeypatch):
    """int4 gate/up word tiles hold 256 rows unless pairs x 256-row tiles leave an SM without a
    program (the interpreter's grid counts 4 SMs: 2 pairs x 1 tile of inter 128 take 128-row
    tiles, 2 pairs x 4 tiles of inter 512 keep 256; an H200's 132 SMs narrow both)."""
    from graphdsl.runtime.kernels import moe_gemv
    from graphdsl.runtime.kernels.paged_attention import _sm_count
    rows = 128 if 2 * (2 * inter // 256) < _sm_count(torch.device(DEVICE)) else 256
    seen = []
    name = "_gate_up_words_kernel"
    monkeypatch.setattr(moe_gemv, name, _Launches(getattr(moe_gemv, name), name, seen))
    args, kw, want = _quantized("int4-g128", 1, 4, 256, inter, 2, torch.bfloat16)
    got = quant_moe_experts(*args, **kw, gemv=True)
    assert seen == [(name, (2, 2 * inter // rows))]
    assert (got.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()


@pytest.mark.parametrize("scheme", ["int4-g128", "int4-g32"])
def test_one_pair_kernels_find_each_tokens_top_k(scheme):
    """The one-pair kernels take each token's top-k from the routing themselves (no top-k launch):
    a routing whose rows sit in a wider buffer (row stride 11 for 8 experts), chosen experts in
    any columns, three of a token's weights equal, and an output that is a column slice of a
    wider tensor, against the reference."""
    args, kw, want = _quantized(scheme, 3, 8, 256, 256, 3, torch.bfloat16, seed=2)
    x, routing, up, dn = args
    buf = torch.zeros(3, 11, dtype=routing.dtype, device=routing.device)
    buf[:, :8] = routing
    buf[2, :8] = 0.0
    buf[2, [1, 4, 6]] = 1.0 / 3                               # ties among the chosen: any order sums the same
    routing = buf[:, :8]
    assert routing.stride(0) == 11
    want = QREF(x, routing, *up, *dn, gate_up_scheme=scheme, down_scheme=scheme, experts=8, hidden=256,
                intermediate=256)
    wide = torch.full((3, 300), float("nan"), dtype=x.dtype, device=x.device)
    got = quant_moe_experts(x, routing, up, dn, **kw, gemv=True, out=wide[:, 10:266])
    assert got.data_ptr() == wide[:, 10:266].data_ptr()
    assert (got.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()
    assert wide[:, :10].isnan().all() and wide[:, 266:].isnan().all()


def test_word_loop_takes_only_what_it_can_read():
    """``words_step``: int4 groups of 64 / 128, fp8 and int8 whose steps divide K, 16-bit activations;
    the rest (groups of 32, K not a multiple of the step, float32 rows) stay on the float loop."""
    from graphdsl.runtime.kernels.moe import _Stack
    from graphdsl.runtime.kernels.moe_gemv import code_kind, words_step

    def stack(name):
        s = parse_scheme(name)
        return _Stack.of(s, [torch.empty(c.shape, dtype=c.dtype or torch.bfloat16)
                             for c in s.stack_companions(2, 256, 256)])
    assert [code_kind(stack(n)) for n in ("int4-g32", "int8-channel", "fp8-channel")] == ["int4", "int8", "fp8"]
    assert words_step(stack("int4-g128"), torch.bfloat16, 4096) == 128
    assert words_step(stack("int4-g64-zp"), torch.float16, 256) == 128
    assert words_step(stack("fp8-channel"), torch.bfloat16, 4096) == 256
    assert words_step(stack("int4-g64"), torch.bfloat16, 192) is None
    assert words_step(stack("fp8-channel"), torch.bfloat16, 384) is None
    assert words_step(stack("int4-g32"), torch.bfloat16, 4096) is None
    assert words_step(stack("int4-g128"), torch.float32, 4096) is None
    assert words_step(stack("int8-channel"), torch.bfloat16, 4096) == 256
    assert words_step(stack("int8-channel"), torch.float32, 4096) is None


@pytest.mark.parametrize("gemv", [False, True], ids=["grouped", "gemv"])
def test_quantized_stacks_read_only_the_chosen_experts(gemv):
    """An expert no token chose may hold NaN scales: the kernels never read them."""
    args, kw, want = _quantized("int4-g32", 3, 6, 64, 64, 2, torch.float32, seed=1)
    routing = args[1]
    unused = sorted(set(range(6)) - set(routing.nonzero()[:, 1].tolist()))
    assert unused
    for stack in (args[2], args[3]):
        stack[1][unused] = float("nan")
    got = quant_moe_experts(*args, **kw, gemv=gemv)
    assert not got.isnan().any()
    assert (got - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1.0)


def test_quantized_stacks_refuse_what_the_kernels_cannot_read():
    args, kw, _ = _quantized("int8-channel", 2, 4, 64, 64, 2, torch.float32)
    with pytest.raises(GraphDSLError, match=r"unsupported operands \(scheme fp8-channel-dyn\)"):
        quant_moe_experts(*args, **dict(kw, schemes=(parse_scheme("fp8-channel-dyn"),) * 2))
    x, routing, up, dn = args
    with pytest.raises(GraphDSLError, match=r"down stored \[\[4, 64, 32\], \[4, 64, 1\]\] do not fit "
                                            r"\[\[4, 64, 64\], \[4, 64, 1\]\]"):
        quant_moe_experts(x, routing, up, [dn[0][:, :, :32].contiguous(), dn[1]], **kw)
    with pytest.raises(GraphDSLError, match=r"top_k must be an int in \[1, 4\], got 5"):
        quant_moe_experts(*args, **dict(kw, top_k=5))


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int4-g128", "int8-channel", "fp8-channel"])
@pytest.mark.parametrize("tokens,gemv", [(1, True), (1, False), (300, False)])
def test_quantized_mixtral_size_on_gpu(scheme, tokens, gemv):
    """Mixtral-8x7B's experts stored in ``scheme``, bfloat16 activations, vs the op's reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args, kw, want = _quantized(scheme, tokens, 8, 4096, 14336, 2, torch.bfloat16)
    got = quant_moe_experts(*args, **kw, gemv=gemv).float()
    assert (got - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 8, 2, 16), (7, 64, 6, 16), (30, 4, 2, 16),
                                                          (5, 3, 3, 4)])
def test_one_program_align_equals_the_torch_one(tokens, experts, top_k, block_m, monkeypatch):
    """The decode-size align kernel and the torch align give the same rows and block experts."""
    import graphdsl.runtime.kernels.moe as moe
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    got = moe_align(ids, experts, block_m)
    monkeypatch.setattr(moe, "_ALIGN_KERNEL_MAX_PAIRS", 0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")     # (on CPU) the torch path
    want = moe_align(ids, experts, block_m)
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())
