"""Pointwise ops: out[i] = f(in0[i], in1[i], ...) with numpy broadcasting.

Python numbers become 0-d ``scalar`` tensors of the other operand's dtype (torch's "weak scalar"
rule). Binary arithmetic follows torch's type promotion; ``div`` is true division.
"""
from __future__ import annotations

import enum

import torch

from ..dtypes import to_dtype
from ..opdef import OpCategory, Spec, check, register_op, same_as
from ._rules import binary_rule, broadcast_shapes, unary_float_rule

__all__ = ["scalar", "add", "sub", "mul", "div", "neg", "exp", "rsqrt", "sqrt", "pow", "silu", "gelu",
           "gelu_tanh", "sigmoid", "tanh", "relu", "where", "cast", "lt", "le", "gt", "ge", "eq", "ne",
           "ActType", "activation"]

P = OpCategory.POINTWISE


def _scalar_rule(like: Spec, *, value):
    check(isinstance(value, (int, float)) and not isinstance(value, bool), "scalar",
          f"value must be an int or float, got {value!r}")
    if isinstance(value, float) and not like.dtype.is_floating_point:
        return Spec((), torch.float32)
    if like.dtype == torch.bool:        # an int next to bool is int64 in torch (True + 2 == 3)
        return Spec((), torch.int64)
    return Spec((), like.dtype)


@register_op("scalar", category=P, shape=_scalar_rule)
def scalar(like, *, value=0):
    """0-d constant ``value``; its dtype follows ``like`` (float32 for a float next to an int or
    bool, int64 for an int next to a bool)."""
    dt = like.dtype if (isinstance(value, int) or like.dtype.is_floating_point) else torch.float32
    dt = torch.int64 if dt == torch.bool else dt
    return torch.full((), value, dtype=dt, device=like.device)   # a fill, not a copy: CUDA-graph safe


@register_op("add", category=P, shape=binary_rule("add"))
def add(a, b):
    """a + b"""
    return torch.add(a, b)


@register_op("sub", category=P, shape=binary_rule("sub"))
def sub(a, b):
    """a - b"""
    return torch.sub(a, b)


@register_op("mul", category=P, shape=binary_rule("mul"))
def mul(a, b):
    """a * b"""
    return torch.mul(a, b)


@register_op("div", category=P, shape=binary_rule("div", true_div=True))
def div(a, b):
    """a / b (true division; integers give float32)"""
    return torch.div(a, b)


@register_op("pow", category=P, shape=binary_rule("pow"))
def pow(x, exponent):  # noqa: A001 - torch name
    """x ** exponent"""
    return torch.pow(x, exponent)


@register_op("neg", category=P, shape=same_as(0))
def neg(x):
    """-x"""
    return torch.neg(x)


@register_op("exp", category=P, shape=unary_float_rule("exp"))
def exp(x):
    """e ** x"""
    return torch.exp(x)


@register_op("sqrt", category=P, shape=unary_float_rule("sqrt"))
def sqrt(x):
    """x ** 0.5"""
    return torch.sqrt(x)


@register_op("rsqrt", category=P, shape=unary_float_rule("rsqrt"))
def rsqrt(x):
    """1 / sqrt(x)"""
    return torch.rsqrt(x)


@register_op("sigmoid", category=P, shape=unary_float_rule("sigmoid"))
def sigmoid(x):
    """1 / (1 + exp(-x))"""
    return torch.sigmoid(x)


@register_op("tanh", category=P, shape=unary_float_rule("tanh"))
def tanh(x):
    """tanh(x)"""
    return torch.tanh(x)


@register_op("silu", category=P, shape=unary_float_rule("silu"))
def silu(x):
    """x * sigmoid(x)"""
    return torch.nn.functional.silu(x if x.is_floating_point() else x.float())


@register_op("gelu", category=P, shape=unary_float_rule("gelu"))
def gelu(x):
    """x * Φ(x) = x/2 * (1 + erf(x / √2))"""
    return torch.nn.functional.gelu(x if x.is_floating_point() else x.float())


@register_op("gelu_tanh", category=P, shape=unary_float_rule("gelu_tanh"))
def gelu_tanh(x):
    """x/2 * (1 + tanh(√(2/π) * (x + 0.044715 x³)))"""
    return torch.nn.functional.gelu(x if x.is_floating_point() else x.float(), approximate="tanh")


@register_op("relu", category=P, shape=same_as(0))
def relu(x):
    """max(x, 0)"""
    return torch.relu(x)


def _where_rule(cond: Spec, a: Spec, b: Spec, **_):
    check(cond.dtype == torch.bool, "where", f"cond must be bool, got {cond.dtype}")
    shape = broadcast_shapes([cond.shape, a.shape, b.shape], "where")
    return Spec(shape, binary_rule("where")(a, b).dtype)


@register_op("where", category=P, shape=_where_rule)
def where(cond, a, b):
    """a where cond else b"""
    return torch.where(cond, a, b)


def _cast_rule(x: Spec, *, dtype):
    return Spec(x.shape, to_dtype(dtype, "cast dtype"))


@register_op("cast", category=P, shape=_cast_rule)
def _cast(x, *, dtype=torch.float32):
    """x converted to ``dtype``"""
    return x.to(to_dtype(dtype))


def _cast_like_rule(x: Spec, like: Spec):
    return Spec(x.shape, like.dtype)


@register_op("cast_like", category=P, shape=_cast_like_rule)
def _cast_like(x, like):
    """x converted to ``like``'s dtype (known only when the engine specialises)"""
    return x.to(like.dtype)


def cast(x, dtype):
    """x converted to ``dtype``: a torch dtype, a name such as ``"bfloat16"``, or another tensor
    (its dtype, which may be unknown while recording)."""
    from ..tensor import Tensor
    if isinstance(dtype, Tensor):
        return _cast(x, dtype=dtype.dtype) if dtype.dtype is not None else _cast_like(x, dtype)
    if dtype is None:
        from ..errors import GraphDSLError
        raise GraphDSLError("cast: dtype must be a torch dtype or a name such as 'bfloat16', got None; to follow "
                            "a tensor whose dtype is not known while recording, pass the tensor: x.to(y)")
    return _cast(x, dtype=to_dtype(dtype, "cast dtype"))


def _compare(name: str, fn):
    @register_op(name, category=P, shape=binary_rule(name, out_dtype=torch.bool))
    def op(a, b):
        return fn(a, b)
    op.__doc__ = f"elementwise torch.{name}(a, b) -> bool"
    op.__name__ = name
    return op


lt = _compare("lt", torch.lt)
le = _compare("le", torch.le)
gt = _compare("gt", torch.gt)
ge = _compare("ge", torch.ge)
eq = _compare("eq", torch.eq)
ne = _compare("ne", torch.ne)


class ActType(enum.Enum):
    """Activations for :func:`activation` (seed name ``ActType``)."""

    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU = "relu"
    SIGMOID = "sigmoid"
    SWIGLU = "swiglu"    # x = [gate | up] on the last dim -> silu(gate) * up
    GEGLU = "geglu"      # x = [gate | up] -> gelu_tanh(gate) * up


def activation(x, act: ActType):
    """Apply ``act``. Gated kinds (SWIGLU, GEGLU) split the last dim in two halves [gate | up]."""
    from .movement import split
    if not isinstance(act, ActType):
        from ..errors import GraphDSLError
        raise GraphDSLError(f"activation: act must be an ActType, one of {[a.name for a in ActType]}, got {act!r}")
    if act in (ActType.SWIGLU, ActType.GEGLU):
        gate, up = split(x, 2, -1)
        return (silu(gate) if act is ActType.SWIGLU else gelu_tanh(gate)) * up
    return {ActType.SILU: silu, ActType.GELU: gelu, ActType.GELU_TANH: gelu_tanh,
            ActType.RELU: relu, ActType.SIGMOID: sigmoid}[act](x)

