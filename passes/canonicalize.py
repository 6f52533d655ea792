"""Canonicalisation: put the graph in the one form the fusion rules are written against.

* a transpose of the last two dims feeding a matmul becomes the matmul's transpose flag;
* a cast to the tensor's own dtype, and a widening round trip (bf16 -> f32 -> bf16), disappear;
* a reshape to the same shape, a reshape of a reshape, and an identity permute disappear or merge.
"""
from __future__ import annotations

import torch

from graphdsl.functional import reshape as _reshape

from .rewriter import Rule, Var, ops
from .shapes import same_shape

__all__ = ["CANONICALIZE_RULES"]


def _swaps_last_two(dims) -> bool:
    n = len(dims)
    return n >= 2 and tuple(dims) == tuple(range(n - 2)) + (n - 1, n - 2)


# -- transpose folded into matmul flags ----------------------------------------------------------
def _mm_tb_pattern(a, b):
    return ops.matmul(a, ops.permute(b, dims=Var("dims")), transpose_a=Var("ta"), transpose_b=Var("tb"))


def _mm_tb_replacement(a, b, *, ta, tb):
    return ops.matmul(a, b, transpose_a=ta, transpose_b=not tb)


def _mm_ta_pattern(a, b):
    return ops.matmul(ops.permute(a, dims=Var("dims")), b, transpose_a=Var("ta"), transpose_b=Var("tb"))


def _mm_ta_replacement(a, b, *, ta, tb):
    return ops.matmul(a, b, transpose_a=not ta, transpose_b=tb)


def _check_swap(m):
    dims = m.vars["dims"]
    return True if _swaps_last_two(dims) else f"permute dims {dims} do more than swap the last two dims"


# -- casts ---------------------------------------------------------------------------------------
def _cast_pattern(x):
    return ops.cast(x, dtype=Var("dtype"))


def _identity(x):
    return x


def _check_same_dtype(m):
    x = m.inputs["x"]
    return True if x.dtype is not None and x.dtype == m.vars["dtype"] else \
        f"dtype: casts {x.dtype} to {m.vars['dtype']}, not a no-op"


def _round_trip_pattern(x):
    return ops.cast(ops.cast(x, dtype=Var("mid")), dtype=Var("dtype"))


_EXACT_WIDER = {torch.bfloat16: (torch.float32, torch.float64), torch.float16: (torch.float32, torch.float64),
                torch.float32: (torch.float64,)}


def _check_round_trip(m):
    x, mid, out = m.inputs["x"], m.vars["mid"], m.vars["dtype"]
    if x.dtype != out:
        return f"dtype: {x.dtype} -> {mid} -> {out} is not a round trip"
    if mid not in _EXACT_WIDER.get(x.dtype, ()):
        return f"dtype: {x.dtype} -> {mid} loses precision, so the round trip is not the identity"
    return True


# -- reshapes and permutes -----------------------------------------------------------------------
def _reshape_pattern(x):
    return ops.reshape(x, shape=Var("shape"))


def _check_same_shape(m):
    x, out = m.inputs["x"], m.outputs[0]
    ok = same_shape(x.shape, out.shape)
    return True if ok else f"shape: reshape {x.shape} -> {out.shape} changes the shape"


def _reshape2_pattern(x):
    return ops.reshape(ops.reshape(x, shape=Var("inner")), shape=Var("shape"))


def _reshape2_replacement(x, *, shape):
    return _reshape(x, shape)


def _check_known(m):
    return True if m.inputs["x"].shape is not None else "shape: input shape unknown while building"


def _permute_pattern(x):
    return ops.permute(x, dims=Var("dims"))


def _check_identity_permute(m):
    dims = tuple(m.vars["dims"])
    return True if dims == tuple(range(len(dims))) else f"permute dims {dims} are not the identity"


CANONICALIZE_RULES = [
    Rule("transpose_into_matmul_b", _mm_tb_pattern, _mm_tb_replacement, _check_swap),
    Rule("transpose_into_matmul_a", _mm_ta_pattern, _mm_ta_replacement, _check_swap),
    Rule("cast_round_trip", _round_trip_pattern, _identity, _check_round_trip),
    Rule("noop_cast", _cast_pattern, _identity, _check_same_dtype),
    Rule("reshape_of_reshape", _reshape2_pattern, _reshape2_replacement, _check_known),
    Rule("noop_reshape", _reshape_pattern, _identity, _check_same_shape),
    Rule("noop_permute", _permute_pattern, _identity, _check_identity_permute),
]
