"""Readable dumps of a :class:`~graphdsl.network.Network`: text, Graphviz DOT, JSON (loads back
into an equal network) and SVG (through the ``dot`` program)."""
from __future__ import annotations

import enum
import importlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import torch

from .dim import DimExpr, shape_str
from .dtypes import dtype_str, to_dtype
from .errors import GraphDSLError
from .opdef import RuntimeParam, Spec, get_op
from .tensor import Tensor

__all__ = ["to_text", "to_dot", "to_json", "from_json", "dump", "load", "encode_attr", "format_attrs"]

FORMAT_VERSION = 1


# -- attributes ------------------------------------------------------------------------------
def encode_attr(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return {"dtype": dtype_str(v)}
    if isinstance(v, DimExpr):
        return {"dim": v.to_json()}
    if isinstance(v, RuntimeParam):
        return {"runtime_param": v.name}
    if isinstance(v, enum.Enum):
        return {"enum": f"{type(v).__module__}:{type(v).__qualname__}", "value": v.name}
    if isinstance(v, (tuple, list)):
        return {"tuple": [encode_attr(x) for x in v]}
    raise GraphDSLError(f"attribute value {v!r} of type {type(v).__name__} cannot be serialised")


def decode_attr(v):
    if not isinstance(v, dict):
        return v
    if "dtype" in v:
        return to_dtype(v["dtype"])
    if "dim" in v:
        return DimExpr.from_json(v["dim"])
    if "runtime_param" in v:
        return RuntimeParam(v["runtime_param"])
    if "enum" in v:
        mod, qual = v["enum"].split(":")
        cls = importlib.import_module(mod)
        for part in qual.split("."):
            cls = getattr(cls, part)
        return cls[v["value"]]
    if "tuple" in v:
        return tuple(decode_attr(x) for x in v["tuple"])
    raise GraphDSLError(f"cannot decode attribute {v!r}")


def format_attrs(attrs: dict) -> str:
    def fmt(v):
        if isinstance(v, torch.dtype):
            return dtype_str(v)
        if isinstance(v, enum.Enum):
            return v.name
        if isinstance(v, tuple):
            return "(" + ", ".join(fmt(x) for x in v) + ("," if len(v) == 1 else "") + ")"
        if isinstance(v, float):
            return f"{v:g}"
        return str(v)
    return ", ".join(f"{k}={fmt(v)}" for k, v in attrs.items())


# -- text ------------------------------------------------------------------------------------
def _spec(t) -> str:
    return f"{shape_str(t.shape)} {dtype_str(t.dtype)}"


def to_text(net) -> str:
    """One line per node: ``%out = op(%in, ...) {attrs} : shape dtype  @module  (file:line)``."""
    from .nn import Parameter
    lines = [f"network '{net.name}': {len(net.inputs)} inputs, {len(net.nodes)} nodes, {len(net.outputs)} outputs"]
    for name, t in net.inputs.items():
        kind = "param" if isinstance(t, Parameter) else "input"
        lines.append(f"  {kind} %{name} : {_spec(t)}")
    for n in net.nodes:
        outs = ", ".join(f"%{t.name}" for t in n.outputs)
        args = ", ".join(f"%{t.name}" for t in n.inputs)
        attrs = format_attrs(n.attrs)
        specs = ", ".join(_spec(t) for t in n.outputs)
        where = f"  @{n.module}" if n.module else ""
        lines.append(f"  {outs} = {n.op}({args}){' {' + attrs + '}' if attrs else ''} : {specs}{where}  ({n.source})")
    for name, t in net.outputs.items():
        lines.append(f"  output {name} = %{t.name}")
    return "\n".join(lines)


# -- dot -------------------------------------------------------------------------------------
def _q(s: str) -> str:
    """A DOT string literal; newlines become DOT's centred line breaks."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(net) -> str:
    """Graphviz DOT: inputs as ellipses, ops as boxes (op, module), edges labelled with shapes."""
    from .nn import Parameter
    out = [f"digraph {_q(net.name)} {{", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    for name, t in net.inputs.items():
        color = "lightgrey" if isinstance(t, Parameter) else "lightblue"
        out.append(f"  {_q('in:' + name)} [shape=ellipse, style=filled, fillcolor={color}, label={_q(name)}];")
    for n in net.nodes:
        label = f"{n.name}\n{n.op}" + (f"\n@{n.module}" if n.module else "")
        out.append(f"  {_q(n.name)} [shape=box, label={_q(label)}];")
        for t in n.inputs:
            src = t.producer.name if t.producer is not None else "in:" + t.name
            out.append(f"  {_q(src)} -> {_q(n.name)} [label={_q(_spec(t))}];")
    for name, t in net.outputs.items():
        out.append(f"  {_q('out:' + name)} [shape=ellipse, style=filled, fillcolor=palegreen, label={_q(name)}];")
        src = t.producer.name if t.producer is not None else "in:" + t.name
        out.append(f"  {_q(src)} -> {_q('out:' + name)} [label={_q(_spec(t))}];")
    out.append("}")
    return "\n".join(out)


# -- json ------------------------------------------------------------------------------------
def _tensor_json(t) -> dict:
    shape = None if t.shape is None else [encode_attr(s) for s in t.shape]
    return {"name": t.name, "shape": shape, "dtype": None if t.dtype is None else dtype_str(t.dtype)}


def to_json(net) -> dict:
    from .nn import Parameter
    inputs = []
    for t in net.inputs.values():
        d = _tensor_json(t)
        if isinstance(t, Parameter):
            d["parameter"] = {"shard_dim": t.shard_dim}
        inputs.append(d)
    nodes = [{"name": n.name, "op": n.op, "inputs": [t.name for t in n.inputs],
              "outputs": [_tensor_json(t) for t in n.outputs],
              "attrs": {k: encode_attr(v) for k, v in n.attrs.items()},
              "module": n.module, "source": n.source} for n in net.nodes]
    return {"format": "graphdsl.network", "version": FORMAT_VERSION, "name": net.name, "inputs": inputs,
            "nodes": nodes, "outputs": {k: t.name for k, t in net.outputs.items()}}


def from_json(obj: dict):
    from .network import Network
    from .nn import Parameter
    if obj.get("format") != "graphdsl.network":
        raise GraphDSLError("not a graphdsl network JSON (missing \"format\": \"graphdsl.network\")")
    if obj.get("version") != FORMAT_VERSION:
        raise GraphDSLError(f"network JSON version {obj.get('version')} is not supported (expected {FORMAT_VERSION})")
    net = Network(obj["name"])
    by_name: dict[str, Tensor] = {}

    def shape(d):
        return None if d["shape"] is None else tuple(decode_attr(s) for s in d["shape"])

    for d in obj["inputs"]:
        if "parameter" in d:
            t = Parameter(shape(d), d["dtype"], shard_dim=d["parameter"]["shard_dim"], name=d["name"])
        else:
            t = Tensor(d["name"], shape(d), d["dtype"])
        net.inputs[t.name] = by_name[t.name] = t
    for d in obj["nodes"]:
        get_op(d["op"])
        try:
            ins = [by_name[x] for x in d["inputs"]]
        except KeyError as e:
            raise GraphDSLError(f"node '{d['name']}' reads unknown tensor {e}") from None
        specs = [Spec(shape(o), to_dtype(o["dtype"])) for o in d["outputs"]]
        node = net.new_node(d["op"], ins, {k: decode_attr(v) for k, v in d["attrs"].items()}, specs,
                            module=d["module"], source=d["source"], name=d["name"])
        for t, o in zip(node.outputs, d["outputs"]):
            t.name = o["name"]
            by_name[t.name] = t
    net.outputs = {k: by_name[v] for k, v in obj["outputs"].items()}
    return net


# -- files -----------------------------------------------------------------------------------
def dump(net, path) -> None:
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".dot", ".json", ".svg"):
        raise GraphDSLError(f"dump: unknown suffix '{path.suffix}' for {path}; use one of .txt .dot .json .svg")
    if path.is_dir():
        raise GraphDSLError(f"dump: '{path}' is a directory; give a file name ending in {suffix}")
    if path.parent.exists() and not path.parent.is_dir():
        raise GraphDSLError(f"dump: '{path.parent}' is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:                                  # a file where a folder should be, permissions
        raise GraphDSLError(f"dump: cannot create the folder '{path.parent}': {e.strerror}") from None
    if suffix == ".txt":
        path.write_text(to_text(net) + "\n")
    elif suffix == ".dot":
        path.write_text(to_dot(net) + "\n")
    elif suffix == ".json":
        path.write_text(json.dumps(to_json(net), indent=1) + "\n")
    elif suffix == ".svg":
        exe = shutil.which("dot")
        if exe is None:
            raise GraphDSLError(
                "writing .svg needs the Graphviz 'dot' program, which is not on PATH: install it "
                "(apt-get install graphviz / brew install graphviz / conda install graphviz) or dump "
                f"'{path.with_suffix('.dot')}' and render it elsewhere")
        res = subprocess.run([exe, "-Tsvg", "-o", os.fspath(path)], input=to_dot(net), text=True,
                             capture_output=True)
        if res.returncode != 0:
            raise GraphDSLError(f"'dot -Tsvg' failed: {res.stderr.strip()}")


def load(path):
    path = Path(path)
    if path.suffix.lower() != ".json":
        raise GraphDSLError(f"load reads .json dumps only, got '{path}'")
    if not path.is_file():
        raise GraphDSLError(f"load: '{path}' not found" if not path.exists() else f"load: '{path}' is not a file")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GraphDSLError(f"load: '{path}' is not a JSON graph dump: {e}") from None
    return from_json(obj)
