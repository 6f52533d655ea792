"""Reductions and row ops (softmax, argmax, topk, rms_norm, layer_norm).

Row ops reduce along one dim (the last, for norms) and then apply a pointwise epilogue; they are
REDUCTION ops so generic fusion may end a pointwise group with one of them. Norms and softmax
compute in float32 and return the input dtype, as HF transformers does.
"""
from __future__ import annotations

import torch

from ..opdef import OpCategory, Spec, check, register_op
from ._rules import broadcast_shapes, float_dtype, norm_dim, promote

__all__ = ["sum", "mean", "max", "softmax", "argmax", "topk", "rms_norm", "layer_norm"]

R = OpCategory.REDUCTION


def _dims(dim, ndim: int, op: str) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    dims = dim if isinstance(dim, tuple) else (dim,)
    out = tuple(sorted({norm_dim(d, ndim, op) for d in dims}))
    check(len(out) == len(dims), op, f"dim {dim} names one axis twice")
    return out


def _reduce_rule(op: str, *, float_out: bool = False, dtype=None):
    def rule(x: Spec, *, dim=None, keepdim=False, **_):
        dims = _dims(dim, len(x.shape), op)
        shape = tuple(1 if i in dims else s for i, s in enumerate(x.shape) if keepdim or i not in dims)
        out = dtype or (float_dtype(x.dtype) if float_out else x.dtype)
        return Spec(shape, out)
    return rule


def _sum_rule(x: Spec, *, dim=None, keepdim=False):
    # like torch.sum: integer and bool inputs sum to int64
    return _reduce_rule("sum", dtype=None if x.dtype.is_floating_point else torch.int64)(x, dim=dim, keepdim=keepdim)


@register_op("sum", category=R, shape=_sum_rule)
def sum(x, *, dim=None, keepdim=False):  # noqa: A001 - torch name
    """Σ x over ``dim`` (all dims when None); integer and bool inputs give int64."""
    return torch.sum(x, dim=dim if dim is not None else tuple(range(x.ndim)), keepdim=keepdim)


@register_op("mean", category=R, shape=_reduce_rule("mean", float_out=True))
def mean(x, *, dim=None, keepdim=False):
    """(Σ x) / n over ``dim`` (all dims when None)."""
    return torch.mean(x if x.is_floating_point() else x.float(),
                      dim=dim if dim is not None else tuple(range(x.ndim)), keepdim=keepdim)


@register_op("max", category=R, shape=_reduce_rule("max"))
def max(x, *, dim=None, keepdim=False):  # noqa: A001 - torch name
    """max of x over ``dim`` (values only, like torch.amax)."""
    return torch.amax(x, dim=dim if dim is not None else tuple(range(x.ndim)), keepdim=keepdim)


def _argmax_rule(x: Spec, *, dim=-1, keepdim=False):
    return _reduce_rule("argmax", dtype=torch.int64)(x, dim=dim, keepdim=keepdim)


@register_op("argmax", category=R, shape=_argmax_rule)
def argmax(x, *, dim=-1, keepdim=False):
    """index of the (first) maximum along ``dim``, int64."""
    return torch.argmax(x, dim=dim, keepdim=keepdim)


def _softmax_rule(x: Spec, *, dim=-1):
    norm_dim(dim, len(x.shape), "softmax")
    check(x.dtype.is_floating_point, "softmax", f"needs a floating dtype, got {x.dtype}")
    return x


@register_op("softmax", category=R, shape=_softmax_rule)
def softmax(x, *, dim=-1):
    """softmax(x)_i = exp(x_i - max x) / Σ_j exp(x_j - max x) along ``dim`` (float32 inside)."""
    return torch.softmax(x.float(), dim=dim).to(x.dtype)


def _topk_rule(x: Spec, *, k=1, dim=-1):
    d = norm_dim(dim, len(x.shape), "topk")
    check(isinstance(k, int) and k >= 1, "topk", f"k must be a positive int, got {k!r}")
    size = x.shape[d]
    check(not isinstance(size, int) or k <= size, "topk", f"k={k} exceeds the size {size} of dim {dim}")
    shape = tuple(k if i == d else s for i, s in enumerate(x.shape))
    return Spec(shape, x.dtype), Spec(shape, torch.int64)


@register_op("topk", category=R, shape=_topk_rule, num_outputs=2)
def topk(x, *, k=1, dim=-1):
    """(values, indices) of the k largest entries along ``dim``, sorted descending."""
    out = torch.topk(x, k, dim=dim, largest=True, sorted=True)
    return out.values, out.indices


def _norm_rule(op: str):
    def rule(x: Spec, weight: Spec, *bias: Spec, eps=1e-6):
        check(len(x.shape) >= 1, op, "input must have rank >= 1")
        for w, what in [(weight, "weight")] + [(b, "bias") for b in bias]:
            check(len(w.shape) == 1, op, f"{what} must be 1-D, got shape {list(w.shape)}")
            broadcast_shapes([x.shape[-1:], w.shape], op)
        check(isinstance(eps, (int, float)) and eps >= 0, op, f"eps must be a number >= 0, got {eps!r}")
        return Spec(x.shape, promote([x.dtype, weight.dtype]))
    return rule


@register_op("rms_norm", category=R, shape=_norm_rule("rms_norm"))
def rms_norm(x, weight, *, eps=1e-6):
    """y = weight * (x / sqrt(mean(x², last dim) + eps)); the normalisation in float32, then cast
    back to x's dtype before the weight multiply (HF Llama order)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


@register_op("layer_norm", category=R, shape=_norm_rule("layer_norm"))
def _layer_norm(x, weight, *bias, eps=1e-5):
    """y = (x - mean) / sqrt(var + eps) * weight (+ bias), over the last dim, in float32."""
    b = bias[0].float() if bias else None
    y = torch.nn.functional.layer_norm(x.float(), x.shape[-1:], weight.float(), b, eps)
    return y.to(promote([x.dtype, weight.dtype]))



def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """y = (x - mean) / sqrt(var + eps) * weight (+ bias) over the last dim."""
    return _layer_norm(x, weight, eps=eps) if bias is None else _layer_norm(x, weight, bias, eps=eps)
