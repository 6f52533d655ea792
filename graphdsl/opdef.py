"""The op registry: each op defined once, its parts side by side.

An :class:`OpDef` holds an op's

* **shape rule** — ``shape(*input_specs, **attrs) -> Spec | tuple[Spec, ...]``, run when the op
  is recorded (with whatever is known) and again with concrete shapes when an engine specialises;
* **torch reference** — ``reference(*torch_tensors, **attrs)``: the op's semantics, and the
  implementation the CPU/``torch`` backend runs;
* **category** — one of the closed set :class:`OpCategory`; passes ask "is this pointwise", never
  compare op names;
* **workspace rule** (optional) — ``workspace(*input_specs, **attrs) -> Spec | None``: scratch a
  backend may use while it runs the node (a fused op's intermediate that some lowerings need);
  the memory plan gives it arena bytes live during that node only, so no lowering allocates;
* **docstring** — the math.

:func:`register_op` is the public decorator: it turns a torch reference function into a
recording function with the same signature. Positional parameters are tensor inputs (a
``*args`` parameter makes the op variadic); keyword-only parameters are attributes with their
defaults::

    @gd.register_op("swish", category=gd.OpCategory.POINTWISE, shape=gd.same_as(0))
    def swish(x, *, beta: float = 1.0):
        \"\"\"swish(x) = x * sigmoid(beta * x)\"\"\"
        return x * torch.sigmoid(beta * x)

    y = swish(Tensor("x"), beta=2.0)   # records a node; engines run the body on real tensors
"""
from __future__ import annotations

import enum
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .errors import GraphDSLError, ShapeError

__all__ = ["OpCategory", "Spec", "OpDef", "RuntimeParam", "register_op", "get_op", "registered_ops", "same_as"]


@dataclass(frozen=True)
class RuntimeParam:
    """An attribute value supplied per call through ``engine.forward(..., runtime_params={name: v})``
    (host-side values such as a window size chosen at run time)."""

    name: str


class OpCategory(enum.Enum):
    """The closed set of op kinds that passes reason about."""

    POINTWISE = "pointwise"        # out[i] depends on in[i] only (with broadcasting)
    REDUCTION = "reduction"        # reduces along dims; row ops (softmax, rms_norm) included
    MATMUL = "matmul"
    ATTENTION = "attention"
    VIEW = "view"                  # output aliases input storage (reshape, permute, slice)
    DATA_MOVEMENT = "data_movement"  # copies data without arithmetic (gather, cat, cache writes)
    COLLECTIVE = "collective"
    CUSTOM = "custom"


@dataclass(frozen=True)
class Spec:
    """What is known of a tensor: its shape (ints/Dims) and dtype; None means unknown."""

    shape: tuple | None
    dtype: torch.dtype | None

    @property
    def known(self) -> bool:
        return self.shape is not None and self.dtype is not None


@dataclass
class OpDef:
    name: str
    category: OpCategory
    shape: Callable[..., Any]
    reference: Callable[..., Any]
    tensor_params: tuple[str, ...]
    variadic: bool
    attr_defaults: dict[str, Any]
    num_outputs: int | Callable[[dict], int] = 1
    inplace: dict[int, int] = field(default_factory=dict)   # output index -> aliased input index
    doc: str = ""
    workspace: Callable[..., Any] | None = None              # input specs, attrs -> scratch Spec | None

    def n_outputs(self, attrs: dict) -> int:
        return self.num_outputs(attrs) if callable(self.num_outputs) else self.num_outputs

    def infer(self, specs: list[Spec], attrs: dict) -> list[Spec]:
        """Run the shape rule; unknown inputs (or attributes given per call) give unknown outputs."""
        n = self.n_outputs(attrs)
        if not all(s.known for s in specs) or any(isinstance(v, RuntimeParam) for v in attrs.values()):
            return [Spec(None, None)] * n
        out = self.shape(*specs, **attrs)
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(out) != n:
            raise GraphDSLError(f"op '{self.name}': shape rule returned {len(out)} specs, expected {n}")
        return out

    def run(self, tensors: list[torch.Tensor], attrs: dict) -> list[torch.Tensor]:
        """Run the torch reference and return its outputs as a list."""
        out = self.reference(*tensors, **attrs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def workspace_spec(self, specs: list[Spec], attrs: dict) -> Spec | None:
        """The scratch a backend may use while running this node (``None``: none), from concrete specs."""
        return None if self.workspace is None else self.workspace(*specs, **attrs)


_REGISTRY: dict[str, OpDef] = {}


def get_op(name: str) -> OpDef:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise GraphDSLError(f"unknown op '{name}'; registered ops: {sorted(_REGISTRY)}") from None


def registered_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)


def same_as(i: int = 0):
    """Shape rule: the output has input ``i``'s shape and dtype."""
    def rule(*specs, **_attrs):
        return specs[i]
    rule.__name__ = f"same_as_{i}"
    return rule


def register_op(name: str, *, category: OpCategory, shape: Callable[..., Any],
                num_outputs: int | Callable[[dict], int] = 1, inplace: dict[int, int] | None = None,
                workspace: Callable[..., Any] | None = None, replace: bool = False):
    """Register ``reference`` as op ``name``; return a function that records it.

    The recorder takes the reference's tensor parameters positionally (a Python number where a
    pointwise op expects a tensor becomes a 0-d constant of the other operand's dtype), then its
    keyword-only attributes positionally or by keyword. ``workspace`` is the optional scratch rule
    (module docstring). Re-registering a name is an error unless ``replace=True``.
    """
    if not isinstance(category, OpCategory):
        raise GraphDSLError(f"register_op('{name}'): category must be an OpCategory, one of "
                            f"{[c.name for c in OpCategory]}, got {category!r}")

    def deco(reference: Callable) -> Callable:
        if name in _REGISTRY and not replace:
            raise GraphDSLError(f"op '{name}' is already registered; pass replace=True to override it")
        sig = inspect.signature(reference)
        tensor_params, attr_defaults, variadic = [], {}, False
        for p in sig.parameters.values():
            if p.kind is p.VAR_POSITIONAL:
                variadic = True
            elif p.kind is p.KEYWORD_ONLY:
                attr_defaults[p.name] = None if p.default is p.empty else p.default
            elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                tensor_params.append(p.name)
            else:
                raise GraphDSLError(f"register_op('{name}'): **{p.name} is not supported; declare attributes "
                                    "as keyword-only parameters")
        opdef = OpDef(name=name, category=category, shape=shape, reference=reference,
                      tensor_params=tuple(tensor_params), variadic=variadic, attr_defaults=attr_defaults,
                      num_outputs=num_outputs, inplace=dict(inplace or {}),
                      doc=inspect.getdoc(reference) or "", workspace=workspace)
        _REGISTRY[name] = opdef

        @functools.wraps(reference)
        def record(*args, **kwargs):
            from .network import record_op
            n_t = len(tensor_params)
            tensors = list(args) if variadic else list(args[:n_t])
            extra = [] if variadic else list(args[n_t:])
            attr_names = list(attr_defaults)
            if len(extra) > len(attr_names):
                raise GraphDSLError(f"{name}() takes {n_t} tensor argument(s) and attributes {attr_names}; "
                                    f"got {len(args)} positional arguments")
            attrs = dict(attr_defaults)
            for k, v in zip(attr_names, extra):
                attrs[k] = v
            for k, v in kwargs.items():
                if k in tensor_params and not variadic:
                    idx = tensor_params.index(k)
                    tensors.extend([None] * (idx + 1 - len(tensors)))
                    tensors[idx] = v
                elif k in attr_defaults:
                    attrs[k] = v
                else:
                    raise GraphDSLError(f"{name}() got an unexpected argument '{k}'; tensor inputs: "
                                        f"{list(tensor_params)}, attributes: {attr_names}")
            if not variadic and len(tensors) != n_t:
                raise GraphDSLError(f"{name}() needs tensor inputs {list(tensor_params)}, got {len(tensors)}")
            return record_op(opdef, tensors, attrs)

        record.opdef = opdef
        return record

    return deco


def check(cond: bool, op: str, msg: str):
    """Raise a :class:`ShapeError` for op ``op`` unless ``cond``."""
    if not cond:
        raise ShapeError(f"{op}: {msg}")
