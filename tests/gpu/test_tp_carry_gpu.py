"""The all-reduce carried by two GEMVs (runtime/kernels/tp_carry.py) with its ranks running at once
(``pytest -m gpu``): the ranks of one process on one GPU, each on its own stream (every producer
enqueued, then every consumer), over buffers in that GPU's memory, so a consumer really polls a counter another
stream's producer raises. The ranks first run in turn (every producer, then every consumer), which
compiles and loads the kernels. The sum ``s`` is exact against torch (the pushed tiles are the
plain GEMV's bits); the consumer's product within bfloat16's rounding (its norm sums in another
order)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():      # before the kernel imports (tests/kernels' conftest: TRITON_INTERPRET)
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from graphdsl.runtime.kernels.gemv import GemvPush, GemvTPIn, gemv  # noqa: E402
from graphdsl.runtime.kernels.tp_carry import local_carry_buffers  # noqa: E402

DEV = torch.device("cuda")
H, K_IN, N_OUT, EPS = 4096, 2048, 7168, 1e-5


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_at_once_over_many_calls(world):
    torch.manual_seed(0)
    bf = dict(dtype=torch.bfloat16, device=DEV)
    w1 = [torch.randn(H, K_IN, **bf) / 32 for _ in range(world)]
    w2 = [torch.randn(2 * N_OUT, H, **bf) / 64 for _ in range(world)]
    g = (1 + 0.1 * torch.randn(H, device=DEV)).bfloat16()
    bufs = local_carry_buffers(world, 4 * H, torch.bfloat16, DEV)
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(world)]
    for call in range(30):
        m = 1 + call % 4
        xs = [torch.randn(m, K_IN, **bf) for _ in range(world)]
        res = torch.randn(m, H, **bf)
        rows = [torch.empty(m, H, **bf) for _ in range(world)]
        sums = [torch.empty(m, H, **bf) for _ in range(world)]
        outs = [torch.empty(m, N_OUT, **bf) for _ in range(world)]
        if call == 0:                          # compile and load: producers, then consumers, in turn
            for r in range(world):
                gemv(xs[r], w1[r], push=GemvPush(bufs[r]))
            for r in range(world):
                gemv(rows[r], w2[r], silu_mul=True, out=outs[r], tp_in=GemvTPIn(bufs[r], res, g, sums[r], EPS))
        else:
            for r in reversed(range(world)):    # producers first: one spinning consumer of every SM's
                streams[r].wait_stream(main)     # slots could keep another rank's producer from running
                with torch.cuda.stream(streams[r]):
                    gemv(xs[r], w1[r], push=GemvPush(bufs[r]))
            for r in range(world):
                with torch.cuda.stream(streams[r]):
                    gemv(rows[r], w2[r], silu_mul=True, out=outs[r], tp_in=GemvTPIn(bufs[r], res, g, sums[r], EPS))
            for st in streams:
                main.wait_stream(st)
        torch.cuda.synchronize()
        y = sum(gemv(x, w).float() for x, w in zip(xs, w1)).bfloat16()
        s = (y.float() + res.float()).bfloat16()
        sf = s.float()
        normed = (g.float() * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + EPS)).bfloat16().float()).bfloat16()
        for r in range(world):
            assert torch.equal(sums[r], s), (call, r)
            torch.testing.assert_close(rows[r].float(), normed.float(), rtol=2 ** -6, atol=1e-2)
            want = gemv(rows[r], w2[r], silu_mul=True)
            assert torch.equal(outs[r], want), (call, r)
    for b in bufs:
        assert b.calls.tolist() == [30, 30] and int(b.counter[0]) == 30 * H * world
