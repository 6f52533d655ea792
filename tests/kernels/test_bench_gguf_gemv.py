"""benchmarks/gguf_gemv.py's tensor-core sweep: every launch it times is one ``gguf_gemv`` takes
(checked on the CPU interpreter on a small Q4_K weight: the launch runs and gives the default
launch's sums within the activation rounding), and the grid spans what ``pick_mma_config`` picks."""
import pytest
import torch

from tests.helpers import benchmarks
from tests.helpers.gguf_blocks import random_gguf_weight

pytest.importorskip("gguf")


def test_the_tensor_core_sweep_covers_the_rule_and_runs():
    from graphdsl.runtime.kernels.gguf_linear import gguf_gemv
    from graphdsl.runtime.kernels.gguf_mma import pick_mma_config
    bench = benchmarks.load("gguf_gemv")
    cfgs = list(bench.sweep_mma_configs())
    assert len(cfgs) == 72 and all(c["MMA"] for c in cfgs)
    rule = pick_mma_config(4096, 4096, 132)
    assert any(all(c[key] == v for key, v in rule.items()) for c in cfgs)
    data, _ = random_gguf_weight("Q4_K", 64, 512, seed=3)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = gguf_gemv(x, data, "Q4_K", config=dict(MMA=True, BLOCK_N=64, SPLIT_K=1)).float()
    for c in (cfgs[0], cfgs[-1]):            # 32-row tiles, one slice; 128-row tiles, 8 warps, 4 stages, 8 slices
        got = gguf_gemv(x, data, "Q4_K", config=c).float()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item())


def test_busiest_sm_tiles_bracket_the_multiples_of_the_sms():
    """``--busiest-sm`` times one to four programs a SM and tiles just under, at and just over three
    a SM, where one tile more adds a program to ten SMs."""
    tiles = benchmarks.load("gguf_gemv").busiest_sm_tiles(132)
    assert tiles == sorted(tiles) and tiles[0] == 132 and tiles[-1] == 4 * 132
    assert {3 * 132 - 10, 3 * 132, 3 * 132 + 10} <= set(tiles)
