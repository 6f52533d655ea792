"""Networks: the recorded graph of nodes, its inputs, outputs and the recording context.

Ops called on fake tensors append a :class:`Node` to the *current* network: the innermost
``with Network() as net:`` block of this thread, else the thread's default network
(:func:`get_default_net`). Record order is a topological order. Inputs are the tensors no node
produced (merged by name); parameters are inputs that are :class:`~graphdsl.nn.Parameter` s.
Every node keeps the module path (``model.layers.3.self_attn``) and the user's ``file:line``.
A ``networkx.MultiDiGraph`` view (:meth:`Network.to_networkx`) serves passes and drawing.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Iterable, Iterator

import networkx as nx
import torch

from .dim import shape_str
from .dtypes import dtype_str
from .errors import GraphDSLError, ShapeError, user_frame
from .opdef import OpCategory, OpDef, Spec, get_op
from .tensor import Tensor

__all__ = ["Node", "Network", "get_default_net", "record_op", "module_scope", "current_module_path"]


class Node:
    """One recorded op: ``outputs = op(*inputs, **attrs)``."""

    __slots__ = ("name", "op", "inputs", "outputs", "attrs", "module", "source", "net")

    def __init__(self, name: str, op: str, inputs: list[Tensor], attrs: dict, module: str, source: str,
                 net: "Network"):
        self.name, self.op, self.inputs, self.attrs = name, op, list(inputs), dict(attrs)
        self.module, self.source, self.net = module, source, net
        self.outputs: list[Tensor] = []

    @property
    def opdef(self) -> OpDef:
        return get_op(self.op)

    @property
    def category(self) -> OpCategory:
        return self.opdef.category

    def __repr__(self):
        return f"Node({self.name}: {self.op})"


class _State(threading.local):
    def __init__(self):
        self.stack: list[Network] = []
        self.default: Network | None = None
        self.modules: list[str] = []


_state = _State()


def get_default_net() -> "Network":
    """The network ops record into on this thread when no ``with Network():`` block is open.

    After ``build_engine()`` on it, a fresh default network replaces it.
    """
    if _state.stack:
        return _state.stack[-1]
    if _state.default is None:
        _state.default = Network("default")
    return _state.default


def _reset_default(net: "Network"):
    if _state.default is net:
        _state.default = Network("default")


@contextlib.contextmanager
def module_scope(path: str) -> Iterator[None]:
    """Tag nodes recorded inside with module path ``path`` (used by ``Module.__call__``)."""
    _state.modules.append(path)
    try:
        yield
    finally:
        _state.modules.pop()


def current_module_path() -> str:
    return _state.modules[-1] if _state.modules else ""


class Network:
    """A recorded graph. Use as ``with Network("name") as net:`` or via :func:`get_default_net`."""

    def __init__(self, name: str = "net"):
        self.name = name
        self.nodes: list[Node] = []
        self.inputs: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self._counter = itertools.count()
        # module path -> (input tensors, returned tensors) of its first call while recording; what a
        # diff against another framework aligns by (not serialised: a loaded graph has none)
        self.module_io: dict[str, tuple[list[Tensor], list[Tensor]]] = {}

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> "Network":
        _state.stack.append(self)
        return self

    def __exit__(self, *exc):
        _state.stack.remove(self)

    # -- building --------------------------------------------------------------------------
    def new_node(self, op: str, inputs: list[Tensor], attrs: dict, specs: list[Spec], *, module: str | None = None,
                 source: str | None = None, name: str | None = None) -> Node:
        """Append a node with outputs of the given specs (passes use this to insert ops)."""
        node = Node(name or f"{op}_{next(self._counter)}", op, inputs, attrs,
                    current_module_path() if module is None else module,
                    user_frame() if source is None else source, self)
        for i, s in enumerate(specs):
            tname = node.name if len(specs) == 1 else f"{node.name}:{i}"
            node.outputs.append(Tensor(tname, s.shape, s.dtype, _producer=node, _index=i))
        for t in inputs:
            if t.producer is None:
                self._add_input(t)
        self.nodes.append(node)
        return node

    def _add_input(self, t: Tensor):
        have = self.inputs.get(t.name)
        if have is None:
            self.inputs[t.name] = t
        elif have is not t:
            same = (have.shape == t.shape and have.dtype == t.dtype and type(have) is type(t))
            if not same:
                raise GraphDSLError(
                    f"two different inputs are named '{t.name}' in network '{self.name}': {have!r} and {t!r} "
                    f"(at {user_frame()}); give them different names or reuse one Tensor")

    def input(self, name: str, shape=None, dtype=None) -> Tensor:
        """Declare a graph input with a shape (ints/Dims) and dtype; returns its Tensor."""
        t = Tensor(name, shape, dtype)
        self._add_input(t)
        return self.inputs[name]

    def mark_output(self, t: Tensor, name: str | None = None) -> None:
        """Make ``t`` an engine output called ``name`` (default: the tensor's name)."""
        if not isinstance(t, Tensor):
            raise GraphDSLError(f"mark_output expects a graphdsl Tensor, got {type(t).__name__}")
        name = name or t.name
        if name in self.outputs and self.outputs[name] is not t:
            raise GraphDSLError(f"output name '{name}' is already marked in network '{self.name}'")
        if t.producer is not None and t.producer.net is not self:
            raise GraphDSLError(f"tensor '{t.name}' was recorded in network '{t.producer.net.name}', "
                                f"not in '{self.name}'")
        if t.producer is None:
            self._add_input(t)
        self.outputs[name] = t

    # -- queries ---------------------------------------------------------------------------
    @property
    def parameters(self) -> dict[str, Tensor]:
        from .nn import Parameter
        return {k: t for k, t in self.inputs.items() if isinstance(t, Parameter)}

    def tensors(self) -> Iterable[Tensor]:
        yield from self.inputs.values()
        for n in self.nodes:
            yield from n.outputs

    def consumers(self) -> dict[Tensor, list[Node]]:
        """Map each tensor to the nodes that read it, in node order."""
        users: dict[Tensor, list[Node]] = {t: [] for t in self.tensors()}
        for n in self.nodes:
            for t in n.inputs:
                users.setdefault(t, []).append(n)
        return users

    def to_networkx(self) -> nx.MultiDiGraph:
        """Graph view: one vertex per node (``kind="op"``), per input (``"input"``) and per output
        (``"output"``); one edge per tensor use, keyed by tensor name, carrying the tensor."""
        g = nx.MultiDiGraph(name=self.name)
        for name, t in self.inputs.items():
            g.add_node(f"input:{name}", kind="input", tensor=t)
        for n in self.nodes:
            g.add_node(n.name, kind="op", node=n)
            for t in n.inputs:
                src = t.producer.name if t.producer is not None else f"input:{t.name}"
                g.add_edge(src, n.name, key=t.name, tensor=t)
        for name, t in self.outputs.items():
            g.add_node(f"output:{name}", kind="output", tensor=t)
            src = t.producer.name if t.producer is not None else f"input:{t.name}"
            g.add_edge(src, f"output:{name}", key=t.name, tensor=t)
        return g

    # -- checking --------------------------------------------------------------------------
    def lint(self) -> None:
        """Check topology, names, the inputs table and shapes; raise listing every problem."""
        problems: list[str] = []
        seen: set[Tensor] = set(self.inputs.values())
        node_names, tensor_names = set(), set(self.inputs)
        for n in self.nodes:
            if n.name in node_names:
                problems.append(f"duplicate node name '{n.name}'")
            node_names.add(n.name)
            for t in n.inputs:
                if t not in seen:
                    where = "a later node" if t.producer is not None and t.producer.net is self else "outside the network"
                    problems.append(f"node '{n.name}' reads '{t.name}', produced by {where}")
            for i, t in enumerate(n.outputs):
                if t.producer is not n or t.index != i:
                    problems.append(f"node '{n.name}' output {i} ('{t.name}') does not point back to its node")
                if t.name in tensor_names:
                    problems.append(f"duplicate tensor name '{t.name}'")
                tensor_names.add(t.name)
                seen.add(t)
            try:
                specs = n.opdef.infer([Spec(t.shape, t.dtype) for t in n.inputs], n.attrs)
            except GraphDSLError as e:
                problems.append(f"node '{n.name}': shape rule fails: {e}")
                continue
            for t, s in zip(n.outputs, specs):
                if s.known and (s.shape != t.shape or s.dtype != t.dtype):
                    problems.append(f"node '{n.name}': output '{t.name}' is {shape_str(t.shape)} "
                                    f"{dtype_str(t.dtype)} but its rule gives {shape_str(s.shape)} {dtype_str(s.dtype)}")
        used = {t for n in self.nodes for t in n.inputs if t.producer is None}
        used |= {t for t in self.outputs.values() if t.producer is None}
        for name, t in self.inputs.items():
            if t.producer is not None:
                problems.append(f"input '{name}' has a producer")
        for name, t in self.outputs.items():
            if t not in seen:
                problems.append(f"output '{name}' ('{t.name}') is not in the network")
        if {t.name for t in used} - set(self.inputs):
            problems.append(f"inputs missing from the table: {sorted({t.name for t in used} - set(self.inputs))}")
        if problems:
            raise GraphDSLError(f"network '{self.name}' failed lint:\n  " + "\n  ".join(problems))

    # -- dumps (graphdsl.serialize) --------------------------------------------------------
    def __str__(self) -> str:
        from .serialize import to_text
        return to_text(self)

    def to_dot(self) -> str:
        from .serialize import to_dot
        return to_dot(self)

    def to_json(self) -> dict:
        from .serialize import to_json
        return to_json(self)

    @staticmethod
    def from_json(obj: dict) -> "Network":
        from .serialize import from_json
        return from_json(obj)

    def dump(self, path) -> None:
        """Write the graph to ``path``; the suffix picks the format: .txt .dot .json .svg."""
        from .serialize import dump
        dump(self, path)

    @staticmethod
    def load(path) -> "Network":
        """Load a network written by ``dump(path.json)``."""
        from .serialize import load
        return load(path)

    def __eq__(self, other) -> bool:
        from .serialize import to_json
        return isinstance(other, Network) and to_json(self) == to_json(other)

    __hash__ = object.__hash__

    # -- compiling -------------------------------------------------------------------------
    def build_engine(self, **options):
        """Compile this network into an :class:`~graphdsl.runtime.Engine`.

        Options go to :func:`graphdsl.runtime.build_engine` (``backend``, ``device``, ...).
        Building the default network replaces it with a fresh one, so the seed's
        record / mark_output / build_engine pattern can repeat.
        """
        from graphdsl.runtime.build import build_engine  # the language's one seam into runtime
        engine = build_engine(self, **options)
        _reset_default(self)
        return engine


def current_net() -> Network:
    return get_default_net()


def record_op(opdef: OpDef, tensors: list, attrs: dict):
    """Record ``opdef`` on ``tensors`` into the current network; return its output tensor(s)."""
    net = current_net()
    like = next((t for t in tensors if isinstance(t, Tensor)), None)
    args: list[Tensor] = []
    for i, t in enumerate(tensors):
        if isinstance(t, Tensor):
            args.append(t)
        elif isinstance(t, (int, float)) and not isinstance(t, bool) and opdef.category is OpCategory.POINTWISE and like is not None:
            args.append(record_op(get_op("scalar"), [like], {"value": t}))
        else:
            pname = opdef.tensor_params[i] if i < len(opdef.tensor_params) else f"#{i}"
            raise GraphDSLError(f"{opdef.name}(): argument '{pname}' must be a graphdsl Tensor, got "
                                f"{type(t).__name__} {t!r} (at {user_frame()})")
    for t in args:
        if t.producer is not None and t.producer.net is not net:
            raise GraphDSLError(f"{opdef.name}(): input '{t.name}' was recorded in network "
                                f"'{t.producer.net.name}' but the current network is '{net.name}' (at {user_frame()})")
    attrs = {k: _freeze(v) for k, v in attrs.items()}
    try:
        specs = opdef.infer([Spec(t.shape, t.dtype) for t in args], attrs)
    except ShapeError as e:
        mod = current_module_path()
        raise ShapeError(f"{e} (at {user_frame()}{', module ' + mod if mod else ''})") from None
    node = net.new_node(opdef.name, args, attrs, specs)
    return node.outputs[0] if len(node.outputs) == 1 and not callable(opdef.num_outputs) else tuple(node.outputs)


def _freeze(v):
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, tuple):
        return tuple(_freeze(x) for x in v)
    return v
