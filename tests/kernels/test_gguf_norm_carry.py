"""The RMSNorm carried by the GGUF GEMVs (``gguf_gemv(..., rms_out=, rms_in=)``): a one-row
tensor-core producer (Q4_K, Q6_K) adds the residual and stores, besides the sum, ``ŷ · weight``, the
sums of ``ŷ²`` a 32 columns and the Q4_K A operand of ``ŷ · weight``; a consumer (tensor-core Q4_K
reading that operand, or the CUDA-core kernel reading ``ŷ · weight``) multiplies its sums by the
norm's factor. Against ``add_rms_norm``'s reference and the unfused launches (CPU interpreter
here, compiled on a GPU)."""
import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.opdef import get_op
from graphdsl.runtime.kernels.gemv import GemvRmsIn, GemvRmsOut, GemvWorkspace, gemv
from graphdsl.runtime.kernels.gguf_linear import gguf_gemv
from graphdsl.runtime.kernels.gguf_mma import activation_planes
from graphdsl.runtime.gguf_blocks import to_stored
from tests.helpers.gguf_blocks import random_gguf_weight

pytest.importorskip("gguf")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def _row(k, seed, scale=1.0):
    return (scale * torch.randn(1, k, generator=torch.Generator().manual_seed(seed))).to(DEV, torch.bfloat16)


def _weight(qtype, n, k, seed):
    data, ref = random_gguf_weight(qtype, n, k, seed=seed)
    return (to_stored(data, qtype) if qtype == "Q6_K" else data).to(DEV), ref


def _carry_buffers(n, planes=True):
    f32 = dict(dtype=torch.float32, device=DEV)
    scaled = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    part = torch.full((1, n // 32), float("nan"), **f32)
    return scaled, part, (GemvWorkspace().planes(torch.device(DEV), n) if planes else None)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("split", [1, 3])
def test_producer_stores_the_scaled_row_its_square_sums_and_their_planes(qtype, split):
    """The sum is the plain residual GEMV's, bit for bit; ``scaled = ŷ · w`` rounded (bit for bit on a
    GPU; the CPU interpreter's casts truncate); the partials are
    the float32 sums of ``ŷ²`` over each 32 columns; the planes are ``activation_planes(scaled)``,
    bit for bit."""
    n, k = 512, 1024
    data, _ = _weight(qtype, n, k, seed=1)
    x, res = _row(k, 2), _row(n, 3)
    w = (1 + 0.3 * _row(n, 4).float()).to(torch.bfloat16)[0]
    cfg = dict(MMA=True, BLOCK_N=64, SPLIT_K=split)
    plain = gguf_gemv(x, data, qtype, res, config=cfg)
    scaled, part, planes = _carry_buffers(n)
    for t in planes:
        t.fill_(3)
    got = gguf_gemv(x, data, qtype, res, config=cfg, rms_out=GemvRmsOut(w, scaled, part, planes=planes))
    assert torch.equal(got, plain)
    want = (plain.float() * w.float()).to(torch.bfloat16)      # the interpreter's casts truncate: a unit off
    torch.testing.assert_close(scaled.float(), want.float(), rtol=0 if DEV == "cuda" else 2 ** -7, atol=0)
    torch.testing.assert_close(part, plain.float().reshape(1, -1, 32).square().sum(-1), rtol=1e-6, atol=0)
    for mine, want in zip(planes, activation_planes(scaled[0])):
        assert torch.equal(mine, want)


@pytest.mark.parametrize("split", [1, 3])
def test_a_carried_norm_between_two_gemvs_gives_the_normed_product(split):
    """Producer (Q4_K o-like, residual) → consumers reading the carried norm: a Q4_K tensor-core GEMV
    (the producer's planes), its SwiGLU form, and the CUDA-core kernel on ``scaled`` (one row and
    three) — each the product of ``add_rms_norm``'s normed row within the bf16 rounding the norm
    moves (``ŷ · w`` rounded instead of ``ŷ · r``)."""
    k, n = 512, 256
    o, _ = _weight("Q4_K", k, 1024, seed=5)
    x, res = _row(1024, 6), _row(k, 7, scale=4.0)
    w = (1 + 0.3 * _row(k, 8).float()).to(torch.bfloat16)[0]
    scaled, part, planes = _carry_buffers(k)
    s = gguf_gemv(x, o, "Q4_K", res, config=dict(MMA=True, BLOCK_N=64, SPLIT_K=2),
                  rms_out=GemvRmsOut(w, scaled, part, planes=planes))
    normed, _ = get_op("add_rms_norm").reference(s, torch.zeros_like(s), w, eps=EPS)
    rms_in = GemvRmsIn(part, k, EPS)

    def close(got, want):
        torch.testing.assert_close(got.float().cpu(), want.float(), rtol=0, atol=2e-2 * want.float().abs().max().item())

    q4, ref4 = _weight("Q4_K", n, k, seed=9)
    cfg = dict(MMA=True, BLOCK_N=64, SPLIT_K=split)
    got = gguf_gemv(scaled, q4, "Q4_K", config=cfg, planes=planes, rms_in=rms_in)
    close(got, normed.float().cpu() @ ref4.T)
    gu, refgu = _weight("Q4_K", 2 * n, k, seed=10)
    got = gguf_gemv(scaled, gu, "Q4_K", silu_mul=True, config=cfg, planes=planes, rms_in=rms_in)
    exact = normed.float().cpu() @ refgu.T
    close(got, torch.nn.functional.silu(exact[:, :n]) * exact[:, n:])
    q6, ref6 = _weight("Q6_K", n, k, seed=11)
    got = gguf_gemv(scaled, q6, "Q6_K", config=dict(SB=1, BLOCK_N=64, SPLIT_K=split), rms_in=rms_in)
    close(got, normed.float().cpu() @ ref6.T)
    # three rows on the CUDA cores' dot path: each row its own factor
    rows = torch.cat([scaled, 2 * scaled, -scaled])
    parts = torch.cat([part, 4 * part, part])
    got = gguf_gemv(rows, q6, "Q6_K", config=dict(SB=1, BLOCK_N=64, SPLIT_K=split),
                    rms_in=GemvRmsIn(parts, k, EPS))
    want = normed.float().cpu() @ ref6.T
    close(got, torch.cat([want, want, -want]))


def test_without_the_factor_the_consumer_is_wrong():
    """The factor is what makes the consumer's product the normed one: the same launch without
    ``rms_in`` is off by ``1 / r`` (so the tests above cannot pass by accident)."""
    k, n = 256, 64
    scaled, part = _row(k, 12, scale=8.0), None
    part = scaled.float().reshape(1, -1, 32).square().sum(-1)
    q4, ref4 = _weight("Q4_K", n, k, seed=13)
    cfg = dict(MMA=True, BLOCK_N=64, SPLIT_K=1)
    with_r = gguf_gemv(scaled, q4, "Q4_K", config=cfg, rms_in=GemvRmsIn(part.contiguous(), k, EPS)).float()
    without = gguf_gemv(scaled, q4, "Q4_K", config=cfg).float()
    r = torch.rsqrt(part.sum() / k + EPS).item()
    torch.testing.assert_close(with_r, without * r, rtol=2e-2, atol=1e-3)
    assert not torch.allclose(with_r, without, rtol=0.1)


def test_errors_name_the_argument():
    k, n = 512, 256
    q4, _ = _weight("Q4_K", n, k, seed=14)
    q6, _ = _weight("Q6_K", n, k, seed=15)
    x, res = _row(k, 16), _row(n, 17)
    w = torch.ones(n, dtype=torch.bfloat16, device=DEV)
    scaled, part, planes = _carry_buffers(n)
    good = GemvRmsOut(w, scaled, part, planes=planes)
    with pytest.raises(GraphDSLError, match=r"rms_out is written by the tensor-core path only.*Q6_K \[256, 512\]"):
        gguf_gemv(x, q6, "Q6_K", res, config=dict(SB=1, BLOCK_N=64, SPLIT_K=1), rms_out=good)
    with pytest.raises(GraphDSLError, match=r"rms_out.planes must be the Q4_K A operand of a row of 256 inputs"):
        gguf_gemv(x, q4, "Q4_K", res, config=dict(MMA=True, BLOCK_N=64, SPLIT_K=1),
                  rms_out=good._replace(planes=planes[:2]))
    with pytest.raises(GraphDSLError, match=r"rms_out.partials must be a contiguous \[1, 8\] torch.float32"):
        gguf_gemv(x, q4, "Q4_K", res, config=dict(MMA=True, BLOCK_N=64, SPLIT_K=1),
                  rms_out=good._replace(partials=part[:, :4]))
    with pytest.raises(GraphDSLError, match=r"whole tiles of 64 columns.*N 256|tiles of a multiple of 32"):
        gguf_gemv(x, q4, "Q4_K", res, config=dict(MMA=True, BLOCK_N=16, SPLIT_K=1), rms_out=good)
    with pytest.raises(GraphDSLError, match=r"no packed int4 rows and whole tiles of 64 columns, got packed=True"):
        gguf_gemv(x, q4, "Q4_K", res, config=dict(MMA=True, BLOCK_N=64, SPLIT_K=1),
                  rms_out=good._replace(packed=torch.zeros(6, n // 8, dtype=torch.int32, device=DEV), pack_group=128))
    with pytest.raises(GraphDSLError, match=r"gemv: rms_out.planes \(a Q4_K A operand\) is written by the GGUF"):
        gemv(x, torch.zeros(n, k, dtype=torch.bfloat16, device=DEV), res, rms_out=good)
    with pytest.raises(GraphDSLError, match=r"rms_in needs n = K = 512.*got n 256"):
        gguf_gemv(x, q4, "Q4_K", config=dict(MMA=True, BLOCK_N=64, SPLIT_K=1), rms_in=GemvRmsIn(part, n, EPS))


def test_a_gguf_model_carries_its_norms_in_the_gemvs(tmp_path, monkeypatch):
    """A Q4_K model scoring one row on the tensor-core path (``MMA_MIN_ROWS`` lowered for the tiny
    shapes), steps eager. Launched, the three ``add_rms_norm`` before Q4_K projections (layer 0's
    post-attention norm, layer 1's two) each run ``norm_planes``; carried, none does — the GEMVs
    reading the normed rows take the producer's A operand. Of the activation launches the norms
    never made, the two o projections' go in decode steps when the attention writes their operand
    (the same tokens and logprobs, bit for bit); layer 0's qkv, after the embedding's plain RMSNorm,
    stays. The logits stay those of the launched norms within the rounding the carry moves."""
    import graphdsl as gd
    import graphdsl.runtime.kernels.gguf_linear as kernels
    import graphdsl.runtime.kernels.gguf_mma as mma
    from graphdsl.runtime.backends import norm_carry, triton_backend
    from tests.models.hf_tiny import make_checkpoint
    monkeypatch.setattr(kernels, "MMA_MIN_ROWS", 1)
    planes, norms = [], []
    real_planes, real_norm = mma.activation_planes, mma.norm_planes
    monkeypatch.setattr(mma, "activation_planes", lambda *a: planes.append(1) or real_planes(*a))
    monkeypatch.setattr(mma, "norm_planes", lambda *a: norms.append(1) or real_norm(*a))
    make_checkpoint("llama", tmp_path, hidden_size=256, intermediate_size=512)
    llm = gd.LLM(tmp_path, device=DEV, dtype="bfloat16", max_model_len=64, quantization="gguf-q4_k")
    llm.model.configure_runtime(backend="triton", cuda_graphs=False, max_blocks_per_seq=4)
    got = {}
    launched, carried = ("int4", "float"), ("int4", "float", "gguf")
    for kinds, want in ((launched, (3, 3)), (carried, (3, 0))):     # one prompt row: no decode attention
        monkeypatch.setattr(norm_carry, "KINDS", kinds)
        planes.clear()
        norms.clear()
        got[kinds] = llm.score([7]).float().cpu()
        assert (len(planes), len(norms)) == want, kinds
    torch.testing.assert_close(got[carried], got[launched], rtol=0, atol=3e-2 * got[launched].abs().max().item())
    params = gd.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)
    given = []
    real_given = triton_backend._attention_planes
    monkeypatch.setattr(triton_backend, "_attention_planes", lambda *a: (lambda p: given.append(p is not None) or p)(
        real_given(*a)))
    tokens, launches = {}, {}
    for attention in (False, True):
        monkeypatch.setattr(triton_backend, "_ATTENTION_PLANES", attention)
        planes.clear()
        given.clear()
        out = llm.generate([[7]], params)[0].outputs[0]
        tokens[attention] = (out.token_ids, [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
        launches[attention] = len(planes)
    made = sum(given)               # decode attentions that wrote o's operand: each an activation launch less
    assert made >= 2 and launches[False] - launches[True] == made, (launches, made)
    assert tokens[True] == tokens[False]            # the attention's operand is the launch's, bit for bit


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_writes_the_planes_of_its_output_row(splits):
    """``paged_attention_decode(..., planes=)``: one sequence, GQA (8 query heads on 2 KV heads,
    head_dim 64; a group of 4 pads no rows, so 3 KV heads of a 6-head group pad the combine's rows
    below): the A operand of the output row, bit for bit what ``activation_planes`` makes of it,
    whether one split stores it or the last of several combines it; the output is unchanged."""
    from graphdsl.runtime.kernels.paged_attention import paged_attention_decode
    g = torch.Generator().manual_seed(30)
    for heads, kv_heads in ((8, 2), (12, 2)):
        dim, block, blocks = 64, 16, 8
        q = torch.randn(1, heads, dim, generator=g).to(DEV, torch.bfloat16)
        kc = torch.randn(blocks, block, kv_heads, dim, generator=g).to(DEV, torch.bfloat16)
        vc = torch.randn(blocks, block, kv_heads, dim, generator=g).to(DEV, torch.bfloat16)
        tables = torch.arange(blocks, dtype=torch.int32, device=DEV)[None]
        lens = torch.tensor([100], dtype=torch.int32, device=DEV)
        kw = dict(scale=dim ** -0.5, num_splits=splits)
        plain = paged_attention_decode(q, kc, vc, tables, lens, **kw)
        k = heads * dim
        if k % 256:
            continue
        planes = GemvWorkspace().planes(torch.device(DEV), k)
        for t in planes:
            t.fill_(3)
        got = paged_attention_decode(q, kc, vc, tables, lens, planes=planes, **kw)
        assert torch.equal(got, plain)
        for mine, want in zip(planes, activation_planes(got.reshape(-1))):
            assert torch.equal(mine, want)
    with pytest.raises(GraphDSLError, match=r"planes.*for one sequence.*got 2 sequences"):
        paged_attention_decode(q.expand(2, -1, -1).contiguous(), kc, vc, tables.expand(2, -1).contiguous(),
                               lens.expand(2).contiguous(), planes=planes, **kw)
