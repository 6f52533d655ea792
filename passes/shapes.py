"""Shape equality that sees through the arithmetic reshapes leave behind.

``reshape(-1, 32)`` of a ``[num_tokens, 32]`` tensor records the extent ``num_tokens*32//32``; it
is the same extent as ``num_tokens`` for every value the dim can take. Passes compare extents with
:func:`same_extent_value`: equal as expressions, or equal when evaluated at a set of sample
values of their free dims (integers, so ``//`` rounding is checked too).
"""
from __future__ import annotations

from graphdsl.dim import DimExpr

__all__ = ["same_extent_value", "same_shape"]

_SAMPLES = (1, 2, 3, 5, 7, 8, 13, 64, 100, 1000, 4096)


def same_extent_value(a, b) -> bool:
    if a == b:
        return True
    if isinstance(a, int) and isinstance(b, int):
        return False
    dims = set()
    for x in (a, b):
        if isinstance(x, DimExpr):
            dims |= {d.name for d in x.free_dims()}
    for v in _SAMPLES:
        binding = {d: v for d in dims}
        va = a if isinstance(a, int) else a.evaluate(binding)
        vb = b if isinstance(b, int) else b.evaluate(binding)
        if va != vb:
            return False
    return True


def same_shape(a, b) -> bool:
    """True when shapes ``a`` and ``b`` (tuples of ints/Dims) are equal for every binding."""
    if a is None or b is None or len(a) != len(b):
        return False
    return all(same_extent_value(x, y) for x, y in zip(a, b))
