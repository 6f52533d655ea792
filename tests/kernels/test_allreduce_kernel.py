"""runtime/kernels/allreduce.py: the one-shot all-reduce (and its residual add + RMSNorm) against
torch, with the ranks of one process run one after another (tests/helpers/allreduce_ranks.py:
the rows and flags of the ranks not run yet are seeded). Their concurrent run (a stream each on one
GPU) is tests/gpu/test_allreduce_gpu.py.

The interpreter rounds float32 to bfloat16 toward zero (the GPU to nearest even), so bfloat16
results are held to torch's within one unit in the last place, and to each other exactly."""
import pytest
import torch

from graphdsl.runtime.kernels.allreduce import local_peers, one_shot_all_reduce
from tests.helpers.allreduce_ranks import run_in_turn

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("world, rows, width", [(2, 1, 64), (2, 3, 48), (3, 2, 32), (1, 2, 16)])
def test_sum_over_ranks_for_three_calls(world, rows, width):
    """Three calls in a row (both slots, then the first again) give every rank Σ_r x_r, in the
    dtype, the same bits on every rank; the epochs count the calls."""
    torch.manual_seed(0)
    peers = local_peers(world, 4 * 64, torch.bfloat16, DEV)
    for call in range(3):
        xs = [torch.randn(rows, width).bfloat16().to(DEV) for _ in range(world)]
        want = torch.stack([x.float() for x in xs]).sum(0)
        outs = [out for out, _ in run_in_turn(peers, xs)]
        for out in outs:
            torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=1e-6)
            assert torch.equal(out, outs[0]), call
    for me in peers:
        assert me.epoch[:rows].tolist() == [3] * rows and int(me.epoch[rows:].abs().sum()) == 0


def test_epochs_past_two_to_the_31_keep_summing():
    """A long-running server: after 2^31 calls (a day of 8B TP2 decode) the epochs go on counting
    and every call still waits for its peers' rows (an int32 epoch would wrap negative, take a slot
    of -1 and pass every flag test at once)."""
    torch.manual_seed(3)
    world, rows, width = 2, 2, 32
    peers = local_peers(world, rows * width, torch.bfloat16, DEV)
    start = 2 ** 31 - 2
    for me in peers:
        me.epoch.fill_(start)
        me._keep[1][0].fill_(start)          # every flag where the last call left it
        me._keep[1][1].fill_(start)
    for call in range(3):
        xs = [torch.randn(rows, width).bfloat16().to(DEV) for _ in range(world)]
        want = torch.stack([x.float() for x in xs]).sum(0)
        for out, _ in run_in_turn(peers, xs):
            torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=1e-6)
    for me in peers:
        assert me.epoch[:rows].tolist() == [start + 3] * rows


def test_residual_add_and_rms_norm_match_the_reference():
    """sum_out = Σ x + residual and out = rms_norm(sum_out, weight) as graphdsl's reference rounds
    them, on every rank."""
    torch.manual_seed(1)
    world, rows, width = 2, 2, 64
    peers = local_peers(world, rows * width, torch.bfloat16, DEV)
    weight = (1 + 0.1 * torch.randn(width)).bfloat16().to(DEV)
    for call in range(2):
        xs = [torch.randn(rows, width).bfloat16().to(DEV) for _ in range(world)]
        res = torch.randn(rows, width).bfloat16().to(DEV)
        y = torch.stack([x.float() for x in xs]).sum(0).bfloat16()
        s_want = y + res
        sums = [torch.empty(rows, width, dtype=torch.bfloat16, device=DEV) for _ in range(world)]
        outs = run_in_turn(peers, xs, residual=res, weight=weight, sum_out=sums, eps=1e-5)
        xf = s_want.float()
        ref = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
        for out, s in outs:
            torch.testing.assert_close(s.float(), s_want.float(), rtol=2 ** -6, atol=3e-2)
            torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -5, atol=3e-2)
            assert torch.equal(s, outs[0][1]) and torch.equal(out, outs[0][0]), call


def test_float32_rows_with_a_row_stride():
    """float32 rows that are views with a row stride (a slice of a wider tensor)."""
    torch.manual_seed(2)
    peers = local_peers(2, 64, torch.float32, DEV)
    wide = [torch.randn(2, 40, device=DEV) for _ in range(2)]
    xs = [w[:, :32] for w in wide]
    for out, _ in run_in_turn(peers, xs):
        torch.testing.assert_close(out, xs[0] + xs[1], rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, want", [
    (dict(x=torch.zeros(3)), "x and out must be \\[rows, width\\] alike, got \\[3\\]"),
    (dict(x=torch.zeros(2, 8, dtype=torch.float32)), "every tensor must be torch.bfloat16"),
    (dict(x=torch.zeros(2, 16, dtype=torch.bfloat16)[:, ::2]), "contiguous rows"),
    (dict(x=torch.zeros(9, 8, dtype=torch.bfloat16)), "9 rows of 8 exceed the buffers"),
    (dict(residual=torch.zeros(2, 8, dtype=torch.bfloat16)), "residual needs weight and sum_out too"),
])
def test_bad_calls_are_refused(kwargs, want):
    peers = local_peers(2, 64, torch.bfloat16, DEV)
    x = kwargs.pop("x", torch.zeros(2, 8, dtype=torch.bfloat16))
    out = torch.empty(x.shape, dtype=torch.bfloat16) if x.dim() == 2 else torch.empty(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=want):
        one_shot_all_reduce(x, peers[0], out, **kwargs)


def test_the_buffers_keep_their_first_row_width():
    """Row p must sit in the same place in every call (the two slots' safety holds program by
    program), so a call with rows of another width is refused; fewer or more rows are fine."""
    torch.manual_seed(3)
    peers = local_peers(2, 4 * 64, torch.bfloat16, DEV)
    for rows in (2, 4, 1):
        xs = [torch.randn(rows, 32).bfloat16().to(DEV) for _ in range(2)]
        outs = [out for out, _ in run_in_turn(peers, xs)]
        torch.testing.assert_close(outs[0].float(), xs[0].float() + xs[1].float(), rtol=2 ** -7, atol=1e-6)
    assert peers[0].width == 32 and peers[0].takes(32) and not peers[0].takes(64)
    with pytest.raises(ValueError, match="these buffers take rows of 32 \\(their first call's\\), got rows of 64"):
        one_shot_all_reduce(torch.zeros(1, 64, dtype=torch.bfloat16, device=DEV), peers[0],
                            torch.empty(1, 64, dtype=torch.bfloat16, device=DEV))
