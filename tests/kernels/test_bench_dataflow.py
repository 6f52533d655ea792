"""benchmarks/dataflow.py: the tile queue computes persistent.py's layers (one program under the
interpreter takes every tile in order, so each wait finds its projection finished), counts every
tile of every projection, and the script names what was wrong in bad arguments."""
import pytest
import torch

from tests.helpers import benchmarks


@pytest.mark.parametrize("block_n, block_k, stages, narrow", [(16, 32, 2, 0), (16, 16, 2, 1), (8, 32, 3, 0)])
def test_two_layers_match_the_persistent_chain_and_the_reference(block_n, block_k, stages, narrow):
    """Two layers of a tiny shape (98 qkv rows: masked tails): the same bits as persistent.py's
    barrier chain with the same tiles, and within bf16 rounding of the float32 reference."""
    mod = benchmarks.load("dataflow")
    torch.manual_seed(0)
    lay = mod.Layers((64, 98, 96), 2, "cpu")
    lay.reset()
    lay.persistent(1, block_n, block_k, 4, stages, narrow=narrow)
    chain = lay.h.clone()
    lay.reset()
    done = mod.run_queue(lay, 1, block_n, block_k, 4, stages, narrow=narrow)
    torch.testing.assert_close(lay.h, chain, rtol=0, atol=0)
    torch.testing.assert_close(lay.h, lay.reference(), rtol=2e-2, atol=2e-2)
    per_layer = list(mod.tiles_per_layer((64, 98, 96), block_n, narrow))
    assert done.tolist() == per_layer * 2 + [sum(per_layer) * 2 + 1]   # + the one ticket that found the queue empty
    assert (lay.h - lay.h0).abs().max() > 0.1


def test_tiles_per_layer_rounds_up_and_halves_o_and_down():
    mod = benchmarks.load("dataflow")
    assert mod.tiles_per_layer((4096, 6144, 14336), 64, 0) == (96, 64, 448, 64)
    assert mod.tiles_per_layer((4096, 6144, 14336), 64, 1) == (96, 128, 448, 128)
    assert mod.tiles_per_layer((64, 98, 96), 16, 0) == (7, 4, 12, 4)


@pytest.mark.parametrize("kwargs, want", [
    (dict(block_k=48), "BLOCK_K must divide the hidden size 64 and the intermediate size 96, got 48"),
    (dict(block_n=2, block_k=16, narrow=1), "BLOCK_N must be at least 4, got 2"),
    (dict(stages=0), "STAGES must be at least 1, got 0"),
    (dict(ahead=3), "must be a power of two covering at least one 128-byte line \\(ahead x BLOCK_K >= 64\\), "
                    "got 3 with BLOCK_K 32"),
])
def test_bad_tiles_are_refused(kwargs, want):
    mod = benchmarks.load("dataflow")
    lay = mod.Layers((64, 98, 96), 1, "cpu")
    args = dict(block_n=16, block_k=32, stages=2, narrow=0, ahead=2) | kwargs
    with pytest.raises(ValueError, match=want):
        mod.run_queue(lay, 1, args["block_n"], args["block_k"], 4, args["stages"], narrow=args["narrow"],
                      ahead=args["ahead"])


def test_without_a_gpu_it_exits_2(capsys, monkeypatch):
    benchmarks.exits_without_gpu("dataflow", ["--layers", "2"], capsys, monkeypatch)


@pytest.mark.parametrize("argv, want", [
    (["--configs", "16x512"], "expected BLOCK_NxBLOCK_KxWARPS[xSTAGES] like 16x512x8 or 32x256x4x5, got '16x512'"),
    (["--backoff", "-1"], "expected comma-separated integers >= 0, got '-1'"),
    (["--shapes", "70b"], "expected names from ['1b', '8b'], got '70b'"),
])
def test_bad_arguments_are_named(argv, want, capsys):
    assert want in benchmarks.refusal("dataflow", argv, capsys)
