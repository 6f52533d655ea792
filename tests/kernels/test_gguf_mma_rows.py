"""runtime/kernels/gguf_mma_rows.py: 2..32 rows of a Q4_K, Q5_K, Q6_K or Q8_0 GEMV (one of Q5_K, Q8_0) on the
int8 tensor cores — the rows' A operands (made by their own launch, or by the RMSNorm before) and the sums
against the dequantize-then-matmul reference (CPU interpreter here, compiled on a GPU), the SwiGLU and
carried-norm epilogues, and ``gguf_gemv``'s choice of it."""
import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.runtime.gguf_blocks import to_stored
from graphdsl.runtime.kernels import gguf_linear
from graphdsl.runtime.kernels.gemv import GemvRmsIn, GemvWorkspace
from graphdsl.runtime.kernels.gguf_linear import gguf_gemv, mma_eligible
from graphdsl.runtime.kernels.gguf_mma_rows import rows_planes
from tests.helpers.gguf_blocks import random_gguf_weight

pytest.importorskip("gguf")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _x(m, k, dtype, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def _cfg(split=1, block_n=16):
    return dict(MMA=True, BLOCK_N=block_n, SPLIT_K=split, num_warps=2, num_stages=2)


def test_rows_planes_hold_each_rows_sub_blocks_in_16_bit_fixed_point():
    """Sub-block ``s``'s operand ``[16, 32]``: row ``m`` the high bytes of row ``m``'s ``xq``, row ``8 + m``
    the low ones, zeros for rows past M; ``(256 h + l) a_m`` gives x back within ``a_m / 2``, with one
    ``a_m = max |x| / 32639`` per row and super-block (the buffer holds it for each of its 8
    sub-blocks); ``S_ms = a_m Σ xq`` per sub-block; an all-zero super-block gives zeros and ``a_m = 0``;
    a NaN makes its super-block's ``a_m`` NaN."""
    m, k = 3, 512
    x = _x(m, k, torch.bfloat16, seed=1)
    x[1, :256] = 0                                       # row 1, super-block 0
    x[0, 32:64] = 0                                      # row 0, sub-block 1 alone: the block's scale stays
    x[2, 300] = float("nan")                             # row 2, super-block 1 (sub-block 9)
    a, xa, xs = (t.cpu() for t in rows_planes(x))
    n = k // 32                                          # 8 rows: the buffers' first half
    a, xa, xs = a.reshape(-1)[:n * 16 * 32].reshape(n, 16, 32), xa.reshape(-1)[:n * 8].reshape(n, 8), \
        xs.reshape(-1)[:n * 8].reshape(n, 8)
    h, lo = a[:, :8].long(), a[:, 8:].long()
    assert (h[:, m:] == 0).all() and (lo[:, m:] == 0).all() and (xa[:, m:] == 0).all()
    xq = (256 * h + lo)[:, :m]                           # [sub-blocks, rows, 32]
    want = x.float().cpu().reshape(m, k // 32, 32).transpose(0, 1)
    ok = ~torch.isnan(xa[:, :m])
    err = (xq.float() * xa[:, :m, None] - want).abs()
    assert (err[ok] <= (xa[:, :m, None] / 2 + 1e-7).expand_as(err)[ok]).all()
    block_max = x.float().cpu().reshape(m, k // 256, 256).abs().amax(2).T.repeat_interleave(8, 0)   # [sub-blocks, rows]
    torch.testing.assert_close(xa[:, :m][ok], (block_max / 32639)[ok])
    torch.testing.assert_close(xs[:, :m][ok], (xa[:, :m] * xq.sum(2).float())[ok])
    assert (xa[:8, 1] == 0).all() and (xs[:8, 1] == 0).all() and xa[1, 0] > 0 and xs[1, 0] == 0
    assert torch.isnan(xa[8:, 2]).all() and ok.sum() == ok.numel() - 8


@pytest.mark.parametrize("m,split,dtype,block_n", [(2, 1, torch.bfloat16, 16), (5, 3, torch.float16, 32),
                                                   (8, 2, torch.bfloat16, 16)])
def test_rows_gemv_matches_dequantize_then_matmul(m, split, dtype, block_n):
    """Odd N (a partial row tile), K of 4 super-blocks split evenly or not (3 asked: slices of 2), a
    float32 output to see the sums' own precision: within 1e-4 of the largest output."""
    data, ref = random_gguf_weight("Q4_K", 19, 1024, seed=2)
    x = _x(m, 1024, dtype, seed=3)
    out = torch.empty(m, 19, dtype=torch.float32, device=DEV)
    cfg = {key: v for key, v in _cfg(split, block_n).items() if key != "MMA"}
    gguf_linear.gguf_gemv_mma_rows(x, data.to(DEV), "Q4_K", None, out, None, cfg, 4)
    want = x.float().cpu() @ ref.T
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("qtype,m", [("Q4_K", 9), ("Q4_K", 16), ("Q6_K", 12), ("Q4_K", 17), ("Q4_K", 32),
                                     ("Q6_K", 24), ("Q5_K", 20), ("Q8_0", 27)])
def test_nine_to_32_rows_hold_two_or_four_groups_of_eight(qtype, m):
    """9-16 rows (the default up to ``ROWS_BY_DEFAULT``): the rows' operands hold two groups of 8
    rows; 17-32 rows (by config) four. The sums match the float32 reference within 1e-4 of the largest
    output, split-K included, and with SwiGLU (Q4_K) each output row matches the 8-row kernel's on the
    same rows."""
    data, ref = random_gguf_weight(qtype, 2 * 24, 512, seed=21)
    data = (to_stored(data, qtype) if qtype == "Q6_K" else data).to(DEV)
    x = _x(m, 512, torch.bfloat16, seed=22)
    out = torch.empty(m, 48, dtype=torch.float32, device=DEV)
    gguf_linear.gguf_gemv_mma_rows(x, data, qtype, None, out, None, dict(BLOCK_N=16, SPLIT_K=2, num_warps=2,
                                                                         num_stages=2), 4)
    want = x.float().cpu() @ ref.T
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=1e-4 * want.abs().max().item())
    if qtype == "Q4_K":
        both = gguf_gemv(x, data, qtype, silu_mul=True, config=_cfg(2))
        halves = torch.cat([gguf_gemv(x[i:i + 8], data, qtype, silu_mul=True, config=_cfg(2)) for i in range(0, m, 8)])
        torch.testing.assert_close(both.float(), halves.float(), rtol=2 ** -7, atol=1e-3 * halves.abs().max().item())


@pytest.mark.parametrize("qtype,m,split,dtype", [("Q6_K", 3, 1, torch.bfloat16), ("Q6_K", 8, 3, torch.float16),
                                                  ("Q5_K", 2, 1, torch.bfloat16), ("Q5_K", 13, 3, torch.float16),
                                                  ("Q8_0", 1, 1, torch.bfloat16), ("Q8_0", 11, 3, torch.float16)])
def test_q6k_q5k_and_q8_0_rows_gemv_match_gguf_py_values(qtype, m, split, dtype):
    """Q6_K in the stored 224-byte layout, Q5_K and Q8_0 (one row too), odd N, K of 4 super-blocks (3 slices asked: slices of 2), a float32
    output: within 1e-4 of the largest output of gguf-py's dequantized weight times x (Q5_K: every
    code's fifth bit included); a residual and block-major blocks through ``gguf_gemv`` give the same
    bits as stored rows."""
    from graphdsl.runtime.gguf_blocks import block_major
    data, ref = random_gguf_weight(qtype, 19, 1024, seed={"Q6_K": 4, "Q5_K": 7}.get(qtype, 8))
    data = to_stored(data, qtype).to(DEV)
    x = _x(m, 1024, dtype, seed=5)
    out = torch.empty(m, 19, dtype=torch.float32, device=DEV)
    cfg = {key: v for key, v in _cfg(split).items() if key != "MMA"}
    gguf_linear.gguf_gemv_mma_rows(x, data, qtype, None, out, None, cfg, 4)
    want = x.float().cpu() @ ref.T
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=1e-4 * want.abs().max().item())
    res = _x(m, 19, dtype, seed=6)
    rows = gguf_gemv(x, data, qtype, res, config=_cfg(split))
    assert torch.equal(gguf_gemv(x, block_major(data, qtype), qtype, res, config=_cfg(split)), rows)
    torch.testing.assert_close(rows.float().cpu(), want + res.float().cpu(), rtol=0,
                               atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("split", [1, 2])
def test_rows_gemv_into_a_column_slice_with_the_residual_and_block_major_blocks(split):
    """``gguf_gemv`` with ``MMA=True`` and 4 rows writes a column slice of a wider product with the
    residual slice added; block-major blocks (what a CUDA bind stores) give the same bits; the split-K
    counters are back at zero (a second launch gives the same bits)."""
    from graphdsl.runtime.gguf_blocks import block_major
    data, ref = random_gguf_weight("Q4_K", 40, 512, seed=6)
    data = data.to(DEV)
    x = _x(4, 512, torch.bfloat16, seed=7)
    res = _x(4, 64, torch.bfloat16, seed=8)
    wide = torch.full((4, 64), float("nan"), dtype=torch.bfloat16, device=DEV)
    ws = GemvWorkspace()
    cfg = _cfg(split)
    gguf_gemv(x, data, "Q4_K", res[:, 10:50], out=wide[:, 10:50], workspace=ws, config=cfg)
    want = x.float().cpu() @ ref.T + res[:, 10:50].float().cpu()
    torch.testing.assert_close(wide[:, 10:50].float().cpu(), want, rtol=0, atol=1e-2 * want.abs().max().item())
    assert torch.isnan(wide[:, :10].float()).all() and torch.isnan(wide[:, 50:].float()).all()
    again = gguf_gemv(x, data, "Q4_K", res[:, 10:50], workspace=ws, config=cfg)
    assert torch.equal(again, wide[:, 10:50])
    assert torch.equal(gguf_gemv(x, block_major(data, "Q4_K"), "Q4_K", res[:, 10:50], config=cfg), again)


def test_rows_swiglu_epilogue_matches_gate_and_up_rounded():
    """``silu_mul`` with 3 rows: ``data`` is ``[gate | up]``; each output ``silu(g) * u`` with g and u
    rounded to the output dtype first and ``silu(g)`` after, as the one-row epilogue does."""
    data, ref = random_gguf_weight("Q4_K", 2 * 24, 512, seed=9)
    x = _x(3, 512, torch.bfloat16, seed=10)
    got = gguf_gemv(x, data.to(DEV), "Q4_K", silu_mul=True, config=_cfg(2))
    prod = (x.float().cpu() @ ref.T).to(torch.bfloat16).float()
    g, u = prod[:, :24], prod[:, 24:]
    want = (g * torch.sigmoid(g)).to(torch.bfloat16).float() * u
    assert got.shape == (3, 24)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=1e-2 * want.abs().max().item())


def test_rows_carried_norm_factor_scales_each_row():
    """``rms_in``: x is a producer's ``y · weight``; row ``m``'s sums are multiplied by its factor
    ``rsqrt(Σ part[m] / K + eps)`` (each row its own) before the residual is added."""
    m, k = 3, 512
    data, ref = random_gguf_weight("Q4_K", 16, k, seed=11)
    x = _x(m, k, torch.bfloat16, seed=12)
    part = (torch.rand(m, k // 32, generator=torch.Generator().manual_seed(13)) * torch.tensor([[1.0], [4.0], [9.0]]))
    res = _x(m, 16, torch.bfloat16, seed=14)
    got = gguf_gemv(x, data.to(DEV), "Q4_K", res, config=_cfg(1), rms_in=GemvRmsIn(part.to(DEV), k, 1e-5))
    factor = torch.rsqrt(part.sum(1, keepdim=True) / k + 1e-5)
    want = (x.float().cpu() @ ref.T) * factor + res.float().cpu()
    torch.testing.assert_close(got.float().cpu(), want, rtol=0, atol=1e-2 * want.abs().max().item())


def test_gguf_gemv_takes_the_rows_kernel_for_2_to_32_rows_and_one_q5k_or_q8_0_row(monkeypatch):
    """By default 2..32 fp16/bf16 rows of a Q4_K, Q5_K or Q8_0 weight (Q6_K: 2..16) of at least
    ``MMA_MIN_ROWS`` rows run the rows kernel, and so does one row of Q5_K or Q8_0 (no one-row tensor-core
    kernel); 17 rows of Q6_K (``Q6K_ROWS_BY_DEFAULT``), 33 rows, float32 rows and the switches off
    (``_MMA_ROWS_Q5K`` for Q5_K and ``_MMA_ROWS_Q8_0`` for Q8_0, their one row included; ``_MMA_ROWS_Q6K``
    for Q6_K; ``_MMA_ROWS``) do not."""
    from graphdsl.runtime.kernels.gguf_linear import on_rows_kernel
    calls = []
    monkeypatch.setattr(gguf_linear, "gguf_gemv_mma_rows", lambda x, *a, **kw: calls.append((x.shape[0], a[1])) or a[3])
    monkeypatch.setattr(gguf_linear, "MMA_MIN_ROWS", 32)
    q4k, _ = random_gguf_weight("Q4_K", 32, 256, seed=1)
    q6k, _ = random_gguf_weight("Q6_K", 32, 256, seed=1)
    q5k, _ = random_gguf_weight("Q5_K", 32, 256, seed=1)
    q4k, q5k, q6k = q4k.to(DEV), q5k.to(DEV), to_stored(q6k, "Q6_K").to(DEV)
    x1, x4 = _x(1, 256, torch.bfloat16, 1), _x(4, 256, torch.bfloat16, 1)
    for m in (2, 8, 16, 17, 32):
        gguf_gemv(_x(m, 256, torch.bfloat16, 1), q4k, "Q4_K")
        assert mma_eligible(_x(m, 256, torch.bfloat16, 1), q4k, "Q4_K")
    gguf_gemv(_x(12, 256, torch.bfloat16, 1), q6k, "Q6_K")
    gguf_gemv(x4, q5k, "Q5_K")
    gguf_gemv(x1, q5k, "Q5_K")
    gguf_gemv(_x(24, 256, torch.bfloat16, 1), q5k, "Q5_K")
    assert calls == [(2, "Q4_K"), (8, "Q4_K"), (16, "Q4_K"), (17, "Q4_K"), (32, "Q4_K"), (12, "Q6_K"), (4, "Q5_K"),
                     (1, "Q5_K"), (24, "Q5_K")]
    assert on_rows_kernel(x1, q5k, "Q5_K") and on_rows_kernel(x4, q4k, "Q4_K")
    assert mma_eligible(x1, q4k, "Q4_K") and not on_rows_kernel(x1, q4k, "Q4_K")    # the one-row kernel's
    assert on_rows_kernel(_x(16, 256, torch.bfloat16, 1), q6k, "Q6_K")
    assert not on_rows_kernel(_x(17, 256, torch.bfloat16, 1), q6k, "Q6_K")
    assert not mma_eligible(_x(33, 256, torch.bfloat16, 1), q4k, "Q4_K")
    gguf_gemv(_x(17, 256, torch.bfloat16, 1), q6k, "Q6_K")
    monkeypatch.setattr(gguf_linear, "_MMA_ROWS_Q5K", False)
    gguf_gemv(x4, q5k, "Q5_K")
    gguf_gemv(x1, q5k, "Q5_K")
    assert not mma_eligible(x4, q5k, "Q5_K") and not mma_eligible(x1, q5k, "Q5_K")
    q8, _ = random_gguf_weight("Q8_0", 32, 256, seed=1)
    q8 = q8.to(DEV)
    gguf_gemv(x1, q8, "Q8_0")
    gguf_gemv(x4, q8, "Q8_0")
    gguf_gemv(_x(32, 256, torch.bfloat16, 1), q8, "Q8_0")
    assert calls[-3:] == [(1, "Q8_0"), (4, "Q8_0"), (32, "Q8_0")]
    assert on_rows_kernel(x1, q8, "Q8_0") and on_rows_kernel(x4, q8, "Q8_0")
    monkeypatch.setattr(gguf_linear, "_MMA_ROWS_Q8_0", False)
    gguf_gemv(x1, q8, "Q8_0")
    gguf_gemv(x4, q8, "Q8_0")
    assert not mma_eligible(x1, q8, "Q8_0") and not mma_eligible(x4, q8, "Q8_0")
    gguf_gemv(_x(4, 256, torch.float32, 1), q4k, "Q4_K")
    monkeypatch.setattr(gguf_linear, "_MMA_ROWS_Q6K", False)
    gguf_gemv(x4, q6k, "Q6_K")
    monkeypatch.setattr(gguf_linear, "_MMA_ROWS", False)
    gguf_gemv(x4, q4k, "Q4_K")
    assert len(calls) == 12


def test_rows_kernel_refuses_what_it_cannot_take():
    """Errors name the argument and what was given: one-row operands with several rows (and the rows'
    operands with one Q4_K row), more rows than the kernel holds, another type, the one-row kernel's
    ``planes_out`` for Q5_K's one row on the rows kernel; a config for it must name the tile and the
    split."""
    data, _ = random_gguf_weight("Q4_K", 16, 256, seed=1)
    data = data.to(DEV)
    x = _x(4, 256, torch.bfloat16, seed=2)
    with pytest.raises(GraphDSLError, match=r"planes for 4 rows are the rows' operands of K=256 inputs .* the first "
                                            r"\[16, 256\]"):
        gguf_gemv(x, data, "Q4_K", config=_cfg(), planes=GemvWorkspace().planes(x.device, 256))
    with pytest.raises(GraphDSLError, match=r"2\.\.32 fp16/bf16 rows of Q4_K, Q5_K, Q6_K or Q8_0 .* got 33"):
        gguf_gemv(_x(33, 256, torch.bfloat16, 2), data, "Q4_K", config=_cfg())
    with pytest.raises(GraphDSLError, match=r"takes BLOCK_N, SPLIT_K .* got \['BLOCK_N'\]"):
        gguf_gemv(x, data, "Q4_K", config=dict(MMA=True, BLOCK_N=16))
    with pytest.raises(GraphDSLError, match=r"silu_mul runs on the tensor-core paths only: 1\.\.32 .* got 33"):
        gguf_gemv(_x(33, 256, torch.bfloat16, 2), data, "Q4_K", silu_mul=True)
    with pytest.raises(GraphDSLError, match=r"planes for Q4_K are 3 buffers .* got the rows' operands"):
        gguf_gemv(x[:1], data, "Q4_K", config=dict(MMA=True, BLOCK_N=16, SPLIT_K=1), planes=rows_planes(x))
    q5k, _ = random_gguf_weight("Q5_K", 16, 256, seed=1)
    with pytest.raises(GraphDSLError, match=r"planes_out take the one-row tensor-core kernels \(one row of Q4_K or "
                                            r"Q6_K\) or the CUDA-core path; got 1 row\(s\) of Q5_K on the rows kernel"):
        gguf_gemv(_x(1, 256, torch.bfloat16, 2), q5k.to(DEV), "Q5_K", silu_mul=True, config=_cfg(),
                  planes_out=GemvWorkspace().planes(x.device, 8))


@pytest.mark.parametrize("scheme", ["gguf-q4_k", "gguf-q6_k", "gguf-q5_k", "gguf-q8_0"])
def test_batched_decode_of_a_gguf_model_runs_the_rows_kernel(tmp_path, monkeypatch, scheme):
    """A Q4_K (Q6_K; Q5_K; Q8_0) model decoding 3 sequences at once (``MMA_MIN_ROWS``
    lowered for the tiny shapes): its projections run the rows kernel (gate/up with its SwiGLU epilogue,
    but for Q6_K), the prefill of their 9 prompt tokens too (padded to 16 rows on a GPU), and each token's
    log-probability matches the run with 2..16 rows a plane a dot (``_MMA_ROWS`` off), token for token,
    within 0.05. float16 activations: the planes path rounds each dequantized weight to the activation
    type, and with bfloat16 the two correct paths differed by up to 0.033 on the CPU and 0.12 on a GPU
    (float16 on the CPU: 0.006)."""
    import graphdsl as gd
    from tests.models.hf_tiny import make_checkpoint
    monkeypatch.setattr(gguf_linear, "MMA_MIN_ROWS", 1)
    calls = []
    real = gguf_linear.gguf_gemv_mma_rows
    monkeypatch.setattr(gguf_linear, "gguf_gemv_mma_rows",
                        lambda x, *a, **kw: calls.append((x.shape[0], kw.get("silu_mul", len(a) > 7 and a[7])))
                        or real(x, *a, **kw))
    make_checkpoint("llama", tmp_path, hidden_size=256, intermediate_size=512)
    llm = gd.LLM(tmp_path, device=DEV, dtype="float16", max_model_len=64, quantization=scheme)
    llm.model.configure_runtime(backend="triton", cuda_graphs=False, max_blocks_per_seq=4)
    params = gd.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [[5, 9, 2], [7, 1], [3, 3, 8, 4]]
    runs = {}
    for rows in (True, False):
        monkeypatch.setattr(gguf_linear, "_MMA_ROWS", rows)
        calls.clear()
        runs[rows] = llm.generate(prompts, params, use_tqdm=False)
        ms = {m for m, _ in calls}          # the decode steps' 3 rows and the 9-token prefill (16 rows on a GPU: padded)
        assert (3 in ms and all(m == 3 or 9 <= m <= 16 for m in ms)) if rows else not ms, ms
        if rows:
            assert any(silu for _, silu in calls) == (scheme != "gguf-q6_k") and not all(silu for _, silu in calls)
    for got, want in zip(runs[True], runs[False]):
        a, b = got.outputs[0], want.outputs[0]
        assert a.token_ids == b.token_ids
        for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < 0.05, (la[t], lb[t])


def _used(planes, m, k):
    """The part of a rows workspace's buffers that the operands of ``m`` rows fill (8 rows: the first half)."""
    r = 8 if m <= 8 else 16 if m <= 16 else 32
    n = k // 32
    return [planes[0].reshape(-1)[:n * 2 * r * 32]] + [t.reshape(-1)[:n * r] for t in planes[1:]]


@pytest.mark.parametrize("m", [2, 8, 11, 23])
def test_norm_rows_planes_is_add_rms_norm_and_the_rows_operands_of_its_output(m):
    """``norm_rows_planes``: the sum and the normed rows as ``add_rms_norm`` gives them (the normed rows
    within a bf16 unit on a GPU, a few on the CPU interpreter, whose casts truncate), and the rows'
    operands of that output bit for bit, the rows past M zeroed over a buffer's stale values."""
    from graphdsl.opdef import get_op
    from graphdsl.runtime.kernels.gguf_mma_rows import norm_rows_planes
    k = 512
    x, res = _x(m, k, torch.bfloat16, seed=30), _x(m, k, torch.bfloat16, seed=31)
    w = (1 + 0.2 * _x(1, k, torch.float32, seed=32)).to(torch.bfloat16)[0]
    out, s = torch.empty_like(x), torch.empty_like(x)
    stale = GemvWorkspace().rows_planes(x.device, k)
    for t in stale:
        t.fill_(7)
    planes = norm_rows_planes(x, res, w, 1e-5, out, s, stale)
    want_out, want_s = get_op("add_rms_norm").reference(x, res, w, eps=1e-5)
    torch.testing.assert_close(s.float(), want_s.float(), rtol=0 if DEV == "cuda" else 2 ** -7, atol=0)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2 ** -7 if DEV == "cuda" else 2 ** -5, atol=0)
    for got, want in zip(_used(planes, m, k), _used(rows_planes(out), m, k)):
        assert torch.equal(got, want)


def test_rows_gemv_reads_given_operands():
    """``gguf_gemv(..., planes=)`` with 2..16 rows: the rows' operands made before (here by
    ``rows_planes``) give the bits of the launch that makes its own, and skip that launch (operands of
    other rows, given on purpose, give those rows' product)."""
    data, _ = random_gguf_weight("Q4_K", 64, 512, seed=33)
    data = data.to(DEV)
    x, other = _x(5, 512, torch.bfloat16, seed=34), _x(5, 512, torch.bfloat16, seed=35)
    want = gguf_gemv(x, data, "Q4_K", config=_cfg(2))
    assert torch.equal(gguf_gemv(x, data, "Q4_K", config=_cfg(2), planes=rows_planes(x)), want)
    assert torch.equal(gguf_gemv(x, data, "Q4_K", config=_cfg(2), planes=rows_planes(other)),
                       gguf_gemv(other, data, "Q4_K", config=_cfg(2)))


def test_a_q4_k_m_model_takes_the_rows_operands_from_its_norms(monkeypatch):
    """A tiny model of the benchmark's Q4_K_M mix (``qkv_proj`` Q4_K rows then Q6_K ``v`` rows in some
    layers, ``MMA_MIN_ROWS`` lowered so every part runs the rows kernel) decoding 3 sequences, steps
    eager: with ``_NORM_PLANES`` the ``add_rms_norm`` before qkv and gate/up writes the rows' operands
    (``norm_rows_planes``; layer 0's first norm, with no residual, is a plain ``rms_norm``), so only
    o, down and layer 0's qkv parts make their own — against one launch a part without it; greedy
    tokens equal and their logprobs within 0.02."""
    import graphdsl as gd
    from graphdsl.runtime.backends import triton_backend as tb
    from graphdsl.runtime.kernels import gguf_mma_rows
    layers = 3
    llm = _mix_llm("gguf-q4_k_m", 4)
    monkeypatch.setattr(gguf_linear, "MMA_MIN_ROWS", 1)
    made, normed = [], []
    real_rows, real_norm = gguf_mma_rows.rows_planes, gguf_mma_rows.norm_rows_planes
    monkeypatch.setattr(gguf_mma_rows, "rows_planes", lambda x, *a: made.append(x.shape[0]) or real_rows(x, *a))
    monkeypatch.setattr(gguf_mma_rows, "norm_rows_planes",
                        lambda x, *a: normed.append(x.shape[0]) or real_norm(x, *a))
    params = gd.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [[5, 9, 2], [7, 1], [3, 3, 8, 4]]
    got, counts = {}, {}
    for on in (True, False):
        monkeypatch.setattr(tb, "_NORM_PLANES", on)
        made.clear(), normed.clear()
        got[on] = llm.generate(prompts, params, use_tqdm=False)
        counts[on] = (len(made), len(normed))
        assert made and all(2 <= m <= 16 for m in made + normed), (made, normed)
    forwards = 3                                    # the prefill of 9 rows and two decode steps of 3
    assert counts[True][1] == forwards * (2 * layers - 1), counts     # layer 0's first norm has no residual
    made_by_gemvs = (forwards * (2 * layers + 1), forwards * (2 * layers + 2))    # o, down, layer 0's qkv part(s)
    assert counts[True][0] in made_by_gemvs, counts
    assert counts[False][1] == 0 and counts[False][0] - counts[True][0] >= counts[True][1], counts
    for a, b in zip(got[True], got[False]):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < 0.02, (la[t], lb[t])


def _mix_llm(scheme, seqs):
    """A tiny 3-layer model of the benchmark's ``scheme`` mix (Q4_K_M or Q5_K_M: ``qkv_proj`` in two parts
    in some layers, ``v`` in Q6_K; or Q8_0), float16, steps eager on the Triton backend."""
    import pathlib
    import sys

    import graphdsl as gd
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    import quant
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=128,
               max_position_embeddings=256, rms_norm_eps=1e-5)
    with quant._GGUFMix():
        llm = gd.LLM.from_config(cfg, device=DEV, dtype="float16", seed=0, max_model_len=64, max_num_seqs=seqs,
                                 quantization=scheme, init_std=0.1)
    llm.model.configure_runtime(backend="triton", cuda_graphs=False, max_blocks_per_seq=4)
    return llm


@pytest.mark.parametrize("mix,qtype,switch,prompt", [("gguf-q5_k_m", "Q5_K", "_MMA_ROWS_Q5K", [5, 9, 2, 7]),
                                                      ("gguf-q8_0", "Q8_0", "_MMA_ROWS_Q8_0", [11, 7, 2])])
def test_a_q5_k_m_or_q8_0_model_decodes_one_row_on_the_rows_kernel(monkeypatch, mix, qtype, switch, prompt):
    """One sequence of a tiny Q5_K_M (Q8_0) model (``MMA_MIN_ROWS`` lowered): each decode step's Q5_K
    (Q8_0) parts run the rows kernel with one row (gate/up with its SwiGLU epilogue), an
    ``add_rms_norm`` before them writing their operands (``norm_rows_planes``) at least once; greedy
    tokens equal those with the type off the rows kernel (``switch``: one row's CUDA-core loop), their
    logprobs within 0.02. (The Q8_0 model's first token after ``[5, 9, 2, 7]`` is a near tie, 0.002
    apart, which the two correct paths break differently; after ``[11, 7, 2]`` each step's top two are
    0.3 or more apart.)"""
    import graphdsl as gd
    from graphdsl.runtime.kernels import gguf_mma_rows
    llm = _mix_llm(mix, 1)
    monkeypatch.setattr(gguf_linear, "MMA_MIN_ROWS", 1)
    calls, normed = [], []
    real, real_norm = gguf_linear.gguf_gemv_mma_rows, gguf_mma_rows.norm_rows_planes
    monkeypatch.setattr(gguf_linear, "gguf_gemv_mma_rows", lambda x, data, qtype, *a, **kw: calls.append(
        (x.shape[0], qtype, a[5] if len(a) > 5 else kw.get("silu_mul", False))) or real(x, data, qtype, *a, **kw))
    monkeypatch.setattr(gguf_mma_rows, "norm_rows_planes",
                        lambda x, *a: normed.append(x.shape[0]) or real_norm(x, *a))
    params = gd.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)
    got = {}
    for on in (True, False):
        monkeypatch.setattr(gguf_linear, switch, on)
        calls.clear(), normed.clear()
        got[on] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        ones = {(q, silu) for m, q, silu in calls if m == 1}
        if on:
            assert ones == {(qtype, True), (qtype, False)} and 1 in normed, (calls, normed)
        else:
            assert not [c for c in calls if c[1] == qtype] and 1 not in normed, (calls, normed)
    a, b = got[True], got[False]
    assert a.token_ids == b.token_ids
    for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids):
        assert abs(la[t].logprob - lb[t].logprob) < 0.02, (la[t], lb[t])


def test_rows_launch_by_type_at_16_rows():
    """``pick_rows_config``: up to 8 rows 32-row tiles of 2 warps, K split towards 12 programs a SM; at
    9-16 rows Q4_K and Q6_K take 64-row tiles (2 warps past 4 programs a SM), while Q5_K and Q8_0 keep
    32-row tiles of 2 warps (their H200 sweeps: Q8_0's gate 33.6 against 51.3 µs), Q5_K split towards
    5 programs a SM; 17-32 rows 64-row tiles split towards 1.5 programs a SM, Q8_0's of 2 warps towards 3
    (its 32-row sweep: gate 68.4 against 88.6 µs; 132 SMs, the 8B shapes)."""
    from graphdsl.runtime.kernels.gguf_mma_rows import pick_rows_config

    def launch(n, k, m, qtype):
        c = pick_rows_config(n, k, 132, m, qtype)
        return c["BLOCK_N"], c["num_warps"], c["SPLIT_K"]
    for qtype in ("Q4_K", "Q5_K", "Q6_K", "Q8_0"):
        assert launch(14336, 4096, 8, qtype) == (32, 2, 4)           # gate
        assert launch(4096, 14336, 1, qtype) == (32, 2, 16)          # down
    assert launch(14336, 4096, 16, "Q4_K") == (64, 4, 2)
    assert launch(6144, 4096, 16, "Q6_K") == (64, 2, 8)
    assert launch(14336, 4096, 16, "Q8_0") == (32, 2, 4)
    assert launch(4096, 14336, 16, "Q8_0") == (32, 2, 16)
    assert launch(6144, 4096, 16, "Q5_K") == (32, 2, 4)
    assert launch(14336, 4096, 16, "Q5_K") == (32, 2, 2)
    assert launch(4096, 14336, 16, "Q5_K") == (32, 2, 8)
    assert launch(14336, 4096, 32, "Q4_K") == (64, 4, 1)             # 17-32 rows: Q4_K's sweep
    assert launch(6144, 4096, 32, "Q4_K") == (64, 4, 4)
    assert launch(14336, 4096, 32, "Q8_0") == (64, 2, 2)
    assert launch(4096, 4096, 32, "Q8_0") == (64, 2, 8)
    assert launch(4096, 14336, 32, "Q8_0") == (64, 2, 8)


def test_q8_0_with_k_no_multiple_of_256_stays_off_the_rows_kernel(monkeypatch):
    """The rows kernel steps 256 inputs, so a Q8_0 weight whose K is no multiple of 256 (Qwen2.5-0.5B's
    896) keeps the CUDA-core loop for one row and a plane a dot for more, whose results are right; asked
    for the rows kernel by config, ``gguf_gemv`` names K."""
    from graphdsl.runtime.kernels.gguf_linear import on_rows_kernel
    monkeypatch.setattr(gguf_linear, "MMA_MIN_ROWS", 1)
    data, w = random_gguf_weight("Q8_0", 32, 288, seed=3)
    data = data.to(DEV)
    for m in (1, 3):
        x = _x(m, 288, torch.bfloat16, seed=m)
        assert not on_rows_kernel(x, data, "Q8_0") and not mma_eligible(x, data, "Q8_0")
        got = gguf_gemv(x, data, "Q8_0")
        want = x.float().cpu() @ w.T
        torch.testing.assert_close(got.float().cpu(), want, rtol=0, atol=2e-2 * want.abs().max().item())
    x256 = _x(3, 256, torch.bfloat16, seed=4)
    assert on_rows_kernel(x256, random_gguf_weight("Q8_0", 32, 256, seed=3)[0].to(DEV), "Q8_0")
    with pytest.raises(GraphDSLError, match=r"K a multiple of 256.* got 3 torch.bfloat16 rows of Q8_0, K=288"):
        gguf_gemv(_x(3, 288, torch.bfloat16, seed=2), data, "Q8_0", config=_cfg())


def test_decode_of_20_sequences_on_the_rows_kernel_when_asked(tmp_path, monkeypatch):
    """With ``ROWS_BY_DEFAULT`` 32 (the default; 16 is ``quant.py --gguf-rows-16``), a Q4_K model decoding 20
    sequences at once runs each projection on the rows kernel with 20 rows (four groups of 8, the
    RMSNorm writing the operands of qkv and gate/up), and its tokens and log-probabilities match the
    default's plane a dot within 0.05 (float16, as above)."""
    import graphdsl as gd
    import graphdsl.runtime.kernels.gguf_mma_rows as GR
    from tests.models.hf_tiny import make_checkpoint
    monkeypatch.setattr(gguf_linear, "MMA_MIN_ROWS", 1)
    calls, norms = [], []
    real, real_norm = gguf_linear.gguf_gemv_mma_rows, GR.norm_rows_planes
    monkeypatch.setattr(gguf_linear, "gguf_gemv_mma_rows", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    monkeypatch.setattr(GR, "norm_rows_planes", lambda x, *a: norms.append(x.shape[0]) or real_norm(x, *a))
    make_checkpoint("llama", tmp_path, hidden_size=256, intermediate_size=512)
    llm = gd.LLM(tmp_path, device=DEV, dtype="float16", max_model_len=32, max_num_seqs=20, quantization="gguf-q4_k")
    llm.model.configure_runtime(backend="triton", cuda_graphs=False, max_blocks_per_seq=2)
    params = gd.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [[1 + i % 7, 2 + i % 5] for i in range(20)]
    runs = {}
    for rows in (32, 16):
        monkeypatch.setattr(gguf_linear, "ROWS_BY_DEFAULT", rows)
        calls.clear(), norms.clear()
        runs[rows] = llm.generate(prompts, params, use_tqdm=False)
        assert (20 in calls and 20 in norms) if rows == 32 else (20 not in calls and 20 not in norms), (calls, norms)
    for got, want in zip(runs[32], runs[16]):
        a, b = got.outputs[0], want.outputs[0]
        assert a.token_ids == b.token_ids
        for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < 0.05, (la[t], lb[t])
