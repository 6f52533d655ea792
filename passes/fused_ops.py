"""Fused ops that the fusion passes put into graphs.

Each is an ordinary :class:`~graphdsl.opdef.OpDef` registered from here: a shape rule, a torch
reference that is the composition of the ops it replaces (so the ``torch`` backend runs fused
graphs unchanged and every rewrite can be checked numerically), and the math in its docstring.
Backends may lower them to dedicated kernels (``graphdsl.runtime``).

``fused`` is the generic one: its attributes hold a *sub-program* — a tuple of instructions
``(op_name, arg_refs, attr_pairs)`` where a ref ``< len(inputs)`` names an input and a larger ref
names the result of instruction ``ref - len(inputs)`` — so it stays JSON-serialisable and its
shape rule and reference simply interpret the sub-program with the member ops' own rules.
"""
from __future__ import annotations

import torch

from graphdsl.dim import shape_str
from graphdsl.errors import GraphDSLError
from graphdsl.functional import attention as _attn
from graphdsl.functional._rules import binary_rule
from graphdsl.opdef import OpCategory, Spec, check, get_op, register_op

__all__ = ["add_rms_norm", "silu_mul", "rope_cache", "rope_cache_attention", "matmul_add", "matmul_silu_mul",
           "quant_linear_silu_mul", "quant_linear_add", "fused",
           "program_ops", "FUSED_OPS"]


# -- residual add + RMSNorm ----------------------------------------------------------------
def _add_rms_norm_rule(x: Spec, residual: Spec, weight: Spec, *, eps=1e-6):
    s = binary_rule("add_rms_norm")(x, residual)
    normed = get_op("rms_norm").shape(s, weight, eps=eps)
    return normed, s


@register_op("add_rms_norm", category=OpCategory.REDUCTION, shape=_add_rms_norm_rule, num_outputs=2)
def add_rms_norm(x, residual, weight, *, eps=1e-6):
    """s = x + residual;  normed = rms_norm(s, weight, eps).  Returns (normed, s): the normed value
    and the new residual stream, in one pass over the row."""
    s = torch.add(x, residual)
    return get_op("rms_norm").reference(s, weight, eps=eps), s


# -- SwiGLU on a packed [gate | up] projection -----------------------------------------------
def _silu_mul_rule(x: Spec):
    check(len(x.shape) >= 1, "silu_mul", f"input must have rank >= 1, got {shape_str(x.shape)}")
    last = x.shape[-1]
    if isinstance(last, int):
        check(last % 2 == 0, "silu_mul", f"last dim must be even ([gate | up]), got {last}")
    check(x.dtype.is_floating_point, "silu_mul", f"needs a floating dtype, got {x.dtype}")
    return Spec(tuple(x.shape[:-1]) + (last // 2,), x.dtype)


@register_op("silu_mul", category=OpCategory.CUSTOM, shape=_silu_mul_rule)
def silu_mul(x):
    """gate, up = x[..., :I], x[..., I:] (I = last dim / 2);  out = silu(gate) * up."""
    gate, up = torch.split(x, x.shape[-1] // 2, dim=-1)
    return torch.mul(torch.nn.functional.silu(gate), up)


# -- RoPE on q and k + paged KV-cache write --------------------------------------------------
def _rope_cache_rule(q: Spec, k: Spec, v: Spec, key_cache: Spec, value_cache: Spec, cos: Spec, sin: Spec,
                     slot_mapping: Spec, *, layout=_attn.RopeLayout.NEOX):
    q2, k2 = get_op("rope").shape(q, k, cos, sin, layout=layout)
    kc, vc = get_op("reshape_and_cache").shape(k2, v, key_cache, value_cache, slot_mapping)
    return q2, kc, vc


@register_op("rope_cache", category=OpCategory.CUSTOM, shape=_rope_cache_rule, num_outputs=3,
             inplace={1: 3, 2: 4})
def rope_cache(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, *, layout=_attn.RopeLayout.NEOX):
    """q', k' = rope(q, k, cos, sin, layout);  key_cache[slot[t]] = k'[t], value_cache[slot[t]] = v[t]
    (slot >= 0).  Returns (q', key_cache, value_cache); the caches are written in place and k'
    never reaches memory except in the cache."""
    q2, k2 = get_op("rope").reference(q, k, cos, sin, layout=layout)
    kc, vc = get_op("reshape_and_cache").reference(k2, v, key_cache, value_cache, slot_mapping)
    return q2, kc, vc


# -- decode: RoPE + KV-cache write + paged attention -----------------------------------------------
def _rope_cache_attention_rule(q: Spec, k: Spec, v: Spec, key_cache: Spec, value_cache: Spec, cos: Spec, sin: Spec,
                               slot_mapping: Spec, block_tables: Spec, seq_lens: Spec, *,
                               layout=_attn.RopeLayout.NEOX, scale=1.0, sliding_window=0, soft_cap=0.0):
    q2, kc, vc = _rope_cache_rule(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, layout=layout)
    out = get_op("paged_attention").shape(q2, kc, vc, block_tables, seq_lens, scale=scale,
                                          sliding_window=sliding_window, soft_cap=soft_cap)
    return out, kc, vc


@register_op("rope_cache_attention", category=OpCategory.ATTENTION, shape=_rope_cache_attention_rule,
             num_outputs=3, inplace={1: 3, 2: 4})
def rope_cache_attention(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, block_tables, seq_lens, *,
                         layout=_attn.RopeLayout.NEOX, scale=1.0, sliding_window=0, soft_cap=0.0):
    """Decode (one query per sequence): ``q', key_cache, value_cache = rope_cache(q, k, v, ...)``, then
    ``out = paged_attention(q', key_cache, value_cache, block_tables, seq_lens)``. Returns
    ``(out, key_cache, value_cache)``; q' and k' never reach memory except k' in the cache."""
    q2, kc, vc = get_op("rope_cache").reference(q, k, v, key_cache, value_cache, cos, sin, slot_mapping,
                                                layout=layout)
    out = get_op("paged_attention").reference(q2, kc, vc, block_tables, seq_lens, scale=scale,
                                              sliding_window=sliding_window, soft_cap=soft_cap)
    return out, kc, vc


# -- matmul with an add epilogue (bias or residual) ---------------------------------------------
def _matmul_add_rule(a: Spec, b: Spec, c: Spec, *, transpose_a=False, transpose_b=False):
    m = get_op("matmul").shape(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    return binary_rule("matmul_add")(m, c)


@register_op("matmul_add", category=OpCategory.MATMUL, shape=_matmul_add_rule)
def matmul_add(a, b, c, *, transpose_a=False, transpose_b=False):
    """op(a) @ op(b) + c, op = transpose of the last two dims when the flag is set; c is a bias
    (broadcast over rows) or a residual of the product's shape. One GEMM with a beta=1 epilogue."""
    return torch.add(get_op("matmul").reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b), c)


# -- matmul with a SwiGLU epilogue ------------------------------------------------------------------
def _matmul_silu_mul_rule(a: Spec, b: Spec, *, transpose_a=False, transpose_b=False):
    return _silu_mul_rule(get_op("matmul").shape(a, b, transpose_a=transpose_a, transpose_b=transpose_b))


@register_op("matmul_silu_mul", category=OpCategory.MATMUL, shape=_matmul_silu_mul_rule,
             workspace=lambda a, b, **attrs: get_op("matmul").shape(a, b, **attrs))
def matmul_silu_mul(a, b, *, transpose_a=False, transpose_b=False):
    """``silu_mul(op(a) @ op(b))``: the product's last dim packs ``[gate | up]`` (I columns each),
    ``out = silu(gate) * up``. A decode GEMV computes gate and up of a column in one tile and writes
    only ``out``; other lowerings may put the product in the node's workspace (its shape)."""
    return get_op("silu_mul").reference(get_op("matmul").reference(a, b, transpose_a=transpose_a,
                                                                   transpose_b=transpose_b))


# -- quantized linear with an epilogue --------------------------------------------------------------
def _quant_linear_silu_mul_rule(x: Spec, *stored: Spec, scheme: str, out_features: int, in_features: int):
    return _silu_mul_rule(get_op("quant_linear").shape(x, *stored, scheme=scheme, out_features=out_features,
                                                       in_features=in_features))


@register_op("quant_linear_silu_mul", category=OpCategory.MATMUL, shape=_quant_linear_silu_mul_rule,
             workspace=lambda x, *stored, **attrs: get_op("quant_linear").shape(x, *stored, **attrs))
def quant_linear_silu_mul(x, *stored, scheme: str = "", out_features: int = 0, in_features: int = 0):
    """``silu_mul(quant_linear(x, *stored))``: the quantized packed ``[gate | up]`` projection with
    SwiGLU in its epilogue (as ``matmul_silu_mul``; other lowerings may put the product in the
    node's workspace)."""
    y = get_op("quant_linear").reference(x, *stored, scheme=scheme, out_features=out_features,
                                         in_features=in_features)
    return get_op("silu_mul").reference(y)


def _quant_linear_add_rule(x: Spec, c: Spec, *stored: Spec, scheme: str, out_features: int, in_features: int):
    y = get_op("quant_linear").shape(x, *stored, scheme=scheme, out_features=out_features, in_features=in_features)
    return binary_rule("quant_linear_add")(y, c)


@register_op("quant_linear_add", category=OpCategory.MATMUL, shape=_quant_linear_add_rule)
def quant_linear_add(x, c, *stored, scheme: str = "", out_features: int = 0, in_features: int = 0):
    """``quant_linear(x, *stored) + c``, ``c`` a bias ``[out_features]`` or a residual of the
    product's shape (added to the float32 sums in the GEMV's epilogue)."""
    y = get_op("quant_linear").reference(x, *stored, scheme=scheme, out_features=out_features,
                                         in_features=in_features)
    return torch.add(y, c)


# -- generic fused group -------------------------------------------------------------------------
def program_ops(program) -> list[str]:
    """The op names of a ``fused`` sub-program, in order."""
    return [ins[0] for ins in program]


def _interpret(program, n_inputs: int, values: list, step):
    vals = list(values)
    for op, refs, attr_pairs in program:
        for r in refs:
            if not 0 <= r < len(vals):
                raise GraphDSLError(f"fused: instruction {op} reads ref {r}, but only {len(vals)} values exist")
        vals.append(step(get_op(op), [vals[r] for r in refs], dict(attr_pairs)))
    return vals


def _fused_count(attrs) -> int:
    return len(attrs["outputs"])


def _fused_rule(*specs: Spec, program=(), outputs=(), absorbed=()):
    def step(opdef, ins, attrs):
        out = opdef.infer(list(ins), attrs)
        check(len(out) == 1, "fused", f"member op '{opdef.name}' has {len(out)} outputs; only single-output ops fuse")
        return out[0]
    vals = _interpret(program, len(specs), list(specs), step)
    return tuple(vals[r] for r in outputs)


@register_op("fused", category=OpCategory.CUSTOM, shape=_fused_rule, num_outputs=_fused_count)
def fused(*inputs, program=(), outputs=(), absorbed=()):
    """A fused group of pointwise ops, optionally ending in one row reduction, run as one kernel.

    ``program`` is a tuple of ``(op, refs, attr_pairs)``; refs below ``len(inputs)`` name inputs,
    ref ``len(inputs) + i`` names instruction i's result; ``outputs`` lists the refs returned;
    ``absorbed`` names the recorded nodes the group replaced. The reference runs each member op's
    own torch reference in order."""
    vals = _interpret(program, len(inputs), list(inputs), lambda opdef, ins, attrs: opdef.run(ins, attrs)[0])
    return tuple(vals[r] for r in outputs)


FUSED_OPS = {"add_rms_norm": add_rms_norm, "silu_mul": silu_mul, "rope_cache": rope_cache,
             "rope_cache_attention": rope_cache_attention,
             "matmul_add": matmul_add, "matmul_silu_mul": matmul_silu_mul,
             "quant_linear_silu_mul": quant_linear_silu_mul, "quant_linear_add": quant_linear_add, "fused": fused}
