"""Triton expressions for the ops a generated fused kernel can compute: the lowering table.

Each entry turns already-computed operand expressions into the expression of one op. Values in a
generated kernel always hold their node's declared dtype (torch rounds after every op, and so do
we); arithmetic runs in the *compute type* of the result: float32 for 16- and 32-bit floats,
float64 for float64, the integer type itself for integers. Python literals (copied-in ``scalar``
constants) enter expressions as they are.

Row reductions (the op a fused group may end with) are emitted as statement blocks by
:mod:`graphdsl.runtime.codegen.fused`; :data:`ROW_REDUCTIONS` lists them.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["TL_DTYPES", "POINTWISE", "ROW_REDUCTIONS", "tl_dtype", "compute_type", "Operand", "lower_pointwise",
           "POW_EXPONENTS"]

TL_DTYPES = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
             torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32",
             torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}

ROW_REDUCTIONS = ("rms_norm", "softmax", "sum", "mean", "max")
POW_EXPONENTS = (1, 2, 3, 0.5, -1)


def tl_dtype(dt: torch.dtype) -> str:
    return TL_DTYPES[dt]


def compute_type(dt: torch.dtype) -> str:
    if dt == torch.float64:
        return "tl.float64"
    if dt.is_floating_point:
        return "tl.float32"
    return TL_DTYPES[dt]


class Operand:
    """An operand expression: a kernel variable (with its dtype) or a Python literal."""

    def __init__(self, text: str, dtype: torch.dtype | None, literal=None):
        self.text, self.dtype, self.literal = text, dtype, literal

    @property
    def is_literal(self) -> bool:
        return self.literal is not None

    def to(self, ct: str) -> str:
        return self.text if self.is_literal else f"{self.text}.to({ct})"


def _compare_type(a: Operand, b: Operand) -> str:
    dts = [x.dtype for x in (a, b) if not x.is_literal]
    lits = [x.literal for x in (a, b) if x.is_literal]
    if any(d == torch.float64 for d in dts):
        return "tl.float64"
    if any(d.is_floating_point for d in dts) or any(isinstance(v, float) for v in lits):
        return "tl.float32"
    return "tl.int64"


def _binary(sym: str, *, float_math: bool = False):
    def f(args, out, attrs):
        ct = "tl.float32" if float_math and out != torch.float64 else compute_type(out)
        a, b = args
        return f"({a.to(ct)} {sym} {b.to(ct)})"
    return f


def _unary(fmt: str):
    def f(args, out, attrs):
        return fmt.format(x=args[0].to(compute_type(out)))
    return f


def _compare(sym: str):
    def f(args, out, attrs):
        ct = _compare_type(*args)
        return f"({args[0].to(ct)} {sym} {args[1].to(ct)})"
    return f


def _pow(args, out, attrs):
    x, e = args
    ct = compute_type(out)
    xs = x.to(ct)
    k = e.literal
    return {1: f"({xs})", 2: f"({xs} * {xs})", 3: f"({xs} * {xs} * {xs})", 0.5: f"tl.sqrt({xs})",
            -1: f"(1.0 / {xs})"}[k]


def _where(args, out, attrs):
    c, a, b = args
    ct = compute_type(out)
    return f"tl.where({c.text}, {a.to(ct)}, {b.to(ct)})"


def _cast(args, out, attrs):
    return args[0].text if args[0].is_literal else f"{args[0].text}"


POINTWISE: dict[str, Callable] = {
    "add": _binary("+"), "sub": _binary("-"), "mul": _binary("*"), "div": _binary("/", float_math=True),
    "neg": _unary("(-{x})"), "exp": _unary("tl.exp({x})"), "sqrt": _unary("tl.sqrt({x})"),
    "rsqrt": _unary("tl.rsqrt({x})"), "sigmoid": _unary("tl.sigmoid({x})"), "tanh": _unary("_tanh({x})"),
    "silu": _unary("_silu({x})"), "gelu": _unary("_gelu({x})"), "gelu_tanh": _unary("_gelu_tanh({x})"),
    "relu": _unary("tl.maximum({x}, 0)"), "pow": _pow, "where": _where, "cast": _cast,
    "lt": _compare("<"), "le": _compare("<="), "gt": _compare(">"), "ge": _compare(">="),
    "eq": _compare("=="), "ne": _compare("!="),
}


def lower_pointwise(op: str, args: list[Operand], out: torch.dtype, attrs: dict) -> str:
    """The expression of ``op`` on ``args``, before the cast to the result dtype."""
    return POINTWISE[op](args, out, attrs)


# helpers every generated module defines (float32 in, float32 out)
PRELUDE = '''
@triton.jit
def _silu(x):
    """x * sigmoid(x)"""
    return x * tl.sigmoid(x)


@triton.jit
def _tanh(x):
    """tanh(x) = 2 sigmoid(2x) - 1"""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _gelu(x):
    """x/2 (1 + erf(x / sqrt 2))"""
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def _gelu_tanh(x):
    """x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))"""
    return 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
'''
