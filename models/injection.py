"""Operator injection rules (the ktransformers "optimize rules"): swap modules of an unchanged model
for other modules and place them on devices, before any weight is read.

A rule file is a YAML list; each rule is::

    - match:                       # both given: both must hold
        name: "^model\\.layers\\.\\d+\\.mlp\\.experts$"   # re.search over the module path
        class: graphdsl.layers.FusedExperts              # dotted class path, isinstance
      replace:
        class: graphdsl.models.cpu_experts.CPUExperts    # or "default": keep the module
        kwargs: {generate_device: cpu, out_device: cuda:0}
      recursive: false             # default true; false: the matched module's children get no rule

:func:`apply_rules` walks the module tree parents first; a module takes the first rule that matches
it. A replacement class is built as ``cls(key, config, orig_module, **kwargs)`` (``key``: the
module path; ``orig_module``: the module it replaces, for its shapes and children) and declares its
:class:`~graphdsl.Parameter` s like any module, so the loaders bind weights by name. The placement
keys (``device``, ``generate_device``, ``prefill_device``, ``out_device``) are recorded on the
matched module (:func:`placement_of`) and inherited by its descendants.

Every malformed rule is a :class:`InjectionRuleError` naming the rule's index, the field and the
value; a rule that matches no module gives an :class:`InjectionWarning`.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from graphdsl import Module
from graphdsl.errors import GraphDSLError

__all__ = ["InjectionRuleError", "InjectionWarning", "Rule", "Placement", "InjectedModule", "InjectionReport",
           "load_rules", "apply_rules", "placement_of", "check_placements", "device_labeller", "normalize_device", "PLACEMENT_KEYS", "builtin_rules"]

#: kwargs that place a module rather than configure it; ``default`` accepts only these.
PLACEMENT_KEYS = ("device", "generate_device", "prefill_device", "out_device")
#: the seed's op-choice keys; an injected class declares whether it takes them.
OP_KEYS = ("generate_op", "prefill_op")


class InjectionRuleError(GraphDSLError):
    """A malformed optimize rule: the message names the rule index, the field and the value."""


class InjectionWarning(UserWarning):
    """An optimize rule that matched no module."""


class _Match(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    class_: str | None = Field(None, alias="class")

    @field_validator("name")
    @classmethod
    def _regex(cls, v):
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regular expression ({e})") from None
        return v


class _Replace(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    class_: str = Field("default", alias="class")
    kwargs: dict[str, Any] = Field(default_factory=dict)


class Rule(BaseModel):
    """One validated rule (``match``, ``replace``, ``recursive``); build them with :func:`load_rules`."""

    model_config = ConfigDict(extra="forbid")
    match: _Match
    replace: _Replace = Field(default_factory=_Replace)
    recursive: bool = True

    def matches(self, path: str, module: Module, cls: type | None) -> bool:
        if self.match.name is not None and re.search(self.match.name, path) is None:
            return False
        return cls is None or isinstance(module, cls)

    def describe(self) -> str:
        parts = [f"name={self.match.name!r}"] if self.match.name is not None else []
        if self.match.class_ is not None:
            parts.append(f"class={self.match.class_}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Placement:
    """Where a module runs: ``generate`` (decode) and ``prefill`` devices and where its output goes
    (``out``); None: the model's device."""

    generate: str | None = None
    prefill: str | None = None
    out: str | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "Placement | None":
        dev = kwargs.get("device")
        gen = kwargs.get("generate_device", dev)
        pre = kwargs.get("prefill_device", gen)
        out = kwargs.get("out_device")
        return None if gen is None and pre is None and out is None else cls(gen, pre, out)


class InjectedModule(Module):
    """Base of replacement modules: the constructor protocol ``(key, config, orig_module, **kwargs)``
    with the placement keys stored on the instance. Subclasses declare Parameters and ``forward``
    like any module (weights are bound by name; ``checkpoint_slots`` maps packed checkpoints)."""

    def __init__(self, key: str, config, orig_module: Module, *, device: str | None = None,
                 generate_device: str | None = None, prefill_device: str | None = None,
                 out_device: str | None = None):
        super().__init__()
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "placement", Placement.from_kwargs(
            {k: v for k, v in dict(device=device, generate_device=generate_device, prefill_device=prefill_device,
                                   out_device=out_device).items() if v is not None}))


@dataclass
class InjectionReport:
    """What :func:`apply_rules` did: ``{module path: (rule index, class name)}`` of every matched module."""

    matched: dict[str, tuple[int, str]] = field(default_factory=dict)
    unmatched_rules: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{path}: rule {i} -> {cls}" for path, (i, cls) in self.matched.items()]
        lines += [f"rule {i}: matched nothing" for i in self.unmatched_rules]
        return "\n".join(lines)


def _err(index: int, fieldname: str, value, why: str) -> InjectionRuleError:
    return InjectionRuleError(f"optimize rule {index}: field '{fieldname}' {why}, got {value!r}")


def _import_class(path: str, index: int, fieldname: str) -> type:
    """A class named ``package.module.Class``, or ``file.py:Class`` (a file path, relative to the
    working directory: a user's module that is not installed, as ``--custom-module-map`` takes)."""
    if ".py:" in path:
        file, _, name = path.rpartition(":")
        try:
            obj = getattr(_load_file(file), name)
        except (OSError, ImportError, AttributeError, SyntaxError) as e:
            raise _err(index, fieldname, path, f"does not import ({type(e).__name__}: {e})") from None
    else:
        mod, _, name = path.rpartition(".")
        if not mod:
            raise _err(index, fieldname, path, "must be a dotted class path such as graphdsl.layers.RMSNorm, "
                                               "or file.py:Class")
        try:
            obj = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError) as e:
            raise _err(index, fieldname, path, f"does not import ({type(e).__name__}: {e})") from None
    if not (isinstance(obj, type) and issubclass(obj, Module)):
        raise _err(index, fieldname, path, "must name a graphdsl Module subclass")
    return obj


def _load_file(file: str):
    """The module of a ``.py`` file, loaded once per absolute path."""
    import importlib.util
    import sys
    full = os.path.abspath(file)
    key = "graphdsl_injected_" + re.sub(r"\W", "_", full)
    if key not in sys.modules:
        if not os.path.isfile(full):
            raise FileNotFoundError(f"no such file {full}")
        spec = importlib.util.spec_from_file_location(key, full)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]


def _check_kwargs(rule: Rule, index: int) -> None:
    kwargs = rule.replace.kwargs
    for k in PLACEMENT_KEYS:
        v = kwargs.get(k)
        if v is not None and not _valid_device(v):
            raise _err(index, f"replace.kwargs.{k}", v, "must be a device such as 'cpu', 'cuda' or 'cuda:1'")
    if "transfer_map" in kwargs:
        _check_transfer_map(kwargs["transfer_map"], index)
    if rule.replace.class_ == "default":
        extra = sorted(set(kwargs) - set(PLACEMENT_KEYS) - {"transfer_map"})
        if extra:
            raise _err(index, "replace.kwargs", extra[0] if len(extra) == 1 else extra,
                       f"holds keys 'default' does not accept (it keeps the module; allowed: {list(PLACEMENT_KEYS)})")
        return
    cls = _import_class(rule.replace.class_, index, "replace.class")
    sig = inspect.signature(cls)
    try:
        sig.bind("key", None, None, **kwargs)
    except TypeError as e:
        raise _err(index, "replace.kwargs", kwargs, f"is not accepted by {cls.__name__} ({e})") from None
    if issubclass(cls, InjectedModule) and any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        # **kwargs of an InjectedModule go on to InjectedModule.__init__, which takes the placement keys only
        named = {n for n, p in sig.parameters.items() if p.kind is not p.VAR_KEYWORD}
        extra = sorted(set(kwargs) - named - set(PLACEMENT_KEYS))
        if extra:
            raise _err(index, "replace.kwargs", extra[0] if len(extra) == 1 else extra,
                       f"is not accepted by {cls.__name__} (it takes {sorted(named - {'key', 'config', 'orig_module'})}"
                       f" and the placement keys {list(PLACEMENT_KEYS)})")


def _check_transfer_map(tm, index: int) -> None:
    if not isinstance(tm, dict) or not tm:
        raise _err(index, "replace.kwargs.transfer_map", tm, "must be a non-empty mapping {layer index: device}")
    for k, v in tm.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise _err(index, "replace.kwargs.transfer_map", k, "keys must be layer indices (ints >= 0)")
        if not _valid_device(v):
            raise _err(index, f"replace.kwargs.transfer_map.{k}", v, "must be a device such as 'cpu' or 'cuda:1'")


def _valid_device(v) -> bool:
    if not isinstance(v, str):
        return False
    try:
        import torch
        torch.device(v)
    except (RuntimeError, TypeError):
        return False
    return True


def load_rules(rules: "str | os.PathLike | Sequence[dict] | Sequence[Rule]") -> list[Rule]:
    """Validated rules from a YAML file path, a YAML string holding a list, or a list of dicts."""
    if isinstance(rules, (str, os.PathLike)):
        import yaml
        text = os.fspath(rules)
        inline = isinstance(rules, str) and ("\n" in text or text.lstrip().startswith(("-", "[")))
        if not inline and not os.path.isfile(text):
            raise InjectionRuleError(f"optimize_rules: no such rule file, got {text!r}")
        try:
            data = yaml.safe_load(text if inline else open(text).read())
        except yaml.YAMLError as e:
            raise InjectionRuleError(f"optimize_rules: not valid YAML ({str(e).splitlines()[0]}), got {text!r}") from None
    else:
        data = rules
    if not isinstance(data, (list, tuple)):
        raise InjectionRuleError(f"optimize_rules: expected a list of rules, got {type(data).__name__}: {data!r}")
    out = []
    for i, raw in enumerate(data):
        if isinstance(raw, Rule):
            rule = raw
        else:
            if not isinstance(raw, dict):
                raise _err(i, "<rule>", raw, "must be a mapping with match/replace/recursive")
            try:
                rule = Rule.model_validate(raw)
            except ValidationError as e:
                first = e.errors()[0]
                loc = ".".join(str(p) for p in first["loc"])
                why = first["msg"].replace("Value error, ", "")
                if first["type"] == "extra_forbidden":
                    why = "is not a known key (known: match.name, match.class, replace.class, replace.kwargs, recursive)"
                raise _err(i, loc, first.get("input"), why) from None
        if rule.match.name is None and rule.match.class_ is None:
            raise _err(i, "match", raw, "needs 'name' and/or 'class'")
        if rule.match.class_ is not None:
            _import_class(rule.match.class_, i, "match.class")
        _check_kwargs(rule, i)
        out.append(rule)
    return out


def apply_rules(model: Module, rules, config=None) -> InjectionReport:
    """Apply ``rules`` (anything :func:`load_rules` takes) to ``model`` in place; returns the report.

    Parents are visited before children; each module takes the first rule that matches it. A
    replaced module's children (the replacement's own) are visited when the rule is recursive.
    ``config`` (default: ``model.config``) is passed to replacement constructors."""
    rules = load_rules(rules)
    config = config if config is not None else getattr(model, "config", None)
    classes = [None if r.match.class_ is None else _import_class(r.match.class_, i, "match.class")
               for i, r in enumerate(rules)]
    report = InjectionReport()
    used = set()
    stack = [(n, c) for n, c in model.named_children()]
    while stack:
        path, module = stack.pop(0)
        idx = next((i for i, r in enumerate(rules) if r.matches(path, module, classes[i])), None)
        children_of = module
        if idx is not None:
            used.add(idx)
            rule = rules[idx]
            if rule.replace.class_ != "default":
                cls = _import_class(rule.replace.class_, idx, "replace.class")
                try:
                    new = cls(path, config, module, **rule.replace.kwargs)
                except GraphDSLError as e:
                    raise InjectionRuleError(f"optimize rule {idx}: {cls.__name__} for '{path}': {e}") from None
                model.set_submodule(path, new)
                children_of = new
            placement = Placement.from_kwargs(rule.replace.kwargs)
            if placement is not None and getattr(children_of, "weight_device", None) is None:
                object.__setattr__(children_of, "_placement", placement)
            if "transfer_map" in rule.replace.kwargs:
                _apply_transfer_map(children_of, rule.replace.kwargs["transfer_map"], idx, path)
            report.matched[path] = (idx, type(children_of).__name__)
            if not rule.recursive:
                continue
        stack[0:0] = [(f"{path}.{n}", c) for n, c in children_of.named_children()]
    report.unmatched_rules = [i for i in range(len(rules)) if i not in used]
    for i in report.unmatched_rules:
        warnings.warn(f"optimize rule {i} ({rules[i].describe()}) matched no module", InjectionWarning, stacklevel=2)
    return report


def _apply_transfer_map(module: Module, tm: dict, index: int, path: str) -> None:
    """Place ``module.layers[i:]`` on ``tm[i]`` (until the next key): a pipeline split of the stack."""
    layers = module._modules.get("layers")
    if layers is None:
        raise InjectionRuleError(f"optimize rule {index}: field 'replace.kwargs.transfer_map' needs a module with "
                                 f"a 'layers' list, but '{path}' ({type(module).__name__}) has children "
                                 f"{list(module._modules)}")
    n = len(layers._modules)
    bad = [k for k in tm if k >= n]
    if bad:
        raise InjectionRuleError(f"optimize rule {index}: field 'replace.kwargs.transfer_map' has layer index "
                                 f"{bad[0]}, but '{path}.layers' has {n} layers (0..{n - 1})")
    keys = sorted(tm)
    for i in range(keys[0], n):
        dev = tm[max(k for k in keys if k <= i)]
        object.__setattr__(layers._modules[str(i)], "_placement", Placement(dev, dev, None))


def placement_of(model: Module, path: str) -> Placement | None:
    """The placement of the module at ``path``: its own, else its nearest placed ancestor's (a path
    that leaves the tree, e.g. the root's class name in recorded nodes, stops at the last module)."""
    parts = path.split(".") if path else []
    found = model.__dict__.get("_placement")
    m = model
    for p in parts:
        m = m._modules.get(p)
        if m is None:
            break
        found = m.__dict__.get("_placement", found)
    return found


def normalize_device(dev) -> str:
    """``dev`` as a label: ``cuda`` becomes ``cuda:<current>`` so one GPU has one name."""
    import torch
    d = torch.device(dev)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return str(d)


def device_labeller(model: Module, home):
    """``node -> device label`` for the partitioner, or None when every module runs on ``home``.

    A node of a placed module (its own placement or an ancestor's) runs there. A node of an unplaced
    module that holds parameters runs on ``home``, where the loader puts those parameters
    (:meth:`FlashCausalLM.parameter_devices`): the final norm and ``lm_head`` after a
    ``transfer_map`` split run back on ``home``. Any other node runs where its data is: on the
    device of its first input made by another node (so a parameter-free shared module such as
    ``model.rotary_emb`` runs inside the layer that calls it), else on ``home``. Call it on nodes in
    record order."""
    home_label = normalize_device(home)
    placed = {normalize_device(m.__dict__["_placement"].generate) for _, m in model.named_modules()
              if "_placement" in m.__dict__ and m.__dict__["_placement"].generate is not None}
    if not placed - {home_label}:
        return None
    explicit: dict[str, str | None] = {}
    labels: dict = {}

    def label(node) -> str:
        path = node.module
        if path not in explicit:
            p = placement_of(model, path)
            explicit[path] = normalize_device(p.generate) if p is not None and p.generate is not None else None
        dev = explicit[path]
        if dev is None and _owns_parameters(model, path):
            dev = home_label
        if dev is None:
            dev = next((labels[t.producer] for t in node.inputs if t.producer in labels), home_label)
        labels[node] = dev
        return dev
    return label


def _owns_parameters(model: Module, path: str) -> bool:
    """Whether the module at ``path`` (a recorded node's module path) exists and has parameters of its own."""
    m = model
    for p in path.split(".") if path else []:
        m = m._modules.get(p)
        if m is None:
            return False
    return bool(m._parameters)


def check_placements(model: Module, device) -> None:
    """Check placements against the model's ``device``: a kept (``default``) module has one copy of
    its weights, so its ``prefill_device`` must equal its ``generate_device``; a CUDA placement
    needs a CUDA machine. Injected modules that place their own work (``weight_device``, e.g. CPU
    experts) are theirs to check."""
    import torch
    for path, m in model.named_modules():
        p = m.__dict__.get("_placement")
        if not path or p is None or getattr(m, "weight_device", None) is not None:
            continue
        if p.generate is not None and p.prefill is not None and \
                normalize_device(p.generate) != normalize_device(p.prefill):
            raise InjectionRuleError(
                f"optimize rules place '{path}' ({type(m).__name__}) with generate_device={p.generate!r} and "
                f"prefill_device={p.prefill!r}; a kept module has one copy of its weights, so both must be equal")
        for dev in (p.generate, p.prefill):
            if dev is not None and torch.device(dev).type == "cuda" and not torch.cuda.is_available():
                raise InjectionRuleError(f"optimize rules place '{path}' ({type(m).__name__}) on {dev!r}, but "
                                         f"this machine has no CUDA device (the model runs on {device})")


def builtin_rules(name: str) -> str:
    """The path of a rule file shipped in ``graphdsl/models/optimize_rules`` (``name`` without ``.yaml``)."""
    here = os.path.join(os.path.dirname(__file__), "optimize_rules")
    path = os.path.join(here, f"{name}.yaml")
    if not os.path.exists(path):
        have = sorted(f[:-5] for f in os.listdir(here) if f.endswith(".yaml")) if os.path.isdir(here) else []
        raise InjectionRuleError(f"builtin_rules: name must be one of {have}, got {name!r}")
    return path
