"""``quant_linear``: ``x @ W.T`` with ``W`` stored in a quantization scheme (:mod:`graphdsl.quant`).

``F.linear`` records it in place of ``matmul`` when its weight is a quantized
:class:`~graphdsl.Parameter`; the companions (packed data, scales, zero points) are its tensor
inputs after ``x``, in the scheme's order, and the scheme travels as the ``scheme`` attribute
(its canonical name), so ``print(net)``, dumps and reports show it.
"""
from __future__ import annotations

from ..dim import same_extent, shape_str
from ..opdef import OpCategory, Spec, check, register_op
from ..quant import parse_scheme

__all__ = ["quant_linear"]


def _quant_linear_rule(x: Spec, *stored: Spec, scheme: str, out_features: int, in_features: int):
    s = parse_scheme(scheme)
    check(len(x.shape) >= 1 and same_extent(x.shape[-1], in_features) is not False, "quant_linear",
          f"x {shape_str(x.shape)} must end in in_features={in_features}")
    want = s.companions(out_features, in_features)
    check(len(stored) == len(want), "quant_linear",
          f"scheme {s.name} stores {len(want)} tensors ({[c.suffix for c in want]}), got {len(stored)}")
    for c, t in zip(want, stored):
        check(tuple(t.shape) == c.shape and (c.dtype is None or t.dtype == c.dtype), "quant_linear",
              f"scheme {s.name}: stored tensor '{c.suffix}' should be {list(c.shape)} "
              f"{c.dtype if c.dtype is not None else 'float'}, got {shape_str(t.shape)} {t.dtype}")
    check(x.dtype.is_floating_point, "quant_linear", f"x must be floating point, got {x.dtype}")
    return Spec(tuple(x.shape[:-1]) + (out_features,), x.dtype)


@register_op("quant_linear", category=OpCategory.MATMUL, shape=_quant_linear_rule)
def quant_linear(x, *stored, scheme: str = "", out_features: int = 0, in_features: int = 0):
    """``y = x @ W.T``, ``W [out_features, in_features]`` dequantized from ``stored`` by ``scheme``
    (float32 accumulation, the result in ``x``'s dtype)."""
    return parse_scheme(scheme).linear(x, list(stored), out_features, in_features)
