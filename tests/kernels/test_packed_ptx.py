"""The packed-PTX snippets of the GGUF kernels run on CPU through a small PTX interpreter
(``tests/helpers/ptx_emu.py``), the very strings the GPU compiles: the planes of several rows
(``gguf_tiles._nibble_fma_asm``, ``_q6k_values_asm``: byte selection, masks, shifts, the ``2^k + q``
magic and the fma arithmetic give ``s·q − m`` (Q4_K) and ``s·(q − 32)`` (Q6_K) rounded once to the
lane's type, every lane of the four packed values), and the tensor-core GEMVs' int8 operands
(``gguf_mma._NIBBLES_ASM``, ``gguf_mma_q6k._PLANE_ASM``, ``gguf_mma_rows._CODES_ASM``,
``_CODES5_ASM``) against their kernels' ``EMULATE`` branches, which the CPU tests of those kernels
run."""
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


def _signed(b: int) -> int:
    return b - 256 if b > 127 else b


@pytest.mark.parametrize("high", [False, True])
def test_q4k_tensor_core_nibbles_match_their_cpu_emulation(high):
    """``gguf_mma._nibbles``' PTX (the one-row tensor-core GEMV's Q4_K operand): each byte's low (or
    high) nibble ``q`` as the int8 ``16 (q - 8)`` its ``EMULATE`` branch computes, all 256 bytes."""
    from graphdsl.runtime.kernels.gguf_mma import _NIBBLES_ASM
    for first in range(0, 256, 4):
        codes = [first, first + 1, first + 2, first + 3]
        out, = run(_NIBBLES_ASM.value[high], 1, [_word(codes)])
        q = [(c >> 4) if high else (c & 15) for c in codes]
        assert [_signed((out >> (8 * i)) & 255) for i in range(4)] == [16 * (v - 8) for v in q], codes


@pytest.mark.parametrize("high", [False, True])
def test_q4k_rows_kernel_codes_match_their_cpu_emulation(high):
    """``gguf_mma_rows._codes``' PTX (the several-row tensor-core GEMV's Q4_K operand): each byte's low
    (or high) nibble ``q`` as the int8 ``q`` its ``EMULATE`` branch computes, all 256 bytes."""
    from graphdsl.runtime.kernels.gguf_mma_rows import _CODES_ASM
    for first in range(0, 256, 4):
        codes = [first, first + 1, first + 2, first + 3]
        out, = run(_CODES_ASM.value[high], 1, [_word(codes)])
        assert [(out >> (8 * i)) & 255 for i in range(4)] == [(c >> 4) if high else (c & 15) for c in codes], codes


@pytest.mark.parametrize("sub", range(8))
def test_q5k_rows_kernel_codes_match_their_cpu_emulation(sub):
    """``gguf_mma_rows._codes5``' PTX (the several-row GEMV's Q5_K operand of sub-block ``sub``): the low
    (even ``sub``) or high nibble of each code byte with bit ``sub`` of its ``qh`` byte as the fifth
    bit, as the int8 ``q`` (0..31) its ``EMULATE`` branch computes."""
    from graphdsl.runtime.kernels.gguf_mma_rows import _CODES5_ASM
    rng = random.Random(sub)
    for case in range(300):
        codes, qh = _bytes(rng, {0: 0x00, 1: 0xFF}.get(case, -1)), _bytes(rng, {0: 0xFF, 1: 0x00}.get(case, -1))
        out, = run(_CODES5_ASM.value[sub], 1, [_word(codes), _word(qh)])
        want = [((c >> 4) if sub % 2 else (c & 15)) | (((h >> sub) & 1) << 4) for c, h in zip(codes, qh)]
        assert [(out >> (8 * i)) & 255 for i in range(4)] == want, (codes, qh)


@pytest.mark.parametrize("plane", range(4))
def test_q6k_tensor_core_planes_match_their_cpu_emulation(plane):
    """``gguf_mma_q6k._plane``'s PTX (the one-row Q6_K tensor-core operand): plane ``I``'s 6-bit code
    ``q`` of each (ql, qh) byte pair as the int8 ``4 (q - 32)`` of its ``EMULATE`` branch."""
    from graphdsl.runtime.kernels.gguf_mma_q6k import _PLANE_ASM
    rng = random.Random(plane)
    for case in range(300):
        ql, qh = _bytes(rng, {0: 0x00, 1: 0xFF}.get(case, -1)), _bytes(rng, {0: 0xFF, 1: 0x00}.get(case, -1))
        out, = run(_PLANE_ASM.value[plane], 1, [_word(ql), _word(qh)])
        q = [((ql[i] >> 4) if plane >= 2 else (ql[i] & 15)) | (((qh[i] >> (2 * plane)) & 3) << 4) for i in range(4)]
        assert [_signed((out >> (8 * i)) & 255) for i in range(4)] == [4 * v - 128 for v in q], (ql, qh)
