"""LoRA over a per-token adapter index: ``lora_apply`` (what BGMV shrink/expand kernels compute)."""
from __future__ import annotations

import torch

from ..dim import same_extent, shape_str
from ..opdef import OpCategory, Spec, check, register_op

__all__ = ["lora_apply"]


def _lora_rule(y: Spec, x: Spec, a: Spec, b: Spec, indices: Spec):
    op = "lora_apply"
    check(len(x.shape) == 2 and len(y.shape) == 2, op,
          f"x and y must be [num_tokens, in] and [num_tokens, out], got {shape_str(x.shape)} and {shape_str(y.shape)}")
    check(len(a.shape) == 3 and len(b.shape) == 3, op,
          f"a and b must be [slots, rank, in] and [slots, out, rank], got {shape_str(a.shape)} and {shape_str(b.shape)}")
    check(len(indices.shape) == 1 and indices.dtype in (torch.int32, torch.int64), op,
          f"indices must be [num_tokens] int32/int64, got {shape_str(indices.shape)} {indices.dtype}")
    for u, v, what in ((x.shape[0], y.shape[0], "tokens of x and y"), (x.shape[0], indices.shape[0], "tokens of x and indices"),
                       (a.shape[0], b.shape[0], "slots of a and b"), (a.shape[1], b.shape[2], "rank of a and b"),
                       (a.shape[2], x.shape[1], "in features of a and x"), (b.shape[1], y.shape[1], "out features of b and y")):
        check(same_extent(u, v) is not False, op, f"{what} differ: {u} vs {v}")
    check(a.dtype == x.dtype and b.dtype == x.dtype, op,
          f"x, a and b must share a dtype, got {x.dtype}, {a.dtype}, {b.dtype}")
    return Spec(tuple(y.shape), y.dtype)


def _lora_workspace(y: Spec, x: Spec, a: Spec, b: Spec, indices: Spec):
    """The float32 shrink result ``x · A[s]ᵀ`` of every token (``[num_tokens * rank]``)."""
    return Spec((x.shape[0] * a.shape[1],), torch.float32)


@register_op("lora_apply", category=OpCategory.CUSTOM, shape=_lora_rule, workspace=_lora_workspace)
def lora_apply(y, x, a, b, indices):
    """``out[t] = y[t] + (x[t] · a[s]ᵀ) · b[s]ᵀ`` with ``s = indices[t]``; rows with ``s < 0`` keep
    ``y[t]``. ``a [S, R, in]`` are the adapters' A factors, ``b [S, out, R]`` their B factors with the
    scaling folded in (zero-padded past each adapter's own rank). Accumulates in float32."""
    out = y.float().clone()
    idx = indices.long()
    for s in torch.unique(idx).tolist():
        if s < 0:
            continue
        rows = (idx == s).nonzero().squeeze(1)
        v = x[rows].float() @ a[s].float().mT
        out[rows] += v @ b[s].float().mT
    return out.to(y.dtype)
