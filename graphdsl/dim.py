"""Named symbolic dimensions and the shape arithmetic built on them.

A shape is a tuple whose entries are ``int`` or :class:`DimExpr`. A :class:`Dim` is a named
leaf (``Dim("num_tokens", max=8192)``); ``+ - * //`` with ints or other dims build expressions.
Two dims are the same dimension when their names are equal. At run time the dims are *bound*:
every occurrence of one name, across all inputs of one call, must take one value
(:func:`bind_shapes`), and expressions are evaluated under that binding.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence, Union

from .errors import BindError, GraphDSLError

__all__ = ["Dim", "DimExpr", "Extent", "Shape", "minimum", "same_extent", "evaluate", "evaluate_shape",
           "bind_shapes", "shape_str", "numel"]


class DimExpr:
    """An integer expression over named dims: a tree of ``+ - * //`` with int leaves."""

    __slots__ = ("op", "args")
    _OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b,
            "*": lambda a, b: a * b, "//": lambda a, b: a // b, "min": min}

    def __init__(self, op: str, args: tuple):
        self.op, self.args = op, args

    # -- construction with light constant folding -------------------------------------------
    @staticmethod
    def _make(op: str, a: "Extent", b: "Extent") -> "Extent":
        if isinstance(a, int) and isinstance(b, int):
            return DimExpr._OPS[op](a, b)
        if op == "min" and a == b:
            return a
        if op == "+" and b == 0 or op == "-" and b == 0 or op in ("*", "//") and b == 1:
            return a
        if op == "+" and a == 0 or op == "*" and a == 1:
            return b
        if op == "*" and (a == 0 or b == 0):
            return 0
        if isinstance(a, DimExpr) and a.op == "*" and isinstance(a.args[1], int) and isinstance(b, int) and b > 0 \
                and a.args[1] > 0:
            e, c = a.args                 # (e * c) * b = e * (c b);  (e * c) // b = e * (c / b) or e // (b / c)
            if op == "*":
                return DimExpr._make("*", e, c * b)
            if op == "//" and c % b == 0:
                return DimExpr._make("*", e, c // b)
            if op == "//" and b % c == 0:
                return DimExpr._make("//", e, b // c)
        return DimExpr(op, (a, b))

    def __add__(self, o): return DimExpr._make("+", self, _check(o))
    def __radd__(self, o): return DimExpr._make("+", _check(o), self)
    def __sub__(self, o): return DimExpr._make("-", self, _check(o))
    def __rsub__(self, o): return DimExpr._make("-", _check(o), self)
    def __mul__(self, o): return DimExpr._make("*", self, _check(o))
    def __rmul__(self, o): return DimExpr._make("*", _check(o), self)
    def __floordiv__(self, o): return DimExpr._make("//", self, _check(o))
    def __rfloordiv__(self, o): return DimExpr._make("//", _check(o), self)

    # -- inspection ------------------------------------------------------------------------
    def free_dims(self) -> set["Dim"]:
        out: set[Dim] = set()
        for a in self.args:
            if isinstance(a, DimExpr):
                out |= a.free_dims()
        return out

    def evaluate(self, binding: Mapping[str, int]) -> int:
        a, b = (evaluate(x, binding) for x in self.args)
        return DimExpr._OPS[self.op](a, b)

    @property
    def max(self) -> int | None:
        """Upper bound from the leaves' ``max`` (None when any leaf is unbounded)."""
        if self.op == "min":
            bounds = [m for m in map(_max, self.args) if m is not None]
            return min(bounds) if bounds else None
        if self.op == "-" or self.op == "//":
            lo = _max(self.args[0])
            return None if lo is None else (lo if self.op == "-" else lo // _min_pos(self.args[1]))
        a, b = _max(self.args[0]), _max(self.args[1])
        return None if a is None or b is None else DimExpr._OPS[self.op](a, b)

    def __eq__(self, other):
        return isinstance(other, DimExpr) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def _key(self):
        return (self.op, tuple(a._key() if isinstance(a, DimExpr) else a for a in self.args))

    def __str__(self):
        if self.op == "min":
            return f"min({self.args[0]}, {self.args[1]})"
        a, b = (f"({x})" if isinstance(x, DimExpr) and x.op in "+-" and self.op in ("*", "//")
                else str(x) for x in self.args)
        return f"{a}{self.op}{b}" if self.op in ("*", "//") else f"{a} {self.op} {b}"

    __repr__ = __str__

    def __bool__(self):
        return True

    def __index__(self):
        raise GraphDSLError(
            f"dimension '{self}' is symbolic: its value is known only when the engine runs, so it "
            "cannot be used as a Python int while recording (use it in shapes instead)")

    __int__ = __index__

    def to_json(self):
        return {"op": self.op, "args": [a.to_json() if isinstance(a, DimExpr) else a for a in self.args]}

    @staticmethod
    def from_json(obj) -> "Extent":
        if isinstance(obj, int):
            return obj
        if "name" in obj:
            return Dim(obj["name"], max=obj.get("max"))
        a, b = (DimExpr.from_json(x) for x in obj["args"])
        return DimExpr._make(obj["op"], a, b)


class Dim(DimExpr):
    """A named symbolic dimension, e.g. ``Dim("num_tokens", max=8192)``.

    Dims with the same name are the same dimension; ``max`` (optional) bounds the value that a
    call may bind, and sizes the memory plan of engines built for the largest shape.
    """

    __slots__ = ("name", "_max")

    def __init__(self, name: str, max: int | None = None):  # noqa: A002 - torch-like keyword
        if not isinstance(name, str) or not name.isidentifier():
            raise GraphDSLError(f"Dim name must be an identifier string, got {name!r}")
        if max is not None and (not isinstance(max, int) or max < 1):
            raise GraphDSLError(f"Dim('{name}') max must be a positive int, got {max!r}")
        super().__init__("dim", ())
        self.name, self._max = name, max

    @property
    def max(self) -> int | None:
        return self._max

    def free_dims(self) -> set["Dim"]:
        return {self}

    def evaluate(self, binding: Mapping[str, int]) -> int:
        try:
            return binding[self.name]
        except KeyError:
            raise GraphDSLError(f"dimension '{self.name}' is not bound by any input") from None

    def _key(self):
        return ("dim", self.name)

    def __str__(self):
        return self.name

    def __repr__(self):
        return f"Dim({self.name!r}" + (f", max={self._max})" if self._max else ")")

    def to_json(self):
        return {"name": self.name, "max": self._max}


Extent = Union[int, DimExpr]
Shape = tuple  # tuple[Extent, ...]


def _check(o) -> Extent:
    if isinstance(o, bool) or not isinstance(o, (int, DimExpr)):
        raise GraphDSLError(f"dimension arithmetic takes ints or Dims, got {type(o).__name__} {o!r}")
    return o


def _max(x: Extent) -> int | None:
    return x if isinstance(x, int) else x.max


def _min_pos(x: Extent) -> int:
    return x if isinstance(x, int) else 1


def minimum(a: Extent, b: Extent) -> Extent:
    """min(a, b), symbolic when either is (slicing ``x[:100]`` on a dim ``n`` gives ``min(n, 100)``)."""
    return DimExpr._make("min", a, b)


def same_extent(a: Extent, b: Extent) -> bool | None:
    """True if equal, False if provably different, None if it depends on run-time values."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if a == b:
        return True
    return None


def evaluate(x: Extent, binding: Mapping[str, int]) -> int:
    return x if isinstance(x, int) else x.evaluate(binding)


def evaluate_shape(shape: Iterable[Extent], binding: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(evaluate(x, binding) for x in shape)


def numel(shape: Sequence[Extent]) -> Extent:
    n: Extent = 1
    for x in shape:
        n = n * x if isinstance(n, int) and isinstance(x, int) else DimExpr._make("*", n, x)
    return n


def shape_str(shape) -> str:
    if shape is None:
        return "[?]"
    return "[" + ", ".join(str(x) for x in shape) + "]"


def bind_shapes(declared: Mapping[str, Sequence[Extent]], actual: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """Bind every Dim in ``declared`` shapes to the sizes in ``actual``; return name -> value.

    Raises :class:`BindError` naming the tensor, the expected and the actual value when a rank
    or a static size differs, when one Dim takes two values (naming both inputs), when a bound
    value exceeds the Dim's ``max``, or when an expression such as ``n*2`` evaluates wrong.
    """
    binding: dict[str, int] = {}
    origin: dict[str, str] = {}
    deferred = []
    for name, shape in declared.items():
        got = tuple(actual[name])
        if len(got) != len(shape):
            raise BindError(f"input '{name}': expected rank {len(shape)} with shape {shape_str(shape)}, "
                            f"got rank {len(got)} with shape {list(got)}")
        for axis, (want, have) in enumerate(zip(shape, got)):
            where = f"'{name}' dim {axis}"
            if isinstance(want, int):
                if want != have:
                    raise BindError(f"input '{name}': expected shape {shape_str(shape)}, got {list(got)} "
                                    f"(dim {axis}: expected {want}, got {have})")
            elif isinstance(want, Dim):
                if want.max is not None and have > want.max:
                    raise BindError(f"input '{name}': dim {axis} ('{want.name}') is {have}, above its max {want.max}")
                if want.name in binding and binding[want.name] != have:
                    raise BindError(
                        f"dimension '{want.name}' is {binding[want.name]} in {origin[want.name]} but {have} in {where}; "
                        "the same Dim must have one value across all inputs of a call")
                binding.setdefault(want.name, have)
                origin.setdefault(want.name, where)
            else:
                deferred.append((name, shape, got, axis, want, have))
    for name, shape, got, axis, want, have in deferred:
        missing = [d.name for d in want.free_dims() if d.name not in binding]
        if missing:
            raise BindError(f"input '{name}': dim {axis} is '{want}', but {missing} is bound by no plain-Dim axis of any input")
        value = want.evaluate(binding)
        if value != have:
            raise BindError(f"input '{name}': dim {axis} is '{want}' = {value} under "
                            f"{ {k: binding[k] for k in sorted(d.name for d in want.free_dims())} }, got {have}")
    return binding
