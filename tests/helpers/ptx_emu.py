"""A tiny interpreter for the packed-PTX snippets of ``runtime/kernels/gguf_tiles.py`` (the instructions
they use: ``mov``, ``prmt``, ``shr``/``shl``, ``and``/``or``, ``lop3`` on ``.b32``, ``fma.rn`` on
``bf16x2``/``f16x2``), so CPU tests can run the very strings a GPU compiles. ``run(asm, inputs)``: the
``$i`` operands after the outputs, as 32-bit ints; returns the outputs. ``fma.rn`` is exact in float64
(two 16-bit floats' product plus a third) and rounded once to the lane's type (torch rounds to
nearest even)."""
from __future__ import annotations

import re

import torch

_LANES = {"bf16x2": torch.bfloat16, "f16x2": torch.float16}


def _lanes(word: int, dtype) -> list[float]:
    halves = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16)
    return halves.view(dtype).double().tolist()


def _pack(values: list[float], dtype) -> int:
    lo, hi = (int(v) & 0xFFFF for v in torch.tensor(values, dtype=torch.double).to(dtype).view(torch.int16).tolist())
    return lo | (hi << 16)


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def _prmt(a: int, b: int, sel: int) -> int:
    pool = [(a >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
    return sum(pool[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def run(asm: str, n_out: int, inputs: list[int]) -> list[int]:
    """Run ``asm`` (one ``{ ... }`` block) with ``$n_out ..`` bound to ``inputs``; returns ``$0 .. $n_out-1``."""
    regs = {f"${n_out + i}": v & 0xFFFFFFFF for i, v in enumerate(inputs)}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", tok):
            return int(tok, 0)
        raise KeyError(f"ptx_emu: operand {tok!r} read before it was written")

    for stmt in asm.strip().strip("{}").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == "mov.b32":
            r = val(a[1])
        elif op == "prmt.b32":
            r = _prmt(val(a[1]), val(a[2]), val(a[3]))
        elif op == "shr.b32":
            r = val(a[1]) >> val(a[2])
        elif op == "shl.b32":
            r = (val(a[1]) << val(a[2])) & 0xFFFFFFFF
        elif op == "and.b32":
            r = val(a[1]) & val(a[2])
        elif op == "or.b32":
            r = val(a[1]) | val(a[2])
        elif op == "lop3.b32":
            r = _lop3(val(a[1]), val(a[2]), val(a[3]), val(a[4]))
        elif op.startswith("fma.rn."):
            dt = _LANES[op.split(".")[2]]
            x, y, z = (_lanes(val(t), dt) for t in a[1:4])
            r = _pack([x[i] * y[i] + z[i] for i in range(2)], dt)
        else:
            raise NotImplementedError(f"ptx_emu: {op}")
        regs[a[0]] = r
    return [regs[f"${i}"] for i in range(n_out)]
