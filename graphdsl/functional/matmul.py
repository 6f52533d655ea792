"""Matrix products: ``matmul`` (batched, with transpose flags) and ``linear`` on top of it."""
from __future__ import annotations

import torch

from ..dim import same_extent, shape_str
from ..opdef import OpCategory, Spec, check, register_op
from ._rules import at_user_line, broadcast_shapes

__all__ = ["matmul", "bmm", "linear"]


def _matmul_rule(a: Spec, b: Spec, *, transpose_a=False, transpose_b=False):
    check(len(a.shape) >= 2 and len(b.shape) >= 2, "matmul",
          f"operands need rank >= 2, got {shape_str(a.shape)} and {shape_str(b.shape)}")
    check(a.dtype == b.dtype, "matmul", f"operands must share a dtype, got {a.dtype} and {b.dtype}")
    m, ka = (a.shape[-1], a.shape[-2]) if transpose_a else (a.shape[-2], a.shape[-1])
    kb, n = (b.shape[-1], b.shape[-2]) if transpose_b else (b.shape[-2], b.shape[-1])
    check(same_extent(ka, kb) is not False, "matmul",
          f"inner dims differ: {shape_str(a.shape)}{'ᵀ' if transpose_a else ''} @ "
          f"{shape_str(b.shape)}{'ᵀ' if transpose_b else ''} ({ka} vs {kb})")
    batch = broadcast_shapes([a.shape[:-2], b.shape[:-2]], "matmul") if len(a.shape) + len(b.shape) > 4 else ()
    return Spec(tuple(batch) + (m, n), a.dtype)


@register_op("matmul", category=OpCategory.MATMUL, shape=_matmul_rule)
def matmul(a, b, *, transpose_a=False, transpose_b=False):
    """op(a) @ op(b), op = transpose of the last two dims when the flag is set; batch dims
    broadcast as in torch.matmul."""
    return torch.matmul(a.mT if transpose_a else a, b.mT if transpose_b else b)


@at_user_line
def bmm(a, b, transpose_a: bool = False, transpose_b: bool = False):
    """Batched matmul of rank-3 operands."""
    check(a.shape is None or len(a.shape) == 3, "bmm", f"a must be rank 3, got {shape_str(a.shape)}")
    check(b.shape is None or len(b.shape) == 3, "bmm", f"b must be rank 3, got {shape_str(b.shape)}")
    return matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)


@at_user_line
def linear(x, weight, bias=None, transpose_a: bool = False, transpose_b: bool = False):
    """x @ weight (+ bias) — seed semantics: without transposes, ``weight`` is [in, out].

    HF checkpoints (and ``torch.nn.functional.linear``) store [out, in]: pass ``transpose_b=True``.
    A quantized :class:`~graphdsl.Parameter` (``weight.quant`` set) records ``quant_linear`` on its
    companions instead of ``matmul``.
    """
    if not transpose_b and x.shape is not None and weight.shape is not None and len(weight.shape) >= 2 \
            and len(x.shape) >= 1:
        k = x.shape[-2] if transpose_a and len(x.shape) >= 2 else x.shape[-1]
        check(same_extent(k, weight.shape[-2]) is not False or same_extent(k, weight.shape[-1]) is False, "linear",
              f"x {shape_str(x.shape)} @ weight {shape_str(weight.shape)}: inner dims differ ({k} vs "
              f"{weight.shape[-2]}). graphdsl's F.linear computes x @ weight (weight [in, out], the seed's "
              "layout); this weight looks like torch's [out, in]: pass transpose_b=True")
    scheme = getattr(weight, "quant", None)
    if scheme is not None:
        check(transpose_b and not transpose_a, "linear",
              f"quantized weight '{weight.name}' ({scheme.name}) is [out, in]: pass transpose_b=True, no transpose_a")
        from .quant import quant_linear
        out_f, in_f = weight.shape
        parts = weight.companions()
        if scheme.permutes_input:       # act-order int4: the inputs in the groups' order first
            from .movement import gather
            x, parts = gather(x, -1, parts[-1]), parts[:-1]
        out = quant_linear(x, *parts, scheme=scheme.kernel_scheme.name, out_features=out_f, in_features=in_f)
    else:
        out = matmul(x, weight, transpose_a=transpose_a, transpose_b=transpose_b)
    return out if bias is None else out + bias
