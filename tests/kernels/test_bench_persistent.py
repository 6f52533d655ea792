"""benchmarks/persistent.py: the persistent chain computes its docstring's layers (one program under
the interpreter, so every barrier is met by the program itself), and the script refuses bad
arguments and a machine without a GPU with messages naming what was wrong."""
import pytest
import torch

from tests.helpers import benchmarks


@pytest.mark.parametrize("block_n, block_k, stages, narrow", [(4, 32, 0, 0), (8, 32, 0, 0), (16, 32, 2, 0),
                                                              (8, 16, 0, 1), (16, 16, 2, 1)])
def test_two_layers_match_the_float32_reference(block_n, block_k, stages, narrow):
    """Two layers of a tiny shape (98 qkv rows: masked tails), against the
    module's torch reference, which rounds to bf16 where the kernel stores bf16."""
    mod = benchmarks.load("persistent")
    torch.manual_seed(0)
    lay = mod.Layers((64, 98, 96), 2, "cpu")
    lay.reset()
    lay.persistent(1, block_n, block_k, 4, stages, narrow=narrow)
    want = lay.reference()
    torch.testing.assert_close(lay.h, want, rtol=2e-2, atol=2e-2)
    assert lay.counts.tolist() == [1] * 8           # every barrier counted the one program once
    assert (lay.h - lay.h0).abs().max() > 0.1       # the layers changed the residual


def test_rows_are_shared_in_whole_units():
    mod = benchmarks.load("persistent")
    got = [mod._rows_of.fn(p, 3, 10, 2) for p in range(3)]  # 5 gate/up pairs over 3 programs
    assert got == [(0, 2), (2, 6), (6, 10)]


def test_without_a_gpu_it_exits_2(capsys, monkeypatch):
    benchmarks.exits_without_gpu("persistent", ["--layers", "2"], capsys, monkeypatch)


@pytest.mark.parametrize("argv, want", [
    (["--configs", "16x500x8"], "BLOCK_K must be a power of two, got 500 in '16x500x8'"),
    (["--configs", "16x512"], "expected BLOCK_NxBLOCK_KxWARPS[xSTAGES] like 16x512x8 or 32x256x4x5, got '16x512'"),
    (["--shapes", "70b"], "expected names from ['1b', '8b'], got '70b'"),
    (["--layers", "0"], "expected an integer >= 1, got '0'"),
    (["--per-sm", "1,x"], "expected comma-separated integers >= 1, got '1,x'"),
    (["--narrow", "2"], "expected comma-separated integers from 0 to 1, got '2'"),
    (["--poll", "spin"], "expected names from ['atomic', 'load'], got 'spin'"),
])
def test_bad_arguments_are_named(argv, want, capsys):
    assert want in benchmarks.refusal("persistent", argv, capsys)


def test_barrier_spread_reads_arrivals_and_departures():
    """Two layers, three programs, readings in ns: projection j's programs arrive at 1000·j + (0,
    100, 400) and all leave at 1000·j + 600. Then every stream (median arrival - median departure
    before) is 1000 + 100 - 600 = 500 ns, the spread 400, last - median 300, release 200 (µs / 1000)."""
    mod = benchmarks.load("persistent")
    times = torch.zeros(8, 3, 2, dtype=torch.int64)
    for j in range(8):
        times[j, :, 0] = torch.tensor([0, 100, 400]) + 1000 * j
        times[j, :, 1] = 1000 * j + 600
    got = mod.barrier_spread(times)
    assert set(got) == {"qkv", "o", "gate_up", "down"}
    for proj, vals in got.items():
        assert vals == pytest.approx((0.5, 0.4, 0.3, 0.2)), proj
