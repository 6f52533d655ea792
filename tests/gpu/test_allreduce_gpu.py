"""The one-shot all-reduce kernel with its ranks running at once (run with ``pytest -m gpu``): the
ranks of one process on one GPU, each on its own stream, over buffers in that GPU's memory, so the
flags really are written by one running kernel and polled by another. Each test first runs the
ranks in turn (tests/helpers/allreduce_ranks.py), which compiles and loads every rank's kernel: a
module load while another rank's kernel spins could wait for that kernel. Sums are exact against torch
(float32 sum, rounded to nearest); the norm within a unit of bfloat16 (its mean is summed in
another order)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():      # before the kernel imports: without CUDA, tests/kernels' conftest must
    pytest.skip("needs a CUDA GPU", allow_module_level=True)   # set TRITON_INTERPRET before they decorate

from graphdsl.runtime.kernels.allreduce import local_peers, one_shot_all_reduce  # noqa: E402
from tests.helpers.allreduce_ranks import run_in_turn  # noqa: E402

DEV = torch.device("cuda")


def _launch_all(peers, xs, outs, norm=None):
    """Every rank's call on its own stream, the last rank first; returns after all finished."""
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in peers]
    for r in reversed(range(len(peers))):
        s = streams[r]
        s.wait_stream(main)
        with torch.cuda.stream(s):
            kw = {} if norm is None else dict(residual=norm[0], weight=norm[1], sum_out=norm[2][r], eps=1e-5)
            one_shot_all_reduce(xs[r], peers[r], outs[r], **kw)
    for s in streams:
        main.wait_stream(s)
    torch.cuda.synchronize()


@pytest.mark.parametrize("world, rows, width", [(2, 1, 4096), (2, 64, 4096), (4, 3, 2048), (2, 5, 3000)])
def test_ranks_at_once_sum_exactly_over_many_calls(world, rows, width):
    torch.manual_seed(0)
    peers = local_peers(world, 64 * 4096, torch.bfloat16, DEV)
    run_in_turn(peers, [torch.zeros(rows, width, dtype=torch.bfloat16, device=DEV)] * world)   # compile, load
    for call in range(40):
        xs = [torch.randn(rows, width, device=DEV).bfloat16() for _ in range(world)]
        outs = [torch.empty_like(x) for x in xs]
        _launch_all(peers, xs, outs)
        want = torch.stack([x.float() for x in xs]).sum(0).bfloat16()
        for out in outs:
            assert torch.equal(out, want), call
    assert all(int(p.epoch[:rows].min()) == 41 for p in peers)


def test_residual_add_and_norm_at_once():
    torch.manual_seed(1)
    world, rows, width = 2, 4, 4096
    peers = local_peers(world, rows * width, torch.bfloat16, DEV)
    weight = (1 + 0.1 * torch.randn(width, device=DEV)).bfloat16()
    zeros = [torch.zeros(rows, width, dtype=torch.bfloat16, device=DEV)] * world
    run_in_turn(peers, zeros, residual=zeros[0], weight=weight, sum_out=[torch.empty_like(z) for z in zeros],
                eps=1e-5)                                                   # compile and load both ranks' kernels
    for call in range(10):
        xs = [torch.randn(rows, width, device=DEV).bfloat16() for _ in range(world)]
        res = torch.randn(rows, width, device=DEV).bfloat16()
        outs = [torch.empty_like(x) for x in xs]
        sums = [torch.empty_like(x) for x in xs]
        _launch_all(peers, xs, outs, norm=(res, weight, sums))
        s_want = torch.stack([x.float() for x in xs]).sum(0).bfloat16() + res
        sf = s_want.float()
        n_want = weight * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
        for out, s in zip(outs, sums):
            assert torch.equal(s, s_want), call
            torch.testing.assert_close(out.float(), n_want.float(), rtol=2 ** -7, atol=1e-3)
        assert torch.equal(outs[0], outs[1])


def test_calls_replayed_from_one_cuda_graph_advance_their_epochs():
    """Both ranks' calls captured in one graph (a stream each) and replayed: the epochs live in
    device memory, so every replay takes the next slot and the flags keep matching."""
    torch.manual_seed(2)
    world, rows, width = 2, 2, 4096
    peers = local_peers(world, rows * width, torch.bfloat16, DEV)
    xs = [torch.randn(rows, width, device=DEV).bfloat16() for _ in range(world)]
    outs = [torch.empty_like(x) for x in xs]
    run_in_turn(peers, xs)                           # compile and load outside the capture
    _launch_all(peers, xs, outs)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cap = torch.cuda.current_stream()
        streams = [torch.cuda.Stream() for _ in range(world)]
        for r in reversed(range(world)):
            streams[r].wait_stream(cap)
            with torch.cuda.stream(streams[r]):
                one_shot_all_reduce(xs[r], peers[r], outs[r])
        for s in streams:
            cap.wait_stream(s)
    for call in range(20):
        for x in xs:
            x.copy_(torch.randn(rows, width, device=DEV))
        g.replay()
        torch.cuda.synchronize()
        want = (xs[0].float() + xs[1].float()).bfloat16()
        assert torch.equal(outs[0], want) and torch.equal(outs[1], want), call
    assert int(peers[0].epoch[0]) == 22 and int(peers[1].epoch[1]) == 22
