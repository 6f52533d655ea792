"""Routed experts as one op: ``moe_experts`` (what a grouped-GEMM kernel computes), and
``quant_moe_experts``, the same over expert stacks stored in a quantization scheme."""
from __future__ import annotations

import torch

from ..dim import same_extent, shape_str
from ..opdef import OpCategory, Spec, check, register_op
from ..quant import parse_scheme
from .pointwise import ActType

__all__ = ["moe_experts", "quant_moe_experts"]

_GATED = (ActType.SWIGLU, ActType.GEGLU)


def _moe_rule(x: Spec, routing: Spec, gate_up: Spec, down: Spec, *, act=ActType.SWIGLU, top_k=None):
    op = "moe_experts"
    check(act in _GATED, op, f"act must be a gated ActType, one of {[a.name for a in _GATED]}, got {act!r}")
    check(len(x.shape) == 2 and len(routing.shape) == 2, op,
          f"x and routing must be [num_tokens, hidden] and [num_tokens, num_experts], got {shape_str(x.shape)} and "
          f"{shape_str(routing.shape)}")
    check(len(gate_up.shape) == 3 and len(down.shape) == 3, op,
          f"gate_up and down must be [E, 2I, H] and [E, H, I], got {shape_str(gate_up.shape)} and "
          f"{shape_str(down.shape)}")
    check(gate_up.dtype == x.dtype and down.dtype == x.dtype, op,
          f"x, gate_up and down must share a dtype, got {x.dtype}, {gate_up.dtype}, {down.dtype}")
    e, two_i, h = gate_up.shape
    for a, b, what in ((x.shape[0], routing.shape[0], "tokens of x and routing"), (routing.shape[1], e, "experts"),
                       (x.shape[1], h, "hidden of x and gate_up"), (down.shape[0], e, "experts of down"),
                       (down.shape[1], h, "hidden of down")):
        check(same_extent(a, b) is not False, op, f"{what} differ: {a} vs {b}")
    if isinstance(two_i, int) and isinstance(down.shape[2], int):
        check(two_i == 2 * down.shape[2], op, f"gate_up has {two_i} rows an expert, down {down.shape[2]} columns: "
                                              "need 2 x intermediate")
    if isinstance(e, int):
        check(top_k is None or (isinstance(top_k, int) and 1 <= top_k <= e), op,
              f"top_k must be None or an int in [1, {e}], got {top_k!r}")
    return Spec(tuple(x.shape), x.dtype)


@register_op("moe_experts", category=OpCategory.CUSTOM, shape=_moe_rule)
def moe_experts(x, routing, gate_up, down, *, act=ActType.SWIGLU, top_k=None):
    """``Σ_e routing[:, e] · down_e · act([gate_e | up_e] · x)`` — expert ``e``'s gated MLP weighted
    by its routing column. ``routing [T, E]`` holds each token's chosen experts' weights and zeros
    elsewhere; ``top_k`` (None: all) tells a sparse kernel how many per row to compute. The
    reference computes every expert densely, in the input dtype."""
    gate, up = torch.matmul(x, gate_up.mT).chunk(2, dim=-1)                          # [E, T, I] each
    a = torch.nn.functional.silu(gate) if act is ActType.SWIGLU else \
        torch.nn.functional.gelu(gate, approximate="tanh")
    y = torch.matmul(a * up, down.mT)                                                 # [E, T, H]
    return (y * routing.permute(1, 0).unsqueeze(-1).to(y)).sum(0)


def split_stacks(stored, gate_up_scheme: str, down_scheme: str, experts: int, hidden: int, intermediate: int):
    """``(gate_up specs, down specs, gate_up tensors, down tensors)``: the stored tensors of the two
    stacks split by their schemes' companion counts."""
    up = parse_scheme(gate_up_scheme).stack_companions(experts, 2 * intermediate, hidden)
    down = parse_scheme(down_scheme).stack_companions(experts, hidden, intermediate)
    return up, down, stored[:len(up)], stored[len(up):]


def _quant_moe_rule(x: Spec, routing: Spec, *stored: Spec, gate_up_scheme: str, down_scheme: str, experts: int,
                    hidden: int, intermediate: int, act=ActType.SWIGLU, top_k=None):
    op = "quant_moe_experts"
    check(act in _GATED, op, f"act must be a gated ActType, one of {[a.name for a in _GATED]}, got {act!r}")
    check(len(x.shape) == 2 and len(routing.shape) == 2, op,
          f"x and routing must be [num_tokens, hidden] and [num_tokens, num_experts], got {shape_str(x.shape)} and "
          f"{shape_str(routing.shape)}")
    for a, b, what in ((x.shape[0], routing.shape[0], "tokens of x and routing"), (routing.shape[1], experts, "experts"),
                       (x.shape[1], hidden, "hidden of x and the stacks")):
        check(same_extent(a, b) is not False, op, f"{what} differ: {a} vs {b}")
    up, down, up_t, down_t = split_stacks(stored, gate_up_scheme, down_scheme, experts, hidden, intermediate)
    check(len(stored) == len(up) + len(down), op,
          f"schemes {gate_up_scheme} and {down_scheme} store {len(up)} + {len(down)} tensors, got {len(stored)}")
    for which, specs, got in (("gate_up", up, up_t), ("down", down, down_t)):
        for c, t in zip(specs, got):
            check(tuple(t.shape) == c.shape and (c.dtype is None or t.dtype == c.dtype), op,
                  f"{which} stored tensor '{c.suffix}' should be {list(c.shape)} "
                  f"{c.dtype if c.dtype is not None else 'float'}, got {shape_str(t.shape)} {t.dtype}")
    check(top_k is None or (isinstance(top_k, int) and 1 <= top_k <= experts), op,
          f"top_k must be None or an int in [1, {experts}], got {top_k!r}")
    check(x.dtype.is_floating_point, op, f"x must be floating point, got {x.dtype}")
    return Spec(tuple(x.shape), x.dtype)


@register_op("quant_moe_experts", category=OpCategory.CUSTOM, shape=_quant_moe_rule)
def quant_moe_experts(x, routing, *stored, gate_up_scheme: str = "", down_scheme: str = "", experts: int = 0,
                      hidden: int = 0, intermediate: int = 0, act=ActType.SWIGLU, top_k=None):
    """:func:`moe_experts` with the stacks ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` stored in
    quantization schemes: ``stored`` holds the gate/up stack's companions then the down stack's
    (:meth:`~graphdsl.quant.QuantScheme.stack_companions`: each expert's companions stacked). The
    reference dequantizes to float32 the experts some token routes to (an expert with a zero
    routing column adds exactly zero) and computes them densely in float32; the result is in
    ``x``'s dtype."""
    _, _, up_t, down_t = split_stacks(stored, gate_up_scheme, down_scheme, experts, hidden, intermediate)
    used = routing.ne(0).any(0).nonzero().flatten()
    if used.numel() == 0:
        return torch.zeros_like(x)
    pick = [t.index_select(0, used.to(t.device)) for t in up_t], [t.index_select(0, used.to(t.device)) for t in down_t]
    gate_up = parse_scheme(gate_up_scheme).dequantize_stack(pick[0], 2 * intermediate, hidden, torch.float32)
    down = parse_scheme(down_scheme).dequantize_stack(pick[1], hidden, intermediate, torch.float32)
    return moe_experts.opdef.reference(x.float(), routing.index_select(1, used), gate_up, down,
                                       act=act).to(x.dtype)
