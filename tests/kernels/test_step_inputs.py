"""runtime/kernels/step_inputs.py (the decode graph's prologue) vs the torch code it replaces:
``RotaryEmbedding.cos_sin`` and ``decode_slots``. On CPU under Triton's interpreter (cos/sin within
an ulp: numpy's); with CUDA compiled, where the tables must be the torch path's bits."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from graphdsl.errors import GraphDSLError  # noqa: E402
from graphdsl.layers import RopeScaling, RopeType, RotaryEmbedding  # noqa: E402
from graphdsl.runtime.kernels.step_inputs import decode_step_inputs  # noqa: E402
from graphdsl.runtime.serving.kv_cache import decode_slots  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

ROTARIES = {
    "default-64": RotaryEmbedding(64, 500000.0, 131072),
    "llama3-128": RotaryEmbedding(128, 500000.0, 131072, RopeScaling(
        rope_type=RopeType.LLAMA3, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)),
    "yarn-partial": RotaryEmbedding(96, 10000.0, 4096, RopeScaling(
        rope_type=RopeType.YARN, factor=4.0, original_max_position_embeddings=1024), rotary_dim=48),
}


def _case(rows: int, width: int, block_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, width * block_size + 1, (rows,), generator=g)
    seq_lens[::3] = 0                                     # padding rows of a graph bucket
    positions = torch.where(seq_lens > 0, seq_lens - 1, 0)
    tables = torch.randperm(rows * width * 2, generator=g)[: rows * width].reshape(rows, width).to(torch.int32)
    return positions.to(DEVICE), tables.to(DEVICE), seq_lens.to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("name", list(ROTARIES))
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_tables_and_slots_match_the_torch_prologue(name, rows):
    rotary = ROTARIES[name]
    positions, tables, seq_lens = _case(rows, width=9, block_size=16, seed=rows)
    positions[-1] = 131071 if rows > 1 else positions[-1]     # a large angle: where a fast cos would drift
    inv, scale = rotary.device_inv_freq(positions.device)
    got = decode_step_inputs(positions, inv_freq=inv, scale=scale, block_tables=tables, seq_lens=seq_lens,
                             block_size=16)
    cos, sin = rotary.cos_sin(positions)
    if CUDA:                                              # libdevice cosf / sinf: the bits torch makes
        assert torch.equal(got["cos"], cos) and torch.equal(got["sin"], sin)
    else:
        torch.testing.assert_close(got["cos"], cos, rtol=0, atol=2e-6)
        torch.testing.assert_close(got["sin"], sin, rtol=0, atol=2e-6)
    want = decode_slots(positions, tables, seq_lens, 16)
    assert got["slot_mapping"].dtype == positions.dtype and torch.equal(got["slot_mapping"], want)
    assert (got["slot_mapping"][seq_lens == 0] == -1).all()


def test_slots_alone_and_tables_alone():
    positions, tables, seq_lens = _case(6, width=4, block_size=32)
    only_slots = decode_step_inputs(positions, block_tables=tables, seq_lens=seq_lens, block_size=32)
    assert set(only_slots) == {"slot_mapping"}
    assert torch.equal(only_slots["slot_mapping"], decode_slots(positions, tables, seq_lens, 32))
    inv, _ = ROTARIES["default-64"].device_inv_freq(positions.device)
    only_rope = decode_step_inputs(positions, inv_freq=inv)
    assert set(only_rope) == {"cos", "sin"} and only_rope["cos"].shape == (6, 32)
    # a position past the table's width (a sequence longer than the graph's block table) clamps as decode_slots does
    positions[1] = 4 * 32 + 5
    seq_lens[1] = 4 * 32 + 6
    clamped = decode_step_inputs(positions, block_tables=tables, seq_lens=seq_lens, block_size=32)
    assert torch.equal(clamped["slot_mapping"], decode_slots(positions, tables, seq_lens, 32))


def test_bad_arguments_are_named():
    positions, tables, seq_lens = _case(4, width=3, block_size=16)
    with pytest.raises(GraphDSLError, match="give inv_freq"):
        decode_step_inputs(positions)
    with pytest.raises(GraphDSLError, match="positions must be an integer tensor"):
        decode_step_inputs(positions.float(), block_tables=tables, seq_lens=seq_lens, block_size=16)
    with pytest.raises(GraphDSLError, match=r"seq_lens must be an integer tensor \[4\], got \(3,\)"):
        decode_step_inputs(positions, block_tables=tables, seq_lens=seq_lens[:3], block_size=16)
    with pytest.raises(GraphDSLError, match=r"block_tables must be on .* \(positions' device\), got meta"):
        decode_step_inputs(positions, block_tables=tables.to("meta"), seq_lens=seq_lens, block_size=16)
    with pytest.raises(GraphDSLError, match=r"block_tables must be an integer tensor \[4, width\], got \(3, 3\)"):
        decode_step_inputs(positions, block_tables=tables[:3], seq_lens=seq_lens, block_size=16)
    with pytest.raises(GraphDSLError, match=r"seq_lens must be on .* \(positions' device\), got meta"):
        decode_step_inputs(positions, block_tables=tables, seq_lens=seq_lens.to("meta"), block_size=16)
    with pytest.raises(GraphDSLError, match="block_size >= 1, got .*block_size=0"):
        decode_step_inputs(positions, block_tables=tables, seq_lens=seq_lens, block_size=0)
    with pytest.raises(GraphDSLError, match=r"inv_freq must be float32 \[half\]"):
        decode_step_inputs(positions, inv_freq=torch.ones(8, dtype=torch.float64, device=DEVICE))
    with pytest.raises(GraphDSLError, match="dynamic NTK"):
        RotaryEmbedding(64, 10000.0, 128, RopeScaling(rope_type=RopeType.DYNAMIC, factor=2.0)).device_inv_freq(
            torch.device("cpu"))
