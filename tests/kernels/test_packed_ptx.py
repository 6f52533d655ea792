"""The packed-PTX snippets that decode Q4_K nibbles and Q6_K codes into fp16/bf16 weights
(``gguf_tiles._nibble_fma_asm``, ``_q6k_values_asm``: the strings the GPU compiles) run on CPU through
a small PTX interpreter (``tests/helpers/ptx_emu.py``): byte selection, masks, shifts, the ``2^k + q``
magic and the fma arithmetic give ``s·q − m`` (Q4_K) and ``s·(q − 32)`` (Q6_K) rounded once to the
lane's type, for every lane of the four packed values."""
import random

import pytest
import torch

from graphdsl.runtime.kernels import gguf_tiles as T
from tests.helpers.ptx_emu import _lanes, _pack, run

DTYPES = {"bf16x2": torch.bfloat16, "f16x2": torch.float16}


def _round(v: float, dt) -> float:
    return torch.tensor(v, dtype=torch.double).to(dt).double().item()


def _bytes(rng, edge: int) -> list[int]:
    return [rng.randrange(256) for _ in range(4)] if edge < 0 else [edge] * 4


def _word(b: list[int]) -> int:
    return sum(c << (8 * i) for i, c in enumerate(b))


@pytest.mark.parametrize("op", DTYPES)
@pytest.mark.parametrize("high", [False, True])
def test_q4k_nibbles_become_scale_times_nibble_minus_min(op, high):
    dt, asm, rng = DTYPES[op], T._nibble_fma_asm(op, high), random.Random(int(high))
    for case in range(150):
        codes = _bytes(rng, {0: 0x00, 1: 0xFF, 2: 0x0F, 3: 0xF0}.get(case, -1))
        s = [_round(rng.uniform(-0.05, 0.05), dt) for _ in range(4)]
        m = [_round(rng.uniform(-0.5, 0.5), dt) for _ in range(4)]
        out = run(asm, 2, [_word(codes), _pack(s[:2], dt), _pack(s[2:], dt), _pack([-x for x in m[:2]], dt),
                           _pack([-x for x in m[2:]], dt)])
        q = [(c >> 4) if high else (c & 15) for c in codes]
        assert _lanes(out[0], dt) + _lanes(out[1], dt) == [_round(q[i] * s[i] - m[i], dt) for i in range(4)], codes


@pytest.mark.parametrize("op", DTYPES)
@pytest.mark.parametrize("pl", range(4))
def test_q6k_codes_become_scale_times_code_minus_32(op, pl):
    dt, asm, rng = DTYPES[op], T._q6k_values_asm(op, pl), random.Random(pl)
    for case in range(150):
        ql, qh = _bytes(rng, {0: 0x00, 1: 0xFF}.get(case, -1)), _bytes(rng, {0: 0x00, 1: 0xFF}.get(case, -1))
        s = [_round(rng.uniform(-0.05, 0.05), dt) for _ in range(4)]
        out = run(asm, 2, [_word(ql), _word(qh), _pack(s[:2], dt), _pack(s[2:], dt)])
        q = [((ql[i] >> (4 * (pl // 2))) & 15) | (((qh[i] >> (2 * pl)) & 3) << 4) for i in range(4)]
        assert _lanes(out[0], dt) + _lanes(out[1], dt) == [_round((q[i] - 32) * s[i], dt) for i in range(4)], (ql, qh)


def test_the_kernels_compile_these_strings():
    """The Triton functions take the same strings (constexpr tuples indexed by nibble half / plane)."""
    assert T._NIBBLES_BF16.value == tuple(T._nibble_fma_asm("bf16x2", h) for h in (False, True))
    assert T._NIBBLES_FP16.value == tuple(T._nibble_fma_asm("f16x2", h) for h in (False, True))
    assert T._Q6K_BF16.value == tuple(T._q6k_values_asm("bf16x2", pl) for pl in range(4))
    assert T._Q6K_FP16.value == tuple(T._q6k_values_asm("f16x2", pl) for pl in range(4))
