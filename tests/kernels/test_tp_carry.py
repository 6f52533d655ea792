"""runtime/kernels/tp_carry.py through gemv(push=, tp_in=): the all-reduce carried by the GEMVs
around it gives every rank the bits of today's chain (GEMV, one-shot all-reduce + add + RMSNorm,
GEMV), over calls that cross both slots, change their row count and their tiling. Ranks run one
after another under the interpreter: every rank's producer first, so no consumer waits for a rank
that has not run (the GPU runs them at once: tests/gpu/test_allreduce_gpu.py)."""
import pytest
import torch

from graphdsl.runtime.kernels.allreduce import local_peers
from graphdsl.runtime.kernels.gemv import GemvPush, GemvTPIn, gemv
from graphdsl.runtime.kernels.tp_carry import local_carry_buffers
from tests.helpers.allreduce_ranks import run_in_turn

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF = dict(dtype=torch.bfloat16, device=DEV)
H, K_IN, N_OUT, EPS = 64, 48, 40, 1e-5


def _chain(xs, w1, w2, res, g, peers, silu_mul=False):
    """Today's chain on every rank: y_r = x_r @ w1_r.T; one-shot sum + residual + norm; normed @ w2_r.T."""
    ys = [gemv(x, w) for x, w in zip(xs, w1)]
    sums = [torch.empty_like(res) for _ in xs]
    normed = run_in_turn(peers, ys, residual=res, weight=g, sum_out=sums, eps=EPS)
    return [(gemv(n, w, silu_mul=silu_mul), s) for (n, s), w in zip(normed, w2)]


def _carried(xs, w1, w2, res, g, bufs, silu_mul=False, config=None):
    """The carried chain: every rank's producer pushes, then every rank's consumer sums and runs."""
    for x, w, b in zip(xs, w1, bufs):
        gemv(x, w, push=GemvPush(b), config=config)
    outs = []
    for w, b in zip(w2, bufs):
        rows = torch.empty(res.shape, **BF)
        s = torch.empty_like(res)
        outs.append((gemv(rows, w, silu_mul=silu_mul, tp_in=GemvTPIn(b, res, g, s, EPS)), s))
    return outs


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_carried_chain_equals_the_one_shot_chain(world, silu_mul):
    torch.manual_seed(world)
    w1 = [torch.randn(H, K_IN).mul(0.1).to(**BF) for _ in range(world)]
    w2 = [torch.randn(2 * N_OUT if silu_mul else N_OUT, H).mul(0.1).to(**BF) for _ in range(world)]
    g = torch.rand(H).add(0.5).to(**BF)
    peers = local_peers(world, 4 * H, torch.bfloat16, DEV)
    bufs = local_carry_buffers(world, 4 * H, torch.bfloat16, DEV)
    # rows change from call to call; the producer's tiling too (split-K on the second call)
    for call, (m, config) in enumerate([(1, None), (3, dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=3)), (2, None),
                                        (1, dict(BLOCK_N=32, BLOCK_K=16, SPLIT_K=1))], start=1):
        xs = [torch.randn(m, K_IN).to(**BF) for _ in range(world)]
        res = torch.randn(m, H).to(**BF)
        want = _chain(xs, w1, w2, res, g, peers, silu_mul)
        got = _carried(xs, w1, w2, res, g, bufs, silu_mul, config)
        for r, ((out, s), (out_w, s_w)) in enumerate(zip(got, want)):
            assert torch.equal(s, s_w), (call, r)
            assert torch.equal(out, out_w), (call, r)
        for b in bufs:
            assert b.calls.tolist() == [call, call]
            assert int(b.counter[0]) == call * H * world          # every rank's columns of every call


def test_the_sum_matches_torch():
    """Against a float reference with the GEMVs' and the norm's roundings (the interpreter rounds
    float32 to bfloat16 toward zero: one unit in the last place)."""
    torch.manual_seed(5)
    world, m = 2, 2
    w1 = [torch.randn(H, K_IN).mul(0.1).to(**BF) for _ in range(world)]
    w2 = [torch.randn(N_OUT, H).mul(0.1).to(**BF) for _ in range(world)]
    g = torch.rand(H).add(0.5).to(**BF)
    xs = [torch.randn(m, K_IN).to(**BF) for _ in range(world)]
    res = torch.randn(m, H).to(**BF)
    got = _carried(xs, w1, w2, res, g, local_carry_buffers(world, 4 * H, torch.bfloat16, DEV))
    y = sum((x.float() @ w.float().T).bfloat16().float() for x, w in zip(xs, w1))
    s = (y.bfloat16().float() + res.float()).bfloat16()
    sf = s.float()
    normed = (g.float() * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + EPS)).bfloat16().float()).bfloat16()
    for (out, s_got), w in zip(got, w2):
        torch.testing.assert_close(s_got.float(), s.float(), rtol=2 ** -6, atol=3e-2)
        torch.testing.assert_close(out.float(), (normed.float() @ w.float().T), rtol=3e-2, atol=3e-2)


def test_bad_carries_are_refused():
    bufs = local_carry_buffers(2, 2 * H, torch.bfloat16, DEV)
    x, w = torch.zeros(1, K_IN, **BF), torch.zeros(H, K_IN, **BF)
    with pytest.raises(Exception, match="push takes a plain product"):
        gemv(x, w, torch.zeros(1, H, **BF), push=GemvPush(bufs[0]))
    with pytest.raises(ValueError, match="3 rows of 64 exceed a region"):
        gemv(torch.zeros(3, K_IN, **BF), w, push=GemvPush(bufs[0]))
    with pytest.raises(ValueError, match="carry buffers hold torch.bfloat16"):
        gemv(x.float().half(), w.half(), push=GemvPush(bufs[0]))
    rows, res = torch.zeros(1, H, **BF), torch.zeros(1, H, **BF)
    with pytest.raises(ValueError, match="residual must be \\[1, 64\\]"):
        gemv(rows, torch.zeros(N_OUT, H, **BF), tp_in=GemvTPIn(bufs[0], res[:, :32], res[0], res, EPS))
    with pytest.raises(ValueError, match="weight must be a contiguous \\[64\\]"):
        gemv(rows, torch.zeros(N_OUT, H, **BF), tp_in=GemvTPIn(bufs[0], res, res[0, :32], res, EPS))
    with pytest.raises(ValueError, match="sum_out must be \\[1, 64\\]"):
        gemv(rows, torch.zeros(N_OUT, H, **BF), tp_in=GemvTPIn(bufs[0], res, res[0], res[:, :32], EPS))
    res2 = torch.zeros(2, H, **BF)
    with pytest.raises(ValueError, match="the rows it makes \\(x\\) must be contiguous"):
        gemv(torch.zeros(2, 2 * H, **BF)[:, :H], torch.zeros(N_OUT, H, **BF),
             tp_in=GemvTPIn(bufs[0], res2, res[0], res2, EPS))
    tp_in = GemvTPIn(bufs[0], res, res[0], res, EPS)
    with pytest.raises(ValueError, match="push and tp_in belong to two GEMVs"):
        gemv(rows, torch.zeros(H, H, **BF), push=GemvPush(bufs[0]), tp_in=tp_in)
    from graphdsl.runtime.kernels.gemv import GemvRmsIn
    with pytest.raises(Exception, match="tp_in makes the rows itself \\(no xpack or rms_in\\)"):
        gemv(rows, torch.zeros(N_OUT, H, **BF), tp_in=tp_in,
             rms_in=GemvRmsIn(torch.zeros(1, 2, dtype=torch.float32, device=DEV), H, EPS))


@pytest.mark.parametrize("scheme", ["int4-g64", "int4-g64-zp", "int8-channel", "fp8-channel"])
@pytest.mark.parametrize("m", [1, 2])
def test_quantized_producers_and_consumers(scheme, m):
    """Weight-only quantized projections on both sides (the rows of a one-row int4 consumer are read
    by its integer-dot loop): the carried chain still gives the one-shot chain's bits."""
    from graphdsl.quant import parse_scheme
    s = parse_scheme(scheme)
    world, k_in = 2, 64
    torch.manual_seed(11)
    q1 = [[t.to(DEV) for t in s.quantize(torch.randn(H, k_in) * 0.1, torch.bfloat16)] for _ in range(world)]
    q2 = [[t.to(DEV) for t in s.quantize(torch.randn(2 * N_OUT, H) * 0.1, torch.bfloat16)] for _ in range(world)]

    def kw(q):
        return dict(scheme=s, scales=q[1], zeros=q[2] if len(q) > 2 else None)
    g = torch.rand(H).add(0.5).to(**BF)
    peers = local_peers(world, 4 * H, torch.bfloat16, DEV)
    bufs = local_carry_buffers(world, 4 * H, torch.bfloat16, DEV)
    for call in range(2):
        xs = [torch.randn(m, k_in).to(**BF) for _ in range(world)]
        res = torch.randn(m, H).to(**BF)
        ys = [gemv(x, q[0], **kw(q)) for x, q in zip(xs, q1)]
        sums = [torch.empty_like(res) for _ in range(world)]
        normed = run_in_turn(peers, ys, residual=res, weight=g, sum_out=sums, eps=EPS)
        want = [gemv(n, q[0], silu_mul=True, **kw(q)) for (n, _), q in zip(normed, q2)]
        for x, q, b in zip(xs, q1, bufs):
            gemv(x, q[0], push=GemvPush(b), **kw(q))
        for r, (q, b) in enumerate(zip(q2, bufs)):
            rows, s_got = torch.empty(m, H, **BF), torch.empty(m, H, **BF)
            out = gemv(rows, q[0], silu_mul=True, tp_in=GemvTPIn(b, res, g, s_got, EPS), **kw(q))
            assert torch.equal(s_got, sums[r]) and torch.equal(out, want[r]), (call, r)
