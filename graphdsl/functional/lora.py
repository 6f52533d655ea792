"""LoRA over a per-token adapter index: ``lora_apply`` (what BGMV shrink/expand kernels compute)."""
from __future__ import annotations

import torch

from ..dim import same_extent, shape_str
from ..opdef import OpCategory, Spec, check, register_op

__all__ = ["lora_apply", "LORA_SPLIT_K"]

LORA_SPLIT_K = 256   # in-features one shrink program reduces (the kernels' split-K slice)


def _lora_rule(y: Spec, x: Spec, a: Spec, b: Spec, indices: Spec):
    op = "lora_apply"
    check(len(x.shape) == 2 and len(y.shape) == 2, op,
          f"x and y must be [num_tokens, in] and [num_tokens, out], got {shape_str(x.shape)} and {shape_str(y.shape)}")
    check(len(a.shape) == 3 and len(b.shape) == 3, op,
          f"a and b must be [slots, rank, in] and [out, slots, rank], got {shape_str(a.shape)} and {shape_str(b.shape)}")
    check(len(indices.shape) == 1 and indices.dtype in (torch.int32, torch.int64), op,
          f"indices must be [num_tokens] int32/int64, got {shape_str(indices.shape)} {indices.dtype}")
    for u, v, what in ((x.shape[0], y.shape[0], "tokens of x and y"), (x.shape[0], indices.shape[0], "tokens of x and indices"),
                       (a.shape[0], b.shape[1], "slots of a and b"), (a.shape[1], b.shape[2], "rank of a and b"),
                       (a.shape[2], x.shape[1], "in features of a and x"), (b.shape[0], y.shape[1], "out features of b and y")):
        check(same_extent(u, v) is not False, op, f"{what} differ: {u} vs {v}")
    check(a.dtype == x.dtype and b.dtype == x.dtype, op,
          f"x, a and b must share a dtype, got {x.dtype}, {a.dtype}, {b.dtype}")
    return Spec(tuple(y.shape), y.dtype)


def _lora_workspace(y: Spec, x: Spec, a: Spec, b: Spec, indices: Spec):
    """Scratch for the shrink ``x · Aᵀ`` of every token: float32 ``[num_tokens · rank · max(splits,
    slots)]`` (split-K partials of the per-token kernels, or every slot's product for the dense path)."""
    slots, rank, k = a.shape
    splits = -(-k // LORA_SPLIT_K) if isinstance(k, int) else 1
    width = max(splits, slots) if isinstance(slots, int) else splits
    return Spec((x.shape[0] * rank * width,), torch.float32)


@register_op("lora_apply", category=OpCategory.CUSTOM, shape=_lora_rule, workspace=_lora_workspace)
def lora_apply(y, x, a, b, indices):
    """``out[t] = y[t] + (x[t] · a[s]ᵀ) · b[:, s]ᵀ`` with ``s = indices[t]``; rows with ``s < 0`` keep
    ``y[t]``. ``a [S, R, in]`` are the adapters' A factors, ``b [out, S, R]`` their B factors with the
    scaling folded in (zero-padded past each adapter's own rank; output-major, so all slots' B form
    one ``[out, S·R]`` matrix). Accumulates in float32."""
    out = y.float().clone()
    idx = indices.long()
    for s in torch.unique(idx).tolist():
        if s < 0:
            continue
        rows = (idx == s).nonzero().squeeze(1)
        v = x[rows].float() @ a[s].float().mT
        out[rows] += v @ b[:, s].float().mT
    return out.to(y.dtype)
