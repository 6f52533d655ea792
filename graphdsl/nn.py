"""Torch-like modules over fake tensors: :class:`Module`, :class:`ModuleList`, :class:`Parameter`.

Modules are pure architecture. ``__init__`` declares children and parameters (shape, dtype and an
optional tensor-parallel shard dim); ``forward`` composes functional ops. No weights live here:
they are bound by name after the graph is built, so injection rules can swap modules first.
Calling a module records its ops with the module's dotted path (``model.layers.3.self_attn``);
parameters take their names from that path (``model.layers.3.self_attn.o_proj.weight``).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

from .errors import GraphDSLError
from .network import module_scope
from .tensor import Tensor

__all__ = ["Module", "ModuleList", "Parameter"]


class Parameter(Tensor):
    """A named weight: a graph input bound later by name (``engine.set_weights`` / loaders).

    Args:
        shape: tuple of ints (Dims allowed).
        dtype: torch dtype or name; None adopts the dtype of the engine's bound weight.
        shard_dim: for tensor parallelism, the dim split across ranks (None: replicated).
        name: only for parameters used outside a Module; a module tree names its own.
    """

    __slots__ = ("shard_dim", "quant", "_companions")

    def __init__(self, shape, dtype=None, shard_dim: int | None = None, name: str = "<unnamed parameter>"):
        super().__init__(name, shape, dtype)
        if shard_dim is not None and (not isinstance(shard_dim, int) or not -len(self.shape) <= shard_dim < len(self.shape)):
            raise GraphDSLError(f"Parameter shard_dim must be a dim of shape {list(self.shape)}, got {shard_dim!r}")
        self.shard_dim = shard_dim
        self.quant = None
        self._companions = None

    def quantize(self, scheme) -> "Parameter":
        """Store this ``[out, in]`` weight, or ``[experts, out, in]`` stack of expert weights, in
        quantization ``scheme`` (a :class:`~graphdsl.quant.QuantScheme` or its name; ``None`` undoes
        it). Its data then lives in companion parameters named ``<name><suffix>`` (:meth:`companions`),
        which ``F.linear`` reads through ``quant_linear`` (a stack: ``quant_moe_experts``)."""
        from .quant import QuantScheme, parse_scheme
        if scheme is not None:
            scheme = scheme if isinstance(scheme, QuantScheme) else parse_scheme(scheme)
            if len(self.shape) == 3:
                scheme.check_stack(self.name, tuple(self.shape))
            else:
                scheme.check(self.name, tuple(self.shape))
        self.quant, self._companions = scheme, None
        return self

    def companions(self) -> list["Parameter"]:
        """The stored tensors of a quantized weight, named after this parameter's current name
        (empty when not quantized)."""
        if self.quant is None:
            return []
        key = (self.name, self.quant)
        if self._companions is None or self._companions[0] != key:
            specs = (self.quant.stack_companions(*self.shape) if len(self.shape) == 3 else
                     self.quant.companions(*self.shape))
            made = [Parameter(c.shape, c.dtype if c.dtype is not None else self.dtype,
                              self.shard_dim if c.per_row else None,     # an input permutation is not sharded
                              name=f"{self.name}{c.suffix}") for c in specs]
            self._companions = (key, made)
        return self._companions[1]

    def __repr__(self):
        q = f", quant={self.quant.name}" if self.quant is not None else ""
        return f"Parameter({self.name!r}, shape={list(self.shape)}, dtype={self.dtype}, shard_dim={self.shard_dim}{q})"


class Module:
    """Base class of graphdsl modules (torch.nn.Module's shape, fake tensors inside)."""

    def __init__(self):
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_path", "")

    def __setattr__(self, name: str, value):
        if "_modules" not in self.__dict__:
            raise GraphDSLError(f"{type(self).__name__}: call super().__init__() before assigning attributes")
        self._modules.pop(name, None)
        self._parameters.pop(name, None)
        if isinstance(value, Module):
            self._modules[name] = value
        elif isinstance(value, Parameter):
            self._parameters[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str):
        self._modules.pop(name, None)
        self._parameters.pop(name, None)
        object.__delattr__(self, name)

    # -- tree --------------------------------------------------------------------------------
    def named_children(self) -> Iterator[tuple[str, "Module"]]:
        yield from self._modules.items()

    def children(self) -> Iterator["Module"]:
        yield from self._modules.values()

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        """(dotted path, module) for this module and every descendant, parents first."""
        seen: set[int] = set()
        stack = [(prefix, self)]
        while stack:
            path, m = stack.pop(0)
            if id(m) in seen:
                continue
            seen.add(id(m))
            yield path, m
            stack[0:0] = [(f"{path}.{n}" if path else n, c) for n, c in m._modules.items()]

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """(full dotted name, parameter) over the tree; also names each Parameter tensor."""
        for path, m in self.named_modules(prefix):
            for n, p in m._parameters.items():
                full = f"{path}.{n}" if path else n
                p.name = full
                yield full, p

    def parameters(self) -> Iterator[Parameter]:
        for _, p in self.named_parameters():
            yield p

    def get_submodule(self, path: str) -> "Module":
        m = self
        for part in path.split(".") if path else []:
            if part not in m._modules:
                raise GraphDSLError(f"{type(m).__name__} has no submodule '{part}' (in path '{path}'); "
                                    f"children: {list(m._modules)}")
            m = m._modules[part]
        return m

    def set_submodule(self, path: str, module: "Module") -> None:
        """Replace the module at dotted ``path`` (used by injection rules); it keeps its place among
        its siblings, so parameter order (and anything drawn in that order) is unchanged."""
        if not isinstance(module, Module):
            raise GraphDSLError(f"set_submodule: module must be a Module, got {type(module).__name__}")
        parent_path, _, leaf = path.rpartition(".")
        parent = self.get_submodule(parent_path)
        if leaf not in parent._modules:
            raise GraphDSLError(f"no submodule '{path}' to replace")
        parent._modules[leaf] = module
        if not isinstance(parent, ModuleList):
            object.__setattr__(parent, leaf, module)

    # -- calling -----------------------------------------------------------------------------
    def _assign_paths(self):
        for path, m in self.named_modules():
            object.__setattr__(m, "_path", path)
        for _ in self.named_parameters():
            pass

    def __call__(self, *args, **kwargs):
        from .network import current_module_path
        if not current_module_path():           # outermost call: name the whole tree
            self._assign_paths()
        path = self._path or type(self).__name__
        with module_scope(path):
            out = self.forward(*args, **kwargs)
        _note_io(path, list(args) + list(kwargs.values()), out)
        return out

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def extra_repr(self) -> str:
        return ""

    def __repr__(self):
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, m in self._modules.items():
            sub = repr(m).replace("\n", "\n  ")
            lines.append(f"  ({name}): {sub}")
        return "\n".join(lines) + (")" if len(lines) == 1 else "\n)")


def _tensors(value) -> list:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _note_io(path: str, args, out) -> None:
    """Remember a module call's tensor inputs and returns in the current network (first call wins)."""
    from .network import current_net
    net = current_net()
    if path not in net.module_io:
        net.module_io[path] = (_tensors(list(args)), _tensors(out))


class ModuleList(Module):
    """A list of modules, named ``0``, ``1``, ... in paths."""

    def __init__(self, modules=()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, m: Module) -> "ModuleList":
        if not isinstance(m, Module):
            raise GraphDSLError(f"ModuleList holds Modules, got {type(m).__name__}")
        self._modules[str(len(self._modules))] = m
        return self

    def _set(self, i: int, m: Module):
        self._modules[str(i)] = m

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __setitem__(self, i: int, m: Module):
        self._set(i % len(self), m)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._modules.values()))
