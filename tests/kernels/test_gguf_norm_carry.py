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
from graphdsl.runtime.kernels.gemv import GemvRmsIn, GemvRmsOut, GemvWorkspace
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
    with pytest.raises(GraphDSLError, match=r"rms_in needs n = K = 512.*got n 256"):
        gguf_gemv(x, q4, "Q4_K", config=dict(MMA=True, BLOCK_N=64, SPLIT_K=1), rms_in=GemvRmsIn(part, n, EPS))


def test_a_gguf_model_carries_its_norms_in_the_gemvs(tmp_path, monkeypatch):
    """A Q4_K model scoring one row on the tensor-core path (``MMA_MIN_ROWS`` lowered for the tiny
    shapes), steps eager. Launched, the three ``add_rms_norm`` before Q4_K projections (layer 0's
    post-attention norm, layer 1's two) each run ``norm_planes``; carried, none does — the GEMVs
    reading the normed rows take the producer's A operand, so the activation launches stay the three
    the norms never made (layer 0's qkv after the embedding's plain RMSNorm, the two o projections
    reading the attention) — and the logits stay those of the launched norms within the rounding
    the carry moves."""
    import graphdsl as gd
    import graphdsl.runtime.kernels.gguf_linear as kernels
    import graphdsl.runtime.kernels.gguf_mma as mma
    from graphdsl.runtime.backends import norm_carry
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
    for kinds, want_planes, want_norms in ((("int4", "float"), 3, 3), (("int4", "float", "gguf"), 3, 0)):
        monkeypatch.setattr(norm_carry, "KINDS", kinds)
        planes.clear()
        norms.clear()
        got[kinds] = llm.score([7]).float().cpu()
        assert (len(planes), len(norms)) == (want_planes, want_norms), kinds
    launched, carried = got.values()
    torch.testing.assert_close(carried, launched, rtol=0, atol=3e-2 * launched.abs().max().item())
