"""torch functions called on graph tensors record graphdsl ops (``Tensor.__torch_function__``).

``torch.relu(t)``, ``torch.nn.functional.silu(t)``, ``torch.cat([a, b], -1)`` ... on a
:class:`~graphdsl.Tensor` look the function up in :data:`TORCH_FUNCTIONS` — a table of torch
function → an adapter with torch's signature that calls :mod:`graphdsl.functional` — and record
that op. A torch function with no graphdsl op, or an argument the op cannot honour (``out=``,
``inplace=True``, ``rounding_mode=``), is a :class:`~graphdsl.GraphDSLError` naming the function.

One semantic difference is kept on purpose: ``torch.nn.functional.linear(x, w)`` is torch's
``x @ w.T`` (``w`` is ``[out, in]``), while graphdsl's own ``F.linear(x, w)`` keeps the seed's
``x @ w``; each does what its name says where it comes from.
"""
from __future__ import annotations

import builtins

import torch
import torch.nn.functional as TF

from . import functional as F
from .errors import GraphDSLError, user_frame

__all__ = ["TORCH_FUNCTIONS", "record_torch_function", "torch_name"]


def _refuse(func_name: str, **given) -> None:
    """Raise for torch arguments that have no graphdsl equivalent when they are not at their default."""
    for name, (value, default) in given.items():
        if value is not default and value != default:
            raise GraphDSLError(f"{func_name}: {name}={value!r} is not supported on graph tensors "
                                f"(only the default {default!r}) (at {user_frame()})")


def _add(input, other, *, alpha=1, out=None):
    _refuse("torch.add", out=(out, None))
    return F.add(input, other if alpha == 1 else other * alpha)


def _sub(input, other, *, alpha=1, out=None):
    _refuse("torch.sub", out=(out, None))
    return F.sub(input, other if alpha == 1 else other * alpha)


def _div(input, other, *, rounding_mode=None, out=None):
    _refuse("torch.div", rounding_mode=(rounding_mode, None), out=(out, None))
    return F.div(input, other)


def _binary(fn, name):
    def op(input, other, *, out=None):
        _refuse(name, out=(out, None))
        return fn(input, other)
    return op


def _unary(fn, name):
    def op(input, *, out=None):
        _refuse(name, out=(out, None))
        return fn(input)
    return op


def _activation(fn, name):
    def op(input, inplace=False):
        _refuse(name, inplace=(inplace, False))
        return fn(input)
    return op


def _gelu(input, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise GraphDSLError(f"torch.nn.functional.gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return F.gelu(input) if approximate == "none" else F.gelu_tanh(input)


def _softmax(input, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise GraphDSLError(f"softmax on graph tensor '{input.name}': give dim (at {user_frame()})")
    return F.softmax(input if dtype is None else F.cast(input, dtype), dim)


def _reduce(fn, name):
    def op(input, dim=None, keepdim=False, *, dtype=None, out=None):
        _refuse(name, out=(out, None))
        x = input if dtype is None else F.cast(input, dtype)
        return fn(x, tuple(dim) if isinstance(dim, list) else dim, keepdim)
    return op


def _amax(input, dim=(), keepdim=False, *, out=None):
    _refuse("torch.amax", out=(out, None))
    return F.max(input, None if dim == () else dim, keepdim)


def _max(input, dim=None, keepdim=False, *, out=None):
    """``torch.max(x)`` (a value) or ``torch.max(x, dim)`` (values, indices); ``torch.max(a, b)``
    (elementwise maximum) has no graphdsl op."""
    _refuse("torch.max", out=(out, None))
    if dim is None:
        return F.max(input)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise GraphDSLError(f"torch.max(a, b) (elementwise maximum) has no graphdsl op; use "
                            f"F.where(a > b, a, b) (at {user_frame()})")
    return F.max(input, dim, keepdim), F.argmax(input, dim=dim, keepdim=keepdim)


def _argmax(input, dim=None, keepdim=False):
    if dim is None:
        raise GraphDSLError(f"torch.argmax on graph tensor '{input.name}': give dim (at {user_frame()})")
    return F.argmax(input, dim=dim, keepdim=keepdim)


def _topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):  # noqa: A002 - torch names
    _refuse("torch.topk", largest=(largest, True), sorted=(sorted, True), out=(out, None))
    return F.topk(input, k=k, dim=dim)


def _cat(tensors, dim=0, *, out=None):
    _refuse("torch.cat", out=(out, None))
    return F.cat(list(tensors), dim)


def _split(tensor, split_size_or_sections, dim=0):
    """torch's int is a chunk *size* (the last chunk may be smaller); graphdsl's is a part count."""
    if isinstance(split_size_or_sections, int):
        extent = tensor.shape[dim] if tensor.shape is not None else None
        if not isinstance(extent, int):
            raise GraphDSLError(f"torch.split by chunk size needs a known extent of dim {dim}, got "
                                f"{extent!r}; use F.split(x, number_of_parts, dim) (at {user_frame()})")
        size = split_size_or_sections
        sizes = [size] * (extent // size) + ([extent % size] if extent % size else [])
        return F.split(tensor, sizes, dim)
    return F.split(tensor, list(split_size_or_sections), dim)


def _chunk(input, chunks, dim=0):
    return F.split(input, chunks, dim)


def _flatten(input, start_dim=0, end_dim=-1):
    shape = input.shape
    if shape is None:
        raise GraphDSLError(f"flatten on graph tensor '{input.name}' needs its shape (at {user_frame()})")
    n = len(shape)
    start, end = start_dim % builtins.max(n, 1), end_dim % builtins.max(n, 1)
    merged = 1
    for s in shape[start:end + 1]:
        merged = merged * s
    return F.reshape(input, tuple(shape[:start]) + (merged,) + tuple(shape[end + 1:]))


def _squeeze(input, dim=None):
    if dim is None:
        raise GraphDSLError(f"squeeze on graph tensor '{input.name}': give dim (at {user_frame()})")
    return F.squeeze(input, dim=dim)


def _t(input):
    if input.ndim > 2:
        raise GraphDSLError(f"t() / .T expects a tensor of rank <= 2, '{input.name}' has rank {input.ndim}; "
                            f"use .mT (the last two dims) or permute(...) (at {user_frame()})")
    return input if input.ndim < 2 else F.transpose(input, 0, 1)


def _linear(input, weight, bias=None):
    """torch.nn.functional.linear: ``x @ weight.T + bias`` (``weight`` is ``[out, in]``)."""
    return F.linear(input, weight, bias, transpose_b=True)


def _embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):
    _refuse("torch.nn.functional.embedding", max_norm=(max_norm, None))
    return F.embedding(input, weight)


def _last_dim_only(name, input, normalized_shape):
    shape = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list, torch.Size)) else (normalized_shape,)
    if len(shape) != 1 or (input.shape is not None and input.shape[-1] != shape[0]):
        raise GraphDSLError(f"{name}: graphdsl normalises over the last dim only; normalized_shape={shape} "
                            f"does not match '{input.name}' {input.shape} (at {user_frame()})")


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    _last_dim_only("torch.nn.functional.rms_norm", input, normalized_shape)
    if weight is None:
        raise GraphDSLError(f"torch.nn.functional.rms_norm without a weight has no graphdsl op; pass the weight "
                            f"(at {user_frame()})")
    if eps is None:
        eps = torch.finfo(input.dtype or torch.float32).eps
    return F.rms_norm(input, weight, eps=eps)


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    _last_dim_only("torch.nn.functional.layer_norm", input, normalized_shape)
    if weight is None:
        raise GraphDSLError(f"torch.nn.functional.layer_norm without a weight has no graphdsl op; pass the weight "
                            f"(at {user_frame()})")
    return F.layer_norm(input, weight, bias, eps)


def _where(condition, input, other, *, out=None):
    _refuse("torch.where", out=(out, None))
    return F.where(condition, input, other)


TORCH_FUNCTIONS = {
    torch.add: _add, torch.sub: _sub, torch.subtract: _sub,
    torch.mul: _binary(F.mul, "torch.mul"), torch.multiply: _binary(F.mul, "torch.mul"),
    torch.div: _div, torch.divide: _div, torch.true_divide: _binary(F.div, "torch.true_divide"),
    torch.pow: _binary(F.pow, "torch.pow"), torch.matmul: _binary(F.matmul, "torch.matmul"),
    torch.bmm: _binary(F.bmm, "torch.bmm"),
    torch.neg: _unary(F.neg, "torch.neg"), torch.negative: _unary(F.neg, "torch.negative"),
    torch.exp: _unary(F.exp, "torch.exp"), torch.sqrt: _unary(F.sqrt, "torch.sqrt"),
    torch.rsqrt: _unary(F.rsqrt, "torch.rsqrt"), torch.sigmoid: _unary(F.sigmoid, "torch.sigmoid"),
    torch.tanh: _unary(F.tanh, "torch.tanh"), torch.relu: _unary(F.relu, "torch.relu"),
    torch.lt: _binary(F.lt, "torch.lt"), torch.le: _binary(F.le, "torch.le"), torch.gt: _binary(F.gt, "torch.gt"),
    torch.ge: _binary(F.ge, "torch.ge"), torch.eq: _binary(F.eq, "torch.eq"), torch.ne: _binary(F.ne, "torch.ne"),
    torch.where: _where,
    torch.softmax: _softmax, TF.softmax: _softmax,
    TF.relu: _activation(F.relu, "torch.nn.functional.relu"), TF.silu: _activation(F.silu, "torch.nn.functional.silu"),
    TF.gelu: _gelu, TF.sigmoid: F.sigmoid, TF.tanh: F.tanh,
    torch.sum: _reduce(F.sum, "torch.sum"), torch.mean: _reduce(F.mean, "torch.mean"),
    torch.amax: _amax, torch.max: _max, torch.argmax: _argmax, torch.topk: _topk,
    torch.cat: _cat, torch.concat: _cat, torch.concatenate: _cat,
    torch.split: _split, torch.chunk: _chunk,
    torch.reshape: F.reshape, torch.permute: F.permute, torch.transpose: F.transpose, torch.t: _t,
    torch.unsqueeze: lambda input, dim: F.unsqueeze(input, dim=dim), torch.squeeze: _squeeze,
    torch.flatten: _flatten, torch.gather: lambda input, dim, index: F.gather(input, dim, index),
    TF.linear: _linear, TF.embedding: _embedding, TF.rms_norm: _rms_norm, TF.layer_norm: _layer_norm,
}


def torch_name(func) -> str:
    """``torch.relu``, ``torch.nn.functional.silu``, ``torch.Tensor.add``: where ``func`` lives."""
    name = getattr(func, "__name__", repr(func))
    for prefix, namespace in (("torch.nn.functional", TF), ("torch", torch), ("torch.Tensor", torch.Tensor)):
        if getattr(namespace, name, None) is func:
            return f"{prefix}.{name}"
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if module else name


def record_torch_function(func, args: tuple, kwargs: dict):
    """Record the graphdsl op behind ``func(*args, **kwargs)``; raise naming ``func`` when there is none."""
    adapter = TORCH_FUNCTIONS.get(func)
    if adapter is None:
        raise GraphDSLError(
            f"{torch_name(func)}() has no graphdsl op, so it cannot run on graph tensors (at {user_frame()}). "
            "Write it with graphdsl.functional ops, or register one with @graphdsl.register_op. torch functions "
            f"that record ops: {sorted({torch_name(f) for f in TORCH_FUNCTIONS})}")
    try:
        return adapter(*args, **kwargs)
    except TypeError as e:
        raise GraphDSLError(f"{torch_name(func)}: {e} (at {user_frame()})") from None
