"""The LLM fusion rules: each a pattern written like the model code it matches.

* ``add_rms_norm``  — ``s = x + residual; rms_norm(s)`` -> one row kernel returning (normed, s)
* ``swiglu``        — ``silu(gate) * up`` over a packed gate/up projection -> ``silu_mul``; two
  separate gate and up projections of the same input become one projection of the concatenated
  weights (a parameter-only ``cat``, folded once when weights are bound) feeding ``silu_mul``
* ``rope_cache``    — ``rope`` of q/k whose k goes straight into ``reshape_and_cache`` -> one kernel
* ``rope_cache_attention`` — a decode ``paged_attention`` (no ``query_start_loc``) reading
  ``rope_cache``'s q' and caches -> one kernel that rotates, writes the cache and attends
* ``matmul_silu_mul`` — ``silu_mul(matmul(x, w))`` -> one op: the decode GEMV computes a column's
  gate and up in one tile and writes only ``silu(gate) * up`` (the product never reaches memory;
  larger row counts run the GEMM into the node's workspace, then the ``silu_mul`` kernel)
* ``quant_linear_silu_mul`` / ``quant_linear_add`` — the same two epilogues on a quantized
  projection (``quant_linear`` with 2 or 3 stored tensors: codes, scales, zero points; the SwiGLU
  also with 1, a GGUF weight's block bytes, which the tensor-core GGUF GEMV fuses)
* ``matmul_epilogue`` — ``matmul + bias`` / ``matmul + residual`` -> one GEMM with a beta=1
  epilogue. It runs after ``add_rms_norm``: an add that feeds an RMSNorm saves more by joining the
  norm's row kernel (no extra read of the sum) than by joining the GEMM, so only adds left over
  (biases, residuals not followed by a norm) go to the GEMM.
* ``lora_epilogue`` (rules of the ``matmul_epilogue`` pass, after the base rules) — a LoRA
  engine's ``lora_apply(matmul(x, w), x, A, B, idx)`` -> ``matmul_lora`` (the term joins the
  projection: one shrink launch, then the GEMV adds it in its epilogue), and then, as the passes
  before did for the bare matmul, ``silu_mul(matmul_lora)`` -> ``matmul_silu_mul_lora`` and
  ``matmul_lora + c`` -> ``matmul_add_lora``; a biased projection's
  ``lora_apply(matmul_add(x, w, bias))`` -> ``matmul_add_lora``. The rules chain (each rewrite
  revisits the new node's readers), so their order does not matter; they run after
  ``add_rms_norm``, so residual adds still go to the norm first, and a graph without
  ``lora_apply`` (the base engine) never matches them.
"""
from __future__ import annotations

from graphdsl import functional as F

from .fused_ops import (add_rms_norm, matmul_add, matmul_add_lora, matmul_lora, matmul_silu_mul, matmul_silu_mul_lora,
                        quant_linear_add, quant_linear_silu_mul, rope_cache, rope_cache_attention, silu_mul)
from .rewriter import Rule, Var, ops
from .shapes import same_extent_value, same_shape

__all__ = ["ADD_RMS_NORM_RULES", "SWIGLU_RULES", "MATMUL_SILU_MUL_RULES", "ROPE_CACHE_RULES",
           "ROPE_CACHE_ATTENTION_RULES", "MATMUL_EPILOGUE_RULES", "LORA_EPILOGUE_RULES"]


# -- residual add + RMSNorm ----------------------------------------------------------------------
def _add_norm_pattern(x, residual, weight):
    s = x + residual
    return F.rms_norm(s, weight, eps=Var("eps")), s


def _add_norm_replacement(x, residual, weight, *, eps):
    return add_rms_norm(x, residual, weight, eps=eps)


def _add_norm_check(m):
    x, r = m.inputs["x"], m.inputs["residual"]
    if not same_shape(x.shape, r.shape):
        return f"shape: the add broadcasts ({x.shape} + {r.shape}); a residual add has equal shapes"
    if x.dtype != r.dtype:
        return f"dtype: x is {x.dtype} but the residual is {r.dtype}"
    return True


ADD_RMS_NORM_RULES = [Rule("add_rms_norm", _add_norm_pattern, _add_norm_replacement, _add_norm_check)]


# -- SwiGLU --------------------------------------------------------------------------------------
def _swiglu_pattern(x):
    gate, up = ops.split(x, sections=2, dim=Var("dim"))
    return F.silu(gate) * up


def _swiglu_pattern_swapped(x):
    gate, up = ops.split(x, sections=2, dim=Var("dim"))
    return up * F.silu(gate)


def _swiglu_replacement(x):
    return silu_mul(x)


def _swiglu_check(m):
    x, dim = m.inputs["x"], m.vars["dim"]
    if x.shape is None:
        return "shape: input shape unknown while building"
    if dim not in (-1, len(x.shape) - 1):
        return f"shape: splits dim {dim}, silu_mul splits the last dim"
    if x.dtype is None or not x.dtype.is_floating_point:
        return f"dtype: {x.dtype} is not a floating dtype"
    return True


def _gate_up_pattern(x, w_gate, w_up):
    g = ops.matmul(x, w_gate, transpose_a=False, transpose_b=Var("tb"))
    u = ops.matmul(x, w_up, transpose_a=False, transpose_b=Var("tb"))
    return F.silu(g) * u


def _gate_up_replacement(x, w_gate, w_up, *, tb):
    w = F.cat([w_gate, w_up], dim=0 if tb else 1)
    return silu_mul(ops.matmul(x, w, transpose_a=False, transpose_b=tb))


def _gate_up_check(m):
    wg, wu = m.inputs["w_gate"], m.inputs["w_up"]
    if wg.producer is not None or wu.producer is not None:
        return "gate/up weights are computed in the graph, not weights (the concatenation would not fold)"
    if not same_shape(wg.shape, wu.shape) or len(wg.shape) != 2:
        return f"shape: gate weight {wg.shape} and up weight {wu.shape} differ or are not 2-D"
    if wg.dtype != wu.dtype:
        return f"dtype: gate weight is {wg.dtype}, up weight {wu.dtype}"
    return True


SWIGLU_RULES = [Rule("swiglu", _swiglu_pattern, _swiglu_replacement, _swiglu_check),
                Rule("swiglu_swapped", _swiglu_pattern_swapped, _swiglu_replacement, _swiglu_check),
                Rule("gate_up_swiglu", _gate_up_pattern, _gate_up_replacement, _gate_up_check)]


# -- SwiGLU in the projection's epilogue -----------------------------------------------------------
def _matmul_silu_mul_pattern(a, b):
    return silu_mul(ops.matmul(a, b, transpose_a=Var("ta"), transpose_b=Var("tb")))


def _matmul_silu_mul_replacement(a, b, *, ta, tb):
    return matmul_silu_mul(a, b, transpose_a=ta, transpose_b=tb)


def _quant_attrs():
    return dict(scheme=Var("scheme"), out_features=Var("out_features"), in_features=Var("in_features"))


def _quant_silu_mul_pattern1(x, q):
    return silu_mul(F.quant_linear(x, q, **_quant_attrs()))


def _quant_silu_mul_pattern2(x, q, s):
    return silu_mul(F.quant_linear(x, q, s, **_quant_attrs()))


def _quant_silu_mul_pattern3(x, q, s, z):
    return silu_mul(F.quant_linear(x, q, s, z, **_quant_attrs()))


def _quant_silu_mul_replacement1(x, q, *, scheme, out_features, in_features):
    return quant_linear_silu_mul(x, q, scheme=scheme, out_features=out_features, in_features=in_features)


def _quant_silu_mul_replacement2(x, q, s, *, scheme, out_features, in_features):
    return quant_linear_silu_mul(x, q, s, scheme=scheme, out_features=out_features, in_features=in_features)


def _quant_silu_mul_replacement3(x, q, s, z, *, scheme, out_features, in_features):
    return quant_linear_silu_mul(x, q, s, z, scheme=scheme, out_features=out_features, in_features=in_features)


MATMUL_SILU_MUL_RULES = [Rule("matmul_silu_mul", _matmul_silu_mul_pattern, _matmul_silu_mul_replacement),
                         Rule("quant_linear_silu_mul_1", _quant_silu_mul_pattern1, _quant_silu_mul_replacement1),
                         Rule("quant_linear_silu_mul", _quant_silu_mul_pattern2, _quant_silu_mul_replacement2),
                         Rule("quant_linear_silu_mul_zp", _quant_silu_mul_pattern3, _quant_silu_mul_replacement3)]


# -- RoPE + KV-cache write -----------------------------------------------------------------------
def _rope_cache_pattern(q, k, v, key_cache, value_cache, cos, sin, slot_mapping):
    q2, k2 = ops.rope(q, k, cos, sin, layout=Var("layout"))
    kc, vc = ops.reshape_and_cache(k2, v, key_cache, value_cache, slot_mapping)
    return q2, kc, vc


def _rope_cache_replacement(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, *, layout):
    return rope_cache(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, layout=layout)


def _rope_cache_check(m):
    k, v = m.inputs["k"], m.inputs["v"]
    if k.dtype != v.dtype:
        return f"dtype: k is {k.dtype}, v is {v.dtype}"
    return True


ROPE_CACHE_RULES = [Rule("rope_cache", _rope_cache_pattern, _rope_cache_replacement, _rope_cache_check)]


# -- decode attention with RoPE + KV-cache write ---------------------------------------------------
def _rca_pattern(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, block_tables, seq_lens):
    q2, kc, vc = ops.rope_cache(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, layout=Var("layout"))
    out = ops.paged_attention(q2, kc, vc, block_tables, seq_lens, scale=Var("scale"),
                              sliding_window=Var("sliding_window"), soft_cap=Var("soft_cap"))
    return out, kc, vc


def _rca_replacement(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, block_tables, seq_lens, *,
                     layout, scale, sliding_window, soft_cap):
    return rope_cache_attention(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, block_tables, seq_lens,
                                layout=layout, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)


ROPE_CACHE_ATTENTION_RULES = [Rule("rope_cache_attention", _rca_pattern, _rca_replacement)]


# -- matmul epilogue ------------------------------------------------------------------------------
def _epilogue_pattern(a, b, c):
    return ops.matmul(a, b, transpose_a=Var("ta"), transpose_b=Var("tb")) + c


def _epilogue_pattern_swapped(a, b, c):
    return c + ops.matmul(a, b, transpose_a=Var("ta"), transpose_b=Var("tb"))


def _epilogue_replacement(a, b, c, *, ta, tb):
    return matmul_add(a, b, c, transpose_a=ta, transpose_b=tb)


def _epilogue_check(m):
    a, b, c = m.inputs["a"], m.inputs["b"], m.inputs["c"]
    prod = m.node("matmul").outputs[0]
    if a.shape is None or b.shape is None or c.shape is None or prod.shape is None:
        return "shape: unknown while building"
    if len(a.shape) != 2 or len(b.shape) != 2:
        return f"shape: only 2-D GEMMs take an epilogue here, got {a.shape} @ {b.shape}"
    if c.dtype != prod.dtype:
        return f"dtype: the addend is {c.dtype}, the product {prod.dtype}"
    full = same_shape(c.shape, prod.shape)
    bias = len(c.shape) == 1 and same_extent_value(c.shape[0], prod.shape[1])
    if not (full or bias):
        return f"shape: addend {c.shape} is neither a bias [{prod.shape[1]}] nor a residual {prod.shape}"
    return True


def _quant_epilogue_pattern2(x, q, s, c):
    return F.quant_linear(x, q, s, **_quant_attrs()) + c


def _quant_epilogue_pattern2_swapped(x, q, s, c):
    return c + F.quant_linear(x, q, s, **_quant_attrs())


def _quant_epilogue_pattern3(x, q, s, z, c):
    return F.quant_linear(x, q, s, z, **_quant_attrs()) + c


def _quant_epilogue_pattern3_swapped(x, q, s, z, c):
    return c + F.quant_linear(x, q, s, z, **_quant_attrs())


def _quant_epilogue_replacement2(x, q, s, c, *, scheme, out_features, in_features):
    return quant_linear_add(x, c, q, s, scheme=scheme, out_features=out_features, in_features=in_features)


def _quant_epilogue_replacement3(x, q, s, z, c, *, scheme, out_features, in_features):
    return quant_linear_add(x, c, q, s, z, scheme=scheme, out_features=out_features, in_features=in_features)


def _addend_check(c, prod):
    """True when ``c`` can join the product ``prod``'s epilogue: a bias over its last dim or a
    residual of its shape, in its dtype; else the reason."""
    if c.shape is None or prod.shape is None:
        return "shape: unknown while building"
    if c.dtype != prod.dtype:
        return f"dtype: the addend is {c.dtype}, the product {prod.dtype}"
    if not (same_shape(c.shape, prod.shape) or (len(c.shape) == 1 and same_extent_value(c.shape[0], prod.shape[-1]))):
        return f"shape: addend {c.shape} is neither a bias [{prod.shape[-1]}] nor a residual {prod.shape}"
    return True


def _quant_epilogue_check(m):
    return _addend_check(m.inputs["c"], m.node("quant_linear").outputs[0])


MATMUL_EPILOGUE_RULES = [Rule("matmul_epilogue", _epilogue_pattern, _epilogue_replacement, _epilogue_check),
                         Rule("matmul_epilogue_swapped", _epilogue_pattern_swapped, _epilogue_replacement,
                              _epilogue_check),
                         Rule("quant_linear_epilogue", _quant_epilogue_pattern2, _quant_epilogue_replacement2,
                              _quant_epilogue_check),
                         Rule("quant_linear_epilogue_swapped", _quant_epilogue_pattern2_swapped,
                              _quant_epilogue_replacement2, _quant_epilogue_check),
                         Rule("quant_linear_zp_epilogue", _quant_epilogue_pattern3, _quant_epilogue_replacement3,
                              _quant_epilogue_check),
                         Rule("quant_linear_zp_epilogue_swapped", _quant_epilogue_pattern3_swapped,
                              _quant_epilogue_replacement3, _quant_epilogue_check)]


# -- LoRA inside the projection ----------------------------------------------------------------------
def _lora_pattern(x, w, a, b, idx):
    return ops.lora_apply(ops.matmul(x, w, transpose_a=False, transpose_b=True), x, a, b, idx)


def _lora_replacement(x, w, a, b, idx):
    return matmul_lora(x, w, a, b, idx)


def _lora_check(m):
    x, w = m.inputs["x"], m.inputs["w"]
    if x.shape is None or w.shape is None or len(x.shape) != 2 or len(w.shape) != 2:
        return f"shape: a LoRA projection is 2-D, got x {x.shape} @ w {w.shape}"
    return True


def _lora_bias_pattern(x, w, c, a, b, idx):
    return ops.lora_apply(ops.matmul_add(x, w, c, transpose_a=False, transpose_b=True), x, a, b, idx)


def _lora_bias_replacement(x, w, c, a, b, idx):
    return matmul_add_lora(x, w, c, a, b, idx)


def _lora_silu_mul_pattern(x, w, a, b, idx):
    return silu_mul(ops.matmul_lora(x, w, a, b, idx))


def _lora_silu_mul_replacement(x, w, a, b, idx):
    return matmul_silu_mul_lora(x, w, a, b, idx)


def _lora_add_pattern(x, w, a, b, idx, c):
    return ops.matmul_lora(x, w, a, b, idx) + c


def _lora_add_pattern_swapped(x, w, a, b, idx, c):
    return c + ops.matmul_lora(x, w, a, b, idx)


def _lora_add_replacement(x, w, a, b, idx, c):
    return matmul_add_lora(x, w, c, a, b, idx)


def _lora_add_check(m):
    return _addend_check(m.inputs["c"], m.node("matmul_lora").outputs[0])


LORA_EPILOGUE_RULES = [Rule("matmul_lora", _lora_pattern, _lora_replacement, _lora_check),
                       Rule("matmul_add_lora_bias", _lora_bias_pattern, _lora_bias_replacement, _lora_check),
                       Rule("matmul_silu_mul_lora", _lora_silu_mul_pattern, _lora_silu_mul_replacement),
                       Rule("matmul_add_lora", _lora_add_pattern, _lora_add_replacement, _lora_add_check),
                       Rule("matmul_add_lora_swapped", _lora_add_pattern_swapped, _lora_add_replacement,
                            _lora_add_check)]
