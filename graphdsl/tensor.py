"""The fake tensor that model code computes on.

A :class:`Tensor` holds no data: a name, a shape (ints and :class:`~graphdsl.Dim` s, or None when
not known until the first call), a dtype, and the :class:`~graphdsl.network.Node` that produced
it (None for graph inputs). Python operators and methods record ops into the current network.
Anything that needs a value — ``bool(t)``, ``t.item()``, ``int(t)``, iterating — raises
:class:`~graphdsl.GraphDSLError` naming the user's source line, because a recorded graph has no
data-dependent control flow.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .dim import DimExpr, shape_str
from .dtypes import dtype_str, to_dtype
from .errors import GraphDSLError, user_frame

if TYPE_CHECKING:
    from .network import Node

__all__ = ["Tensor"]


class Tensor:
    """A symbolic tensor. ``Tensor("x")`` declares a graph input named ``x``.

    Args:
        name: input name (required for inputs; produced tensors are named by their node).
        shape: optional tuple of ints / Dims; omitted means "specialise on the first call".
        dtype: optional torch dtype or name (``"float16"``); omitted likewise.
    """

    __slots__ = ("name", "shape", "dtype", "producer", "index", "__weakref__")

    def __init__(self, name: str | None = None, shape=None, dtype=None, *, _producer: "Node | None" = None,
                 _index: int = 0):
        if _producer is None and (not isinstance(name, str) or not name):
            raise GraphDSLError(f"a graph input Tensor needs a non-empty string name, got {name!r}")
        if shape is not None:
            shape = tuple(shape)
            for s in shape:
                if isinstance(s, bool) or not isinstance(s, (int, DimExpr)) or (isinstance(s, int) and s < 0):
                    raise GraphDSLError(f"Tensor '{name}': shape entries must be ints >= 0 or Dims, got {shape!r}")
        self.name = name
        self.shape = shape
        self.dtype = to_dtype(dtype, f"Tensor '{name}' dtype")
        self.producer = _producer
        self.index = _index

    # -- identity ----------------------------------------------------------------------------
    @property
    def is_input(self) -> bool:
        """True for graph inputs (and parameters): tensors no node produced."""
        return self.producer is None

    @property
    def ndim(self) -> int:
        if self.shape is None:
            raise GraphDSLError(f"tensor '{self.name}' has no known shape yet (declare it, e.g. "
                                f"Tensor('{self.name}', shape=(Dim('n'), 64)), to use its rank while recording)")
        return len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def size(self, d: int | None = None):
        if d is None:
            return self.shape
        return self.shape[d] if self.shape is not None else self.ndim

    def __repr__(self):
        return f"Tensor({self.name!r}, shape={shape_str(self.shape)}, dtype={dtype_str(self.dtype)})"

    __hash__ = object.__hash__

    def __eq__(self, other):  # identity, so tensors can key dicts (use F.eq for elementwise ==)
        return self is other

    # -- data-dependent use is an error ------------------------------------------------------
    def _no_data(self, what: str):
        raise GraphDSLError(
            f"{what} on graph tensor '{self.name}' at {user_frame()}: a recorded graph has no data "
            "while it is built, so Python control flow cannot depend on tensor values. "
            "Use F.where(...) for data-dependent selection, or compute the value outside the graph "
            "and pass it as an input or runtime parameter.")

    def __bool__(self): self._no_data("bool()")
    def item(self): self._no_data(".item()")
    def tolist(self): self._no_data(".tolist()")
    def numpy(self): self._no_data(".numpy()")
    def __int__(self): self._no_data("int()")
    def __float__(self): self._no_data("float()")
    def __index__(self): self._no_data("using a tensor as a Python index")
    def __iter__(self): self._no_data("iterating")

    def __len__(self):
        if self.shape is None or not self.shape or not isinstance(self.shape[0], int):
            raise GraphDSLError(f"len() on graph tensor '{self.name}' at {user_frame()}: its first dimension is "
                                f"{'unknown' if not self.shape else repr(self.shape[0])}, not a Python int")
        return self.shape[0]

    # -- operators (recorded) ----------------------------------------------------------------
    def __add__(self, o): return F.add(self, o)
    def __radd__(self, o): return F.add(o, self)
    def __sub__(self, o): return F.sub(self, o)
    def __rsub__(self, o): return F.sub(o, self)
    def __mul__(self, o): return F.mul(self, o)
    def __rmul__(self, o): return F.mul(o, self)
    def __truediv__(self, o): return F.div(self, o)
    def __rtruediv__(self, o): return F.div(o, self)
    def __matmul__(self, o): return F.matmul(self, o)
    def __rmatmul__(self, o): return F.matmul(o, self)
    def __neg__(self): return F.neg(self)
    def __pow__(self, o): return F.pow(self, o)
    def __rpow__(self, o): return F.pow(o, self)
    def __lt__(self, o): return F.lt(self, o)
    def __le__(self, o): return F.le(self, o)
    def __gt__(self, o): return F.gt(self, o)
    def __ge__(self, o): return F.ge(self, o)
    def __getitem__(self, idx): return F.getitem(self, idx)

    # -- torch functions (recorded; graphdsl/torch_functions.py) -----------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """``torch.relu(t)``, ``torch.nn.functional.silu(t)``, ``torch.cat([a, b])`` ... on graph tensors
        record the matching graphdsl op; a torch function without one raises naming it."""
        from .torch_functions import record_torch_function
        return record_torch_function(func, args, kwargs or {})

    # -- methods (recorded) ------------------------------------------------------------------
    def reshape(self, *shape): return F.reshape(self, _varargs(shape))
    view = reshape
    def permute(self, *dims): return F.permute(self, _varargs(dims))
    def transpose(self, dim0: int, dim1: int): return F.transpose(self, dim0, dim1)
    def unsqueeze(self, dim: int): return F.unsqueeze(self, dim)
    def squeeze(self, dim: int): return F.squeeze(self, dim)
    def expand(self, *shape): return F.expand(self, _varargs(shape))
    def contiguous(self): return self
    def to(self, *args, dtype=None, device=None, non_blocking: bool = False, copy: bool = False):
        """torch's ``to``: a dtype (or its name), or a tensor whose dtype to follow. Graph tensors have
        no device — the engine runs where its inputs are (or ``build_engine(device=)``) — so a device
        argument is an error, not a silent no-op."""
        for a in args:
            if (isinstance(a, (torch.device, int)) and not isinstance(a, bool)) or _is_device_name(a):
                device = a
            elif dtype is None:
                dtype = a
            else:
                raise GraphDSLError(f"to(): more than one dtype in {args!r} (at {user_frame()})")
        if device is not None:
            self._no_device(f"to({device!r})")
        if dtype is None and not args:
            raise GraphDSLError(f"to() on graph tensor '{self.name}' needs a dtype or a tensor to follow "
                                f"(at {user_frame()})")
        return F.cast(self, dtype)

    def cuda(self, *args, **kwargs): self._no_device(".cuda()")
    def cpu(self): self._no_device(".cpu()")

    def _no_device(self, what: str):
        raise GraphDSLError(f"{what} on graph tensor '{self.name}' at {user_frame()}: graph tensors have no device; "
                            "the engine runs on the device of its inputs (or the one given to build_engine(device=)), "
                            "so model code names none. to() takes a dtype here.")
    def float(self): return F.cast(self, torch.float32)
    def half(self): return F.cast(self, torch.float16)
    def bfloat16(self): return F.cast(self, torch.bfloat16)
    def sum(self, dim=None, keepdim: bool = False): return F.sum(self, dim, keepdim)
    def mean(self, dim=None, keepdim: bool = False): return F.mean(self, dim, keepdim)
    def max(self, dim=None, keepdim: bool = False): return F.max(self, dim, keepdim)
    def exp(self): return F.exp(self)
    def sqrt(self): return F.sqrt(self)
    def rsqrt(self): return F.rsqrt(self)
    def sigmoid(self): return F.sigmoid(self)
    def tanh(self): return F.tanh(self)
    def pow(self, e): return F.pow(self, e)
    def softmax(self, dim: int = -1): return F.softmax(self, dim)
    def relu(self): return F.relu(self)
    def neg(self): return F.neg(self)
    def add(self, o, *, alpha=1): return F.add(self, o if alpha == 1 else o * alpha)
    def sub(self, o, *, alpha=1): return F.sub(self, o if alpha == 1 else o * alpha)
    def mul(self, o): return F.mul(self, o)
    def div(self, o): return F.div(self, o)
    def matmul(self, o): return F.matmul(self, o)
    def argmax(self, dim: int = -1, keepdim: bool = False): return F.argmax(self, dim=dim, keepdim=keepdim)
    def chunk(self, chunks: int, dim: int = 0): return F.split(self, chunks, dim)
    def split(self, split_size, dim: int = 0): return _torch_fn(torch.split, self, split_size, dim)
    def flatten(self, start_dim: int = 0, end_dim: int = -1): return _torch_fn(torch.flatten, self, start_dim, end_dim)
    def type_as(self, other): return F.cast(self, other)
    def view_as(self, other): return F.reshape(self, other.shape)
    reshape_as = view_as
    def expand_as(self, other): return F.expand(self, other.shape)
    def t(self): return _torch_fn(torch.t, self)

    @property
    def T(self):  # noqa: N802 - torch name
        """``t()``: a matrix transposed (torch deprecates ``.T`` beyond rank 2; use ``mT`` or ``permute``)."""
        return self.t()

    @property
    def mT(self):  # noqa: N802 - torch name
        """The last two dims swapped."""
        return F.transpose(self, -2, -1)


def _is_device_name(x) -> bool:
    """A string torch reads as a device (``"cuda"``, ``"cpu"``, ``"cuda:1"``) rather than a dtype name."""
    if not isinstance(x, str):
        return False
    try:
        torch.device(x)
    except (RuntimeError, ValueError):
        return False
    return True


def _torch_fn(func, *args):
    from .torch_functions import record_torch_function
    return record_torch_function(func, args, {})


def _varargs(args):
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else tuple(args)


from . import functional as F  # noqa: E402  (methods call the functional ops; cycle broken here)
