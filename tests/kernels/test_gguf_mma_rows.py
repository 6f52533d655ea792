"""runtime/kernels/gguf_mma_rows.py: 2..16 rows of a Q4_K, Q5_K or Q6_K GEMV on the int8 tensor cores — the rows'
A operands and the sums against the dequantize-then-matmul reference (CPU interpreter here, compiled
on a GPU), the SwiGLU and carried-norm epilogues, and ``gguf_gemv``'s choice of it."""
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


@pytest.mark.parametrize("qtype,m", [("Q4_K", 9), ("Q4_K", 16), ("Q6_K", 12)])
def test_nine_to_sixteen_rows_hold_two_groups_of_eight(qtype, m):
    """9-16 rows (the default up to ``ROWS_BY_DEFAULT``): the rows' operands hold two groups of 8
    rows; the sums match the float32 reference within 1e-4 of the largest output, split-K included,
    and with SwiGLU (Q4_K) each output row matches the 8-row kernel's on the same rows."""
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
        halves = torch.cat([gguf_gemv(x[:8], data, qtype, silu_mul=True, config=_cfg(2)),
                            gguf_gemv(x[8:], data, qtype, silu_mul=True, config=_cfg(2))])
        torch.testing.assert_close(both.float(), halves.float(), rtol=2 ** -7, atol=1e-3 * halves.abs().max().item())


@pytest.mark.parametrize("qtype,m,split,dtype", [("Q6_K", 3, 1, torch.bfloat16), ("Q6_K", 8, 3, torch.float16),
                                                  ("Q5_K", 2, 1, torch.bfloat16), ("Q5_K", 13, 3, torch.float16)])
def test_q6k_and_q5k_rows_gemv_match_gguf_py_values(qtype, m, split, dtype):
    """Q6_K in the stored 224-byte layout, and Q5_K (``config MMA=True``; not the default until timed),
    odd N, K of 4 super-blocks (3 slices asked: slices of 2), a float32 output: within 1e-4 of the
    largest output of gguf-py's dequantized weight times x (Q5_K: every code's fifth bit included); a
    residual and block-major blocks through ``gguf_gemv`` give the same bits as stored rows."""
    from graphdsl.runtime.gguf_blocks import block_major
    data, ref = random_gguf_weight(qtype, 19, 1024, seed=4 if qtype == "Q6_K" else 7)
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


def test_gguf_gemv_takes_the_rows_kernel_for_2_to_16_q4k_rows(monkeypatch):
    """By default 2..16 fp16/bf16 rows of a Q4_K or Q6_K weight of at least ``MMA_MIN_ROWS`` rows run
    the rows kernel; one row, 17 rows (``ROWS_BY_DEFAULT``), Q5_K (``_MMA_ROWS_Q5K`` off: untimed),
    float32 rows and the switches off (``_MMA_ROWS_Q6K`` for Q6_K, ``_MMA_ROWS``) do not."""
    calls = []
    monkeypatch.setattr(gguf_linear, "gguf_gemv_mma_rows", lambda x, *a, **kw: calls.append((x.shape[0], a[1])) or a[3])
    monkeypatch.setattr(gguf_linear, "MMA_MIN_ROWS", 32)
    q4k, _ = random_gguf_weight("Q4_K", 32, 256, seed=1)
    q6k, _ = random_gguf_weight("Q6_K", 32, 256, seed=1)
    q5k, _ = random_gguf_weight("Q5_K", 32, 256, seed=1)
    q4k, q5k, q6k = q4k.to(DEV), q5k.to(DEV), to_stored(q6k, "Q6_K").to(DEV)
    for m in (2, 8, 16):
        gguf_gemv(_x(m, 256, torch.bfloat16, 1), q4k, "Q4_K")
        assert mma_eligible(_x(m, 256, torch.bfloat16, 1), q4k, "Q4_K")
    gguf_gemv(_x(12, 256, torch.bfloat16, 1), q6k, "Q6_K")
    assert calls == [(2, "Q4_K"), (8, "Q4_K"), (16, "Q4_K"), (12, "Q6_K")]
    gguf_gemv(_x(17, 256, torch.bfloat16, 1), q4k, "Q4_K")
    gguf_gemv(_x(4, 256, torch.bfloat16, 1), q5k, "Q5_K")
    assert not mma_eligible(_x(4, 256, torch.bfloat16, 1), q5k, "Q5_K")
    monkeypatch.setattr(gguf_linear, "_MMA_ROWS_Q5K", True)
    assert mma_eligible(_x(4, 256, torch.bfloat16, 1), q5k, "Q5_K")
    monkeypatch.setattr(gguf_linear, "_MMA_ROWS_Q5K", False)
    gguf_gemv(_x(4, 256, torch.float32, 1), q4k, "Q4_K")
    monkeypatch.setattr(gguf_linear, "_MMA_ROWS_Q6K", False)
    gguf_gemv(_x(4, 256, torch.bfloat16, 1), q6k, "Q6_K")
    monkeypatch.setattr(gguf_linear, "_MMA_ROWS", False)
    gguf_gemv(_x(4, 256, torch.bfloat16, 1), q4k, "Q4_K")
    assert len(calls) == 4


def test_rows_kernel_refuses_what_it_cannot_take():
    """Errors name the argument and what was given: one-row operands with several rows, more rows
    than the kernel holds, another type; a config for it must name the tile and the split."""
    data, _ = random_gguf_weight("Q4_K", 16, 256, seed=1)
    data = data.to(DEV)
    x = _x(4, 256, torch.bfloat16, seed=2)
    with pytest.raises(GraphDSLError, match=r"planes take one row .* 4 rows"):
        gguf_gemv(x, data, "Q4_K", config=_cfg(), planes=GemvWorkspace().planes(x.device, 256))
    with pytest.raises(GraphDSLError, match=r"2\.\.16 fp16/bf16 rows of Q4_K, Q5_K or Q6_K .* got 17"):
        gguf_gemv(_x(17, 256, torch.bfloat16, 2), data, "Q4_K", config=_cfg())
    with pytest.raises(GraphDSLError, match=r"takes BLOCK_N, SPLIT_K .* got \['BLOCK_N'\]"):
        gguf_gemv(x, data, "Q4_K", config=dict(MMA=True, BLOCK_N=16))
    with pytest.raises(GraphDSLError, match=r"silu_mul runs on the tensor-core paths only: 1\.\.16 .* got 17"):
        gguf_gemv(_x(17, 256, torch.bfloat16, 2), data, "Q4_K", silu_mul=True)


@pytest.mark.parametrize("scheme", ["gguf-q4_k", "gguf-q6_k", "gguf-q5_k"])
def test_batched_decode_of_a_gguf_model_runs_the_rows_kernel(tmp_path, monkeypatch, scheme):
    """A Q4_K (Q6_K; Q5_K with ``_MMA_ROWS_Q5K`` on) model decoding 3 sequences at once (``MMA_MIN_ROWS``
    lowered for the tiny shapes): its projections run the rows kernel (Q4_K's gate/up with its SwiGLU
    epilogue), the prefill of their 9 prompt tokens too (padded to 16 rows on a GPU), and each token's
    log-probability matches the run with 2..16 rows a plane a dot (``_MMA_ROWS`` off), token for token,
    within 0.05. float16 activations: the planes path rounds each dequantized weight to the activation
    type, and with bfloat16 the two correct paths differed by up to 0.033 on the CPU and 0.12 on a GPU
    (float16 on the CPU: 0.006)."""
    import graphdsl as gd
    from tests.models.hf_tiny import make_checkpoint
    monkeypatch.setattr(gguf_linear, "MMA_MIN_ROWS", 1)
    monkeypatch.setattr(gguf_linear, "_MMA_ROWS_Q5K", True)
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
            assert any(silu for _, silu in calls) == (scheme == "gguf-q4_k") and not all(silu for _, silu in calls)
    for got, want in zip(runs[True], runs[False]):
        a, b = got.outputs[0], want.outputs[0]
        assert a.token_ids == b.token_ids
        for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < 0.05, (la[t], lb[t])
