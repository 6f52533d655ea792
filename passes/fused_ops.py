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

from graphdsl.dim import same_extent, shape_str
from graphdsl.errors import GraphDSLError
from graphdsl.functional import attention as _attn
from graphdsl.functional._rules import binary_rule
from graphdsl.functional.lora import LORA_SPLIT_K
from graphdsl.opdef import OpCategory, Spec, check, get_op, register_op

__all__ = ["add_rms_norm", "silu_mul", "rope_cache", "rope_cache_attention", "matmul_add", "matmul_silu_mul",
           "quant_linear_silu_mul", "quant_linear_add", "matmul_lora", "matmul_add_lora", "matmul_silu_mul_lora",
           "lora_workspace_layout", "fused",
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


# -- matmuls with the LoRA term of lora_apply inside -------------------------------------------------
# ``lora_apply(matmul(x, w), x, A, B, idx)`` absorbed into the projection (passes/llm_fusions.py,
# LORA_EPILOGUE_RULES). Inputs: the matmul's (plus the addend), then ``A [S, R, K]``, ``B [N, S, R]``
# and ``idx [T]`` of lora_apply; x must be the matmul's own left operand, w an [N, K] weight.
_CELL_ALIGN = 64          # float32 cells (256 bytes): every workspace region starts aligned


def _round_cells(n: int) -> int:
    return -(-n // _CELL_ALIGN) * _CELL_ALIGN


def lora_workspace_layout(x: Spec, w: Spec, a: Spec, *, product: bool) -> tuple[int, int]:
    """``(product cells, LoRA cells)`` per row of a LoRA matmul's float32 workspace ``[T · (p + l)]``:
    rows ``[0, T·p)`` hold the ``[T, N]`` product in x's dtype (``product``: the SwiGLU op's GEMM
    result before ``silu_mul``; else 0), then ``T·l`` cells the LoRA scratch — the shrink's float32
    split-K partials ``[T, splits, R]`` (a few rows) or the slot-dense ``[T, S·R]`` in x's dtype
    (many rows). Each part is a multiple of 256 bytes per row."""
    slots, rank, k = a.shape
    if not all(isinstance(v, int) for v in (slots, rank, k)) or not isinstance(w.shape[0], int):
        raise GraphDSLError(f"LoRA matmul: A {shape_str(a.shape)} and w {shape_str(w.shape)} need static extents")
    splits = -(-k // LORA_SPLIT_K)
    prod = _round_cells(-(-w.shape[0] * x.dtype.itemsize // 4)) if product else 0
    return prod, _round_cells(rank * max(splits, slots))


def _lora_workspace(x: Spec, w: Spec, *factors: Spec, product: bool = False) -> Spec:
    a = factors[-3]
    prod, lora = lora_workspace_layout(x, w, a, product=product)
    return Spec((x.shape[0] * (prod + lora),), torch.float32)


def _check_lora(op: str, x: Spec, w: Spec, out_rows, factors) -> None:
    check(len(factors) == 3, op, f"takes A, B and indices after the matmul operands, got {len(factors)} more inputs")
    a, b, idx = factors
    y = get_op("matmul").shape(x, w, transpose_b=True)
    check(len(x.shape) == 2 and len(w.shape) == 2, op,
          f"x and w must be 2-D, got {shape_str(x.shape)} and {shape_str(w.shape)}")
    get_op("lora_apply").shape(Spec(tuple(y.shape), y.dtype), x, a, b, idx)
    check(same_extent(b.shape[0], out_rows) is not False, op,
          f"B's out features {b.shape[0]} differ from the weight's rows {out_rows}")


def _matmul_lora_rule(x: Spec, w: Spec, *factors: Spec):
    _check_lora("matmul_lora", x, w, w.shape[0], factors)
    return get_op("matmul").shape(x, w, transpose_b=True)


@register_op("matmul_lora", category=OpCategory.MATMUL, shape=_matmul_lora_rule, workspace=_lora_workspace)
def matmul_lora(x, w, *factors):
    """``lora_apply(x @ w.T, x, A, B, idx)`` (``factors = A, B, idx``): the projection plus each row's
    adapter term ``(x[t]·A[s]ᵀ)·B[:, s]ᵀ``, ``s = idx[t]`` (``s < 0``: none). A decode GEMV adds the
    term to its float32 accumulator in the epilogue after one shrink launch; many rows add it with
    one GEMM over the slot-dense shrink."""
    y = get_op("matmul").reference(x, w, transpose_b=True)
    return get_op("lora_apply").reference(y, x, *factors)


def _matmul_add_lora_rule(x: Spec, w: Spec, c: Spec, *factors: Spec):
    _check_lora("matmul_add_lora", x, w, w.shape[0], factors)
    return binary_rule("matmul_add_lora")(get_op("matmul").shape(x, w, transpose_b=True), c)


@register_op("matmul_add_lora", category=OpCategory.MATMUL, shape=_matmul_add_lora_rule, workspace=_lora_workspace)
def matmul_add_lora(x, w, c, *factors):
    """``lora_apply(x @ w.T, x, A, B, idx) + c``: ``matmul_lora`` with the bias ``[N]`` or residual
    ``[T, N]`` ``c`` added after the LoRA term (as ``matmul_add``'s epilogue)."""
    return torch.add(get_op("matmul_lora").reference(x, w, *factors), c)


def _matmul_silu_mul_lora_rule(x: Spec, w: Spec, *factors: Spec):
    _check_lora("matmul_silu_mul_lora", x, w, w.shape[0], factors)
    return _silu_mul_rule(get_op("matmul").shape(x, w, transpose_b=True))


@register_op("matmul_silu_mul_lora", category=OpCategory.MATMUL, shape=_matmul_silu_mul_lora_rule,
             workspace=lambda x, w, *factors: _lora_workspace(x, w, *factors, product=True))
def matmul_silu_mul_lora(x, w, *factors):
    """``silu_mul(lora_apply(x @ w.T, x, A, B, idx))``: the packed ``[gate | up]`` projection, each
    row's adapter term added to gate and up (B's rows are the weight's), then SwiGLU — as
    ``matmul_silu_mul``, the LoRA term inside the GEMV's float32 accumulator before the split."""
    return get_op("silu_mul").reference(get_op("matmul_lora").reference(x, w, *factors))


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
             "quant_linear_silu_mul": quant_linear_silu_mul, "quant_linear_add": quant_linear_add,
             "matmul_lora": matmul_lora, "matmul_add_lora": matmul_add_lora,
             "matmul_silu_mul_lora": matmul_silu_mul_lora, "fused": fused}
